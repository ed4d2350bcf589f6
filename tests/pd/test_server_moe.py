"""A mixture-of-experts model (a tiny Qwen3-MoE with SmolLM2's tokenizer) through real servers and the
openai client: `--dp 2 --ep 2` (each rank holds half the experts, the ranks exchange tokens every MoE
layer) gives the tokens and logprobs of a single `--ep 1` engine bit for bit in deterministic mode,
with expert rebalancing moving experts every few steps; /metrics shows the experts' load; a P/D pair
of a tiny gpt-oss (sliding-window layers with attention sinks: pages and SWA state travel) whose PE
runs `--dp 2 --ep 2` passes bench/check_pd.py against a single engine; killing one rank of the group
fails the group's requests at once and the group comes back as one."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from pd.config import ServerConfig
from pd.tools.server_process import PDPair, ServerProcess, get_json
from tests.server_fixtures import (
    SMALL_DETERMINISTIC,
    greedy_completions,
    openai_client,
    run_check_pd,
    serving,
    story_prompts,
    wait_pair_idle,
)
from tests.tiny_models import make_servable

pytestmark = pytest.mark.slow

EPLB_INTERVAL = 3  # engine steps between rebalancings: several per request
PROMPTS = story_prompts(10)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.checkpoints import resolve_model

    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return str(make_servable("qwen3_moe", folder, resolve_model("smollm2-135m-instruct")))


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.checkpoints import resolve_model

    folder = tmp_path_factory.mktemp("tiny-gpt-oss")
    return str(make_servable("gpt_oss", folder, resolve_model("smollm2-135m-instruct")))


@pytest.fixture(scope="module")
def servers(
    moe_model: str, gpt_oss_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess, ServerProcess, PDPair]]:
    """A single engine and a --dp 2 --ep 2 server with rebalancing (Qwen3-MoE); a single engine and a
    P/D pair whose PE is --dp 2 --ep 2 (gpt-oss)."""
    logs = tmp_path_factory.mktemp("moe")
    args = ("--model", moe_model, *SMALL_DETERMINISTIC, "--hicache-gb", "0")
    ref = ServerProcess(*args, log_path=logs / "ref.log")
    ep = ServerProcess(
        *args, "--dp", "2", "--ep", "2", "--eplb-interval", str(EPLB_INTERVAL), "--rank-restart-backoff-s", "1",
        log_path=logs / "ep.log",
    )  # fmt: skip
    oss = ("--model", gpt_oss_model, *SMALL_DETERMINISTIC, "--hicache-gb", "0")
    oss_ref = ServerProcess(*oss, log_path=logs / "oss_ref.log")
    pair = PDPair(*oss, log_dir=logs, pe_args=("--dp", "2", "--ep", "2"))
    every = (ref, ep, oss_ref, pair)
    with serving(*every):
        yield ref, ep, oss_ref, pair


def completions(url: str, model: str, concurrency: int) -> list[tuple[str, list[float]]]:
    return greedy_completions(url, model, PROMPTS, concurrency)


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def stat(url_port: int, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text(url_port).splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_ep2_equals_ep1_bit_for_bit_with_rebalancing(servers, moe_model) -> None:
    ref, ep, _, _ = servers
    want = completions(ref.url, moe_model, 1)
    assert len({text for text, _ in want}) > 1  # the prompts do not all give the same answer
    # one request at a time (a rank idles through its peer's steps) and ten at once (both ranks busy)
    for concurrency in (1, 10):
        assert completions(ep.url, moe_model, concurrency) == want, concurrency
    chat = [{"role": "user", "content": "Name three colours."}]
    a = openai_client(ref.url).chat.completions.create(model=moe_model, messages=chat, max_tokens=12, temperature=0)
    b = openai_client(ep.url).chat.completions.create(model=moe_model, messages=chat, max_tokens=12, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    # the rebalancing ran and moved experts between the ranks (else the identity above shows nothing of it)
    assert stat(ep.port, "pdserve_engine_eplb_rebalances_total") > 0
    assert stat(ep.port, "pdserve_engine_eplb_experts_moved_total") > 0


def test_metrics_show_the_experts_load(servers) -> None:
    _, ep, _, _ = servers
    # the ranks' figures are as old as their last heartbeat: until both ranks' rows of every sparse layer are in
    deadline = time.monotonic() + 30
    while True:
        text = metrics_text(ep.port)
        rank_rows = [ln for ln in text.splitlines() if ln.startswith("pdserve_moe_rank_rows_total{")]
        if len(rank_rows) >= 3 * 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(rank_rows) == 3 * 2  # both ranks computed rows in every sparse layer
    # layer 1 is dense: layers 0, 2, 3 have 8 experts each
    experts = [ln for ln in text.splitlines() if ln.startswith("pdserve_moe_expert_tokens_total{")]
    assert len(experts) == 3 * 8 and {'layer="1"' in ln for ln in experts} == {False}
    assert sum(float(ln.rsplit(" ", 1)[1]) for ln in experts) > 0
    for name in ("pdserve_moe_expert_imbalance", "pdserve_moe_rank_imbalance"):
        values = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{")]
        assert len(values) == 3 and all(v >= 1.0 for v in values), (name, values)


def test_gpt_oss_pd_pair_with_an_ep2_pe_matches_single_engine(servers, capsys) -> None:
    _, _, ref, pair = servers
    assert run_check_pd(ref, pair, "--concurrency", "4", "--parallel", "8") == 0
    out = capsys.readouterr().out
    assert "DIFF" not in out and "FAIL" not in out
    wait_pair_idle(pair)


def test_config_refuses_ep_that_is_not_dp() -> None:
    with pytest.raises(ValueError, match="--ep"):
        ServerConfig(dp=2, ep=3)
    assert ServerConfig().ep == 1
    from engine.config import EngineConfig

    assert EngineConfig().eplb_interval == 0  # rebalancing is never on unless asked for


def test_killing_one_ep_rank_fails_the_groups_requests_and_restarts_it(servers, moe_model) -> None:
    """Runs last in the module: it kills a rank of the --ep 2 server."""
    ref, ep, _, _ = servers
    client = openai_client(ep.url, timeout_s=60)
    streams: dict[str, object] = {}

    def stream(name: str, prompt: str) -> None:
        t0 = time.monotonic()
        try:
            for _ in client.completions.create(
                model=moe_model, prompt=prompt, max_tokens=900, stream=True, extra_body={"ignore_eos": True}
            ):
                pass
            streams[name] = ("finished", time.monotonic() - t0)
        except openai.APIError as e:
            streams[name] = ("error", time.monotonic() - t0, str(e))

    def whole(name: str, prompt: str) -> None:
        try:
            client.completions.create(model=moe_model, prompt=prompt, max_tokens=900, extra_body={"ignore_eos": True})
            streams[name] = ("finished",)
        except openai.APIStatusError as e:
            streams[name] = ("error", e.status_code, str(e))

    # streams and whole requests on both ranks (affinity routing spreads distinct prompts)
    threads = [threading.Thread(target=stream, args=(f"s{i}", p)) for i, p in enumerate(PROMPTS[:4])]
    threads += [threading.Thread(target=whole, args=(f"w{i}", p)) for i, p in enumerate(PROMPTS[4:6])]
    for t in threads:
        t.start()
    time.sleep(1.0)
    pids = ep.rank_pids()
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(60)
    assert all(not t.is_alive() for t in threads)
    # every stream of the group failed, within seconds (none was left waiting in a collective)
    assert all(v[0] == "error" for v in streams.values()), streams
    assert [v[1] for k, v in sorted(streams.items()) if k.startswith("w")] == [503, 503], streams
    assert time.monotonic() - killed_at < 30
    status, health = get_json(ep.url + "/health")
    assert all(r["state"] != "up" or r["num_restarts"] >= 1 for r in health["ranks"]), health
    # both ranks restart together and serve the same tokens again
    deadline = time.monotonic() + 60
    while True:
        status, health = get_json(ep.url + "/health")
        if status == 200 and all(r["state"] == "up" for r in health["ranks"]):
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.3)
    assert [r["num_restarts"] for r in health["ranks"]] == [1, 1]
    assert completions(ep.url, moe_model, 4) == completions(ref.url, moe_model, 1)
