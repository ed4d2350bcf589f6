from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pd.tools.server_process import PDPair, ServerProcess, free_port
from tests.server_fixtures import SMALL_DETERMINISTIC, serving

SMOLLM = "smollm2-135m-instruct"
KV_TCP_STREAMS = 4  # the pair's PE stripes its handoffs (--kv-tcp-streams): every module sharing it covers that
# the pair's PE prefills in chunks of this many tokens: a longer prompt streams its handoff (--kv-stream,
# on for tcp), its pages going while later chunks compute; --deterministic keeps the tokens those of the
# reference's one-chunk prefill
PE_CHUNK_TOKENS = 256
# the cluster token of the P/D tests that drive the roles and the /prefill client by hand (no server)
CLUSTER_TOKEN = "unit-test-cluster-token-0123456789"
# the shared servers' KV event streams: "ref" (the single server), "pe" and "ce" (the pair) -> (endpoint, replay)
KV_EVENTS: dict[str, tuple[str, str]] = {}


@pytest.fixture(scope="session")
def smollm_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, PDPair]]:
    """SmolLM2-135M-Instruct with SMALL_DETERMINISTIC: a single-engine server and a P/D pair beside it,
    started once for every module that asks (the OpenAI surface, lm-evaluation-harness, the single
    server's end-to-end and concurrency tests, the pair's end-to-end tests) rather than once per module.
    A test leaves them serving and idle; what it counts on a server's /metrics it counts as a
    difference, not from zero."""
    logs = tmp_path_factory.mktemp("smollm")
    for name in ("ref", "pe", "ce"):  # every engine publishes its KV events (tests/pd/kv_events read them)
        KV_EVENTS[name] = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")

    def events(name: str) -> tuple[str, str]:
        endpoint, replay = KV_EVENTS[name]
        config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv"}
        return "--kv-events-config", json.dumps(config)

    ref = ServerProcess("--model", SMOLLM, *SMALL_DETERMINISTIC, *events("ref"), log_path=logs / "ref.log")
    pair = PDPair("--model", SMOLLM, *SMALL_DETERMINISTIC, log_dir=logs,
                  pe_args=("--kv-tcp-streams", str(KV_TCP_STREAMS),
                           "--max-num-batched-tokens", str(PE_CHUNK_TOKENS), *events("pe")),
                  ce_args=events("ce"))  # fmt: skip
    with serving(ref, pair):
        yield ref, pair
