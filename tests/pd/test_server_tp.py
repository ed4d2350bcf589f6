"""Tensor parallelism through real servers and the openai client, on the CPU (gloo over loopback): a
tiny Llama with SmolLM2's tokenizer served by `--dp 2 --tp 2` (each rank's process starts a follower
process; they split every layer's heads and MLP rows and the LM head's vocabulary) gives the greedy
tokens of a `--tp 1` server, logprobs within 1e-4, one request at a time and several at once (both
ranks busy), streamed chat too; a killed follower takes its rank down (its requests fail) and the rank
comes back, follower and all, serving the same tokens, while the other rank serves on."""

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
from pd.tools.server_process import ServerProcess, get_json
from tests.server_fixtures import (
    SMALL_DETERMINISTIC,
    greedy_completions,
    openai_client,
    serving,
    story_prompts,
)
from tests.tiny_models import make_servable
from transfer.config import TransferConfig, nixl_installed

pytestmark = pytest.mark.slow

PROMPTS = story_prompts(8)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.checkpoints import resolve_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    return str(make_servable("llama", folder, resolve_model("smollm2-135m-instruct")))


@pytest.fixture(scope="module")
def servers(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    logs = tmp_path_factory.mktemp("tp")
    args = ("--model", model, *SMALL_DETERMINISTIC)
    ref = ServerProcess(*args, log_path=logs / "ref.log")
    tp = ServerProcess(*args, "--dp", "2", "--tp", "2", "--rank-restart-backoff-s", "1", log_path=logs / "tp.log")
    with serving(ref, tp):
        yield ref, tp


def completions(url: str, model: str, concurrency: int) -> list[tuple[str, list[float]]]:
    return greedy_completions(url, model, PROMPTS, concurrency)


def assert_same(got: list[tuple[str, list[float]]], want: list[tuple[str, list[float]]]) -> None:
    for (text, lps), (ref_text, ref_lps) in zip(got, want):
        assert text == ref_text
        assert len(lps) == len(ref_lps) and max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


def test_tp2_serves_the_tokens_of_tp1(servers, model: str) -> None:
    ref, tp = servers
    want = completions(ref.url, model, 1)
    assert len({text for text, _ in want}) > 1  # the prompts do not all give the same answer
    for concurrency in (1, 6):
        assert_same(completions(tp.url, model, concurrency), want)
    chat = [{"role": "user", "content": "Name three colours."}]
    a = openai_client(ref.url).chat.completions.create(model=model, messages=chat, max_tokens=12, temperature=0)
    stream = openai_client(tp.url).chat.completions.create(
        model=model, messages=chat, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == a.choices[0].message.content


def test_config_refuses_what_tp_does_not_do_yet() -> None:
    """--tp with --role pe|ce hands off over tcp and nixl only (tests/pd/disagg/test_pair_tp.py runs both)."""
    with pytest.raises(ValueError, match="--tp 2 with --role pe hands off over --transport tcp or nixl only"):
        ServerConfig(role="pe", tp=2, transfer=TransferConfig(transport="nccl"))
    with pytest.raises(ValueError, match="--tp 2 with --role ce takes handoffs over tcp and nixl only so far: pass --accept-transports tcp,nixl"):
        ServerConfig(role="ce", tp=2)
    tcp = TransferConfig(accept_transports=("tcp",))
    assert ServerConfig(role="pe", tp=2).tp == ServerConfig(role="ce", tp=2, transfer=tcp).tp == 2
    if nixl_installed():
        both = TransferConfig(transport="nixl", accept_transports=("tcp", "nixl"))
        assert ServerConfig(role="pe", tp=2, transfer=both).tp == ServerConfig(role="ce", tp=2, transfer=both).tp
    with pytest.raises(ValueError, match="--ep must be 1 or equal to --dp x --tp = 4"):  # test_server_tp_ep.py
        ServerConfig(dp=2, ep=2, tp=2)
    with pytest.raises(ValueError, match="--tp must be >= 1"):
        ServerConfig(tp=0)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_killing_the_follower_restarts_the_rank(servers, model: str) -> None:
    """Runs last in the module: kills the follower process of the rank that serves a stream and a
    whole request, mid-generation: the stream ends in an error, the whole request gets 503."""
    ref, tp = servers
    client = openai_client(tp.url, timeout_s=60)
    result: dict[str, object] = {}

    def stream() -> None:
        try:
            for _ in client.completions.create(
                model=model, prompt=PROMPTS[0], max_tokens=900, stream=True, extra_body={"ignore_eos": True}
            ):
                pass
            result["s"] = "finished"
        except openai.APIError as e:
            result["s"] = f"error: {e}"

    def whole() -> None:  # the same prompt: the same rank (affinity)
        try:
            client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=900, extra_body={"ignore_eos": True})
            result["w"] = "finished"
        except openai.APIStatusError as e:
            result["w"] = e.status_code

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    _, health = get_json(tp.url + "/health")
    (busy,) = [r["rank"] for r in health["ranks"] if r["num_inflight"]]
    rank_pid = tp.rank_pids()[busy]
    (follower,) = _children(rank_pid)
    os.kill(follower, signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert str(result["s"]).startswith("error") and result["w"] == 503, result
    deadline = time.monotonic() + 60
    while True:
        status, health = get_json(tp.url + "/health")
        if status == 200 and all(r["state"] == "up" for r in health["ranks"]):
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.3)
    assert [r["num_restarts"] for r in health["ranks"]] == [int(r == busy) for r in range(2)]
    new_pid = tp.rank_pids()[busy]
    assert new_pid != rank_pid and len(_children(new_pid)) == 1
    assert_same(completions(tp.url, model, 2), completions(ref.url, model, 1))
