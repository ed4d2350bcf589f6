"""Tensor parallelism with expert parallelism through real servers and the openai client, on the CPU
(gloo over loopback): a tiny Qwen3-MoE with SmolLM2's tokenizer served by `--dp 2 --tp 2 --ep 4` (one
world of four processes, engine/parallel/world.py: each rank's pair splits attention by heads, all four split
the experts, rebalanced every few steps) gives the greedy tokens of a single `--tp 1 --ep 1` server,
logprobs within 1e-4, and in deterministic mode the same bits one request at a time and ten at once;
a P/D pair whose PE and CE are each a `--tp 2 --ep 2` world hands off (streamed, delta handoffs
included) and bench/check_pd.py finds its tokens the single server's; a killed follower takes the whole
world down (every rank's requests fail at once) and it comes back as one, followers and all, serving
the same tokens."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pd.config import ServerConfig
from pd.tools.server_process import ServerProcess, free_port, get_json, wait_idle
from tests.server_fixtures import (
    SMALL_DETERMINISTIC,
    greedy_completions,
    openai_client,
    serving,
    story_prompts,
)
from tests.tiny_models import make_servable

pytestmark = pytest.mark.slow

PROMPTS = story_prompts(10)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.checkpoints import resolve_model

    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return str(make_servable("qwen3_moe", folder, resolve_model("smollm2-135m-instruct")))


@pytest.fixture(scope="module")
def servers(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    logs = tmp_path_factory.mktemp("tp_ep")
    args = ("--model", model, *SMALL_DETERMINISTIC, "--hicache-gb", "0")
    ref = ServerProcess(*args, log_path=logs / "ref.log")
    world = ServerProcess(
        *args, "--dp", "2", "--tp", "2", "--ep", "4", "--eplb-interval", "3", "--rank-restart-backoff-s", "1",
        log_path=logs / "world.log",
    )  # fmt: skip
    with serving(ref, world):
        yield ref, world


@pytest.fixture  # one test's: ended before the kill test, whose timing it would load
def pair(servers, model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A PE and a CE, each a `--tp 2 --ep 2` world of two processes; the PE prefills in chunks of 64 tokens
    (a long prompt's pages stream, merged from the group's heads after each chunk). Their pages are smaller
    than the reference's: deterministic mode's tokens do not depend on the page size."""
    logs = tmp_path_factory.mktemp("tp_ep_pair")
    # pages of 16 tokens: a conversation's later turns find whole pages in the CE's decode cache
    args = ("--model", model, *SMALL_DETERMINISTIC, "--hicache-gb", "0", "--tp", "2", "--ep", "2", "--block-size", "16")
    env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": "pd-test-cluster-token-0123456789"}
    env.pop("PDSERVE_CLUSTER_TOKEN_FILE", None)
    pe = ServerProcess(*args, "--role", "pe", "--max-num-batched-tokens", "64", log_path=logs / "pe.log", env=env)
    ce = ServerProcess(
        *args, "--role", "ce", "--accept-transports", "tcp", "--prefill-url", pe.url, "--kv-port-base", str(free_port()),
        log_path=logs / "ce.log", env=env,
    )  # fmt: skip
    with serving(pe, ce):
        yield pe, ce


def completions(url: str, model: str, concurrency: int) -> list[tuple[str, list[float]]]:
    return greedy_completions(url, model, PROMPTS, concurrency)


def assert_close(got: list[tuple[str, list[float]]], want: list[tuple[str, list[float]]]) -> None:
    for (text, lps), (ref_text, ref_lps) in zip(got, want):
        assert text == ref_text
        assert len(lps) == len(ref_lps) and max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


def stat(url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith((name + "{", name + " ")))


def test_world_serves_the_tokens_of_a_single_engine(servers, model: str) -> None:
    ref, world = servers
    want = completions(ref.url, model, 1)
    assert len({text for text, _ in want}) > 1  # the prompts do not all give the same answer
    one_at_a_time = completions(world.url, model, 1)  # a rank idles through the other's steps
    assert_close(one_at_a_time, want)
    assert completions(world.url, model, 10) == one_at_a_time  # both ranks busy: the same bits
    assert stat(world.url, "pdserve_engine_eplb_rebalances_total") > 0
    assert stat(world.url, "pdserve_engine_eplb_experts_moved_total") > 0


@pytest.mark.timeout(900)
def test_a_pd_pair_of_tp_ep_worlds_serves_the_tokens_of_a_single_engine(servers, pair, capsys) -> None:
    from bench import check_pd

    (ref, _), (pe, ce) = servers, pair
    only = "chat short greedy,chat long greedy,chat seeded sampling,conversation greedy,concurrent conversations"
    code = check_pd.main(
        ["--ref", ref.url, "--pd", ce.url, "--max-tokens", "8", "--concurrency", "2", "--only", only, "--parallel", "4"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "5/5 cases identical" in out, out
    assert wait_idle(ce.port, timeout_s=60)["pdserve_engine_handoffs_imported_total"] >= 10  # every request
    assert stat(ce.url, "pdserve_handoff_streamed_pages_total") > 0  # pages sent while the PE prefilled
    assert stat(ce.url, "pdserve_handoff_skipped_tokens_total") > 0  # later turns: delta handoffs
    assert wait_idle(pe.port, timeout_s=60)["pdserve_engine_handoffs_streamed_total"] > 0


def test_config_refuses_other_ep_sizes() -> None:
    with pytest.raises(ValueError, match=r"--ep must be 1 or equal to --dp x --tp = 4 .*got 2"):
        ServerConfig(dp=2, tp=2, ep=2)
    assert ServerConfig(dp=2, tp=2, ep=4).ep == 4 and ServerConfig(role="pe", dp=2, tp=2, ep=4).ep == 4


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_killing_a_follower_restarts_the_world(servers, model: str) -> None:
    """Runs last in the module: kills rank 1's follower mid-generation; every in-flight request of both
    ranks fails (503 for whole ones) within seconds, and both ranks come back, followers and all."""
    ref, world = servers
    client = openai_client(world.url, timeout_s=60)
    results: dict[str, object] = {}

    def whole(name: str, prompt: str) -> None:
        try:
            client.completions.create(model=model, prompt=prompt, max_tokens=900, extra_body={"ignore_eos": True})
            results[name] = "finished"
        except openai.APIStatusError as e:
            results[name] = e.status_code

    threads = [threading.Thread(target=whole, args=(f"w{i}", p)) for i, p in enumerate(PROMPTS[:6])]
    for t in threads:
        t.start()
    time.sleep(1.0)
    _, health = get_json(world.url + "/health")
    assert all(r["num_inflight"] for r in health["ranks"]), health  # both ranks serve (affinity spreads them)
    pids = world.rank_pids()
    (follower,) = _children(pids[1])
    os.kill(follower, signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert set(results.values()) == {503}, results
    assert time.monotonic() - killed_at < 30
    deadline = time.monotonic() + 90
    while True:
        status, health = get_json(world.url + "/health")
        if status == 200 and all(r["state"] == "up" for r in health["ranks"]):
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.3)
    assert [r["num_restarts"] for r in health["ranks"]] == [1, 1]
    new = world.rank_pids()
    assert all(new[r] != pids[r] and len(_children(new[r])) == 1 for r in (0, 1))
    assert_close(completions(world.url, model, 4), completions(ref.url, model, 1))
