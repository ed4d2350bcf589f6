"""Streamed handoffs on the session's SmolLM2 pair (tcp, --kv-stream auto: on; the PE prefills in chunks of
PE_CHUNK_TOKENS): a prompt of several chunks sends its pages while the later chunks compute, the tokens
are the single engine's, and the metrics say what went early and what the handoff added to TTFT."""

from __future__ import annotations

import urllib.request

import pytest

from pd.tools.server_process import PDPair, ServerProcess, rank_metrics
from tests.pd.conftest import PE_CHUNK_TOKENS
from tests.server_fixtures import openai_client, wait_pair_idle

pytestmark = pytest.mark.slow  # the session's servers

MODEL = "smollm2-135m-instruct"
# about 1,400 tokens: 6 chunks of PE_CHUNK_TOKENS on the PE, 11 pages of 128 tokens that can go early
LONG = "Notes: " + " ".join(f"Entry {i}: item {i} weighs {i * 11 % 17} units." for i in range(90))


def _cluster_metrics(url: str) -> dict[str, float]:
    """The CE coordinator's streaming and TTFT-phase series (summed over labels but phase)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        after_phase = 'phase="transfer_after_prefill"' in name  # beside model_name, in either order
        for key, prefix, wanted in (
            ("streamed", "pdserve_handoff_streamed_pages_total{", True),
            ("early", "pdserve_handoff_early_pages_total{", True),
            ("after_count", "pdserve_ttft_phase_seconds_count{", after_phase),
            ("after_sum", "pdserve_ttft_phase_seconds_sum{", after_phase),
        ):
            if wanted and name.startswith(prefix):
                out[key] = out.get(key, 0.0) + float(value)
    return out


def test_a_prompt_of_several_chunks_streams_its_pages_and_matches_the_single_engine(smollm_servers):
    streams_a_long_prompt(*smollm_servers)


def streams_a_long_prompt(ref: ServerProcess, pair: PDPair) -> None:
    """LONG through the pair (its PE prefilling in chunks of PE_CHUNK_TOKENS) = through ref; its pages went
    in parts, some before the prefill ended, and the metrics count it."""
    before, pe_before = _cluster_metrics(pair.url), rank_metrics(pair.pe.port)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=12, temperature=0)
    got = openai_client(pair.url).chat.completions.create(**kw)
    want = openai_client(ref.url).chat.completions.create(**kw)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage is not None and got.usage.prompt_tokens > 4 * PE_CHUNK_TOKENS
    wait_pair_idle(pair)
    after, pe_after = _cluster_metrics(pair.url), rank_metrics(pair.pe.port)
    pages = (got.usage.prompt_tokens - 1) // 128  # every page but the last prompt token's may stream
    streamed = after["streamed"] - before.get("streamed", 0.0)
    early = after["early"] - before.get("early", 0.0)
    # the pages of all chunks but the last were sent in parts, and some had gone before the prefill ended
    assert 0 < early <= streamed <= pages, (early, streamed, pages)
    assert streamed >= pages - (PE_CHUNK_TOKENS // 128 + 1)
    assert after["after_count"] == before.get("after_count", 0.0) + 1
    # the handoff's part after the prefill is a part of the whole handoff
    after_s = after["after_sum"] - before.get("after_sum", 0.0)
    assert after_s > 0
    sent = "pdserve_engine_handoff_pages_sent_before_prefill_end_total"
    assert pe_after[sent] - pe_before.get(sent, 0.0) == early
    streams = "pdserve_engine_handoffs_streamed_total"
    assert pe_after[streams] == pe_before.get(streams, 0.0) + 1


def test_a_prompt_of_one_chunk_is_not_streamed(smollm_servers):
    """Its pages are all complete only when the prefill ends: one offer carries them, as without --kv-stream."""
    ref, pair = smollm_servers
    before = _cluster_metrics(pair.url)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name two rivers."}], max_tokens=4, temperature=0)
    got = openai_client(pair.url).chat.completions.create(**kw)
    assert got.choices[0].message.content == openai_client(ref.url).chat.completions.create(**kw).choices[0].message.content
    wait_pair_idle(pair)
    after = _cluster_metrics(pair.url)
    assert after.get("streamed", 0.0) == before.get("streamed", 0.0)
    assert after["after_count"] == before.get("after_count", 0.0) + 1
