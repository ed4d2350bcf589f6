"""16 concurrent streams give exactly what the same requests give one at a time (greedy, --deterministic),
and the KV pool is empty afterwards (seen through /metrics). The server: the session's SmolLM2
single-engine server (tests/pd/conftest.py; --max-num-seqs 32, so the 16 run in one batch)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from pd.tools.server_process import wait_idle
from tests.server_fixtures import openai_client

MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm_servers):
    return smollm_servers[0]


def stream_text(client: OpenAI, **kw) -> tuple[str, str | None]:
    text, finish = "", None
    for ch in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
    return text, finish


def test_concurrent_streams_match_sequential(server):
    client = openai_client(server.url, timeout_s=900)
    prompts = [f"Write one short sentence about the number {i}." for i in range(16)]

    def run(p: str) -> tuple[str, str | None]:
        return stream_text(client, messages=[{"role": "user", "content": p}], max_tokens=6, temperature=0)

    with ThreadPoolExecutor(16) as ex:
        concurrent = list(ex.map(run, prompts))
    sequential = [run(p) for p in prompts]
    assert all(text for text, _ in sequential)
    assert concurrent == sequential
    m = wait_idle(server.port)
    assert m["pdserve_kv_cache_usage_ratio"] == 0.0
    assert m["pdserve_generation_tokens_total"] >= 2 * 16
