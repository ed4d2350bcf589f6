"""--routing kv-aware on a real server (issue 51, the CE -> rank hop): two ranks publishing KV events and the
server's own rank choice reading them. Chats that share a long system prompt but open with different user
turns (rendezvous hashing of the first user message puts them on the other rank) go to the rank whose host
cache holds the system prompt, each reusing its pages; with a long request in flight there, the next one
goes to the idle rank. Every answer equals the single server's (--routing affinity), token for token."""

from __future__ import annotations

import json
import random
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd.frontend.router import rendezvous
from pd.tools.server_process import PDPair, ServerProcess, get_json
from tests.pd.conftest import SMOLLM
from tests.pd.frontend.test_kv_aware_router import _Rank, free_ports
from tests.server_fixtures import SMALL_DETERMINISTIC, metric

PAGE = 128  # the engines' default page
SYSTEM = f"Session {uuid.uuid4().hex}. You answer questions about a warehouse. " + " ".join(
    f"Shelf {i} holds {i % 9 + 2} boxes of item {i * 7}." for i in range(28)
)  # over 3 pages, none held by an engine yet
RANKS = [_Rank(0), _Rank(1)]


@pytest.fixture(scope="module")
def server(smollm_servers: tuple[ServerProcess, PDPair], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_ports(2)}",
              "replay_endpoint": f"tcp://127.0.0.1:{free_ports(2)}"}  # fmt: skip
    s = ServerProcess("--model", SMOLLM, *SMALL_DETERMINISTIC, "--dp", "2", "--routing", "kv-aware",
                      "--kv-events-config", json.dumps(events),
                      log_path=Path(tmp_path_factory.mktemp("kv-ranks")) / "server.log")  # fmt: skip
    s.start()
    try:
        s.wait_ready()
        assert get_json(s.url + "/health")[1]["rank_kv_index"]["streams"] == 2
        yield s
    finally:
        s.terminate()
        s.stop()


def chat(url: str, user: str, max_tokens: int = 6) -> dict:
    body = {"model": SMOLLM, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}  # fmt: skip
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def chosen(url: str) -> dict[tuple[str, str], float]:
    return {(rank, reason): metric(url, "pdserve_rank_selected_total", rank=rank, reason=reason)
            for rank in ("0", "1") for reason in ("kv-hit", "kv-miss")}  # fmt: skip


def moved(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def fresh_tokens(n: int, seed: int) -> list[int]:
    """n token ids no engine holds (a completion's conversation key: its first 256)."""
    rng = random.Random(f"{SYSTEM} {seed}")
    return [rng.randrange(1000, 40000) for _ in range(n)]


def same_answer(r: dict, want: dict) -> None:
    assert r["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert r["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    assert r["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]


def test_chats_sharing_a_system_prompt_go_to_the_rank_holding_it(server: ServerProcess, smollm_servers) -> None:
    ref, _ = smollm_servers
    before = chosen(server.url)
    first = chat(server.url, "Hello")
    assert first["usage"]["prompt_tokens"] > 3 * PAGE
    ((home, reason),) = moved(before, chosen(server.url))
    assert reason == "kv-miss"  # no rank held anything: the conversation's rank
    # the home rank's events reach the choice: its index holds the system prompt's pages
    deadline = time.monotonic() + 60
    while metric(server.url, "pdserve_rank_kv_index_blocks", rank=home) < 3:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.1)
    other = "1" if home == "0" else "0"
    assert metric(server.url, "pdserve_rank_kv_index_blocks", rank=other) == 0
    # user turns whose rendezvous order puts them on the other rank
    users = [u for u in (f"Which shelf is item {i * 7}?" for i in range(200)) if str(rendezvous(u, RANKS)[0].index) == other][:2]
    before = chosen(server.url)
    sent_cached = metric(server.url, "pdserve_rank_kv_sent_cached_tokens_total", rank=home)
    answers = [chat(server.url, user) for user in users]
    for r in answers:
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * PAGE, r["usage"]
    same_answer(answers[0], chat(ref.url, users[0]))
    assert moved(before, chosen(server.url)) == {(home, "kv-hit"): len(users)}
    assert metric(server.url, "pdserve_rank_kv_sent_cached_tokens_total", rank=home) - sent_cached >= 3 * PAGE * len(users)
    assert metric(server.url, "pdserve_rank_kv_events_gaps_total", rank=home) == 0
    same_answer(first, chat(ref.url, "Hello"))


def test_a_rank_with_a_long_request_in_flight_passes_the_head_to_the_other(server: ServerProcess, smollm_servers) -> None:
    """A completion of 600 fresh tokens streams on the home rank (its whole prompt counts as that rank's
    work while it runs): the next chat with the system prompt costs less on the idle rank, which computes
    it whole, than on home, where its cached head would wait behind that work."""
    ref, _ = smollm_servers
    probe = chosen(server.url)
    chat(server.url, "Hello")  # the system prompt's rank: where this conversation goes while both are idle
    ((home, _),) = moved(probe, chosen(server.url))
    other = "1" if home == "0" else "0"
    filler = next(f for f in (fresh_tokens(600, seed) for seed in range(100))
                  if str(rendezvous(",".join(map(str, f[:256])), RANKS)[0].index) == home)  # fmt: skip
    body = {"model": SMOLLM, "prompt": filler, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    before = chosen(server.url)
    with urllib.request.urlopen(req, timeout=300) as stream:
        assert stream.readline().startswith(b"data: ")  # its first token: chosen, prefilled, in flight
        assert moved(before, chosen(server.url)) == {(home, "kv-miss"): 1}
        user = "Which shelf is item 14?"
        r = chat(server.url, user)
        assert moved(before, chosen(server.url)) == {(home, "kv-miss"): 1, (other, "kv-miss"): 1}
    same_answer(r, chat(ref.url, user))


def test_kv_aware_without_events_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    from pd.server import main

    assert main(["--model", SMOLLM, "--dp", "2", "--routing", "kv-aware"]) == 2
    assert "--routing kv-aware" in capsys.readouterr().err
