"""--pe-routing kv-aware on a real cluster (issue 51): two PEs publishing KV events and a CE reading them.
Chats that share a long system prompt but open with different user turns (rendezvous hashing of the first
user message spreads them over both PEs) all go to the PE that holds the system prompt's pages, each
reusing them. A PE killed and started again while chats run: every chat is answered (the CE fails over),
the CE's index drops what the old process held (its stream starts again) and then agrees with the new
process's own stream.""" 

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd.kv_events.index import PrefixIndex, Subscription
from pd.tools.server_process import ServerProcess, free_port, get_json
from tests.server_fixtures import metric

MODEL = "smollm2-135m-instruct"
TOKEN = "kv-aware-cluster-token-0123456789"
BLOCK = 16
SYSTEM = "You are a careful assistant for a hardware shop. " + " ".join(
    f"Rule {i}: answer in one short sentence about item {i} and never mention prices." for i in range(24)
)


def chat(url: str, user: str) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 2,
        "temperature": 0,
    }
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def selected(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    pattern = r'pdserve_pe_selected_total\{pe="([^"]+)",reason="([^"]+)"\} ([0-9.e+]+)'
    return {(pe, reason): float(v) for pe, reason, v in re.findall(pattern, text)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[ServerProcess], ServerProcess, Path]]:
    """Two PEs publishing KV events and a kv-aware CE over them, the CE subscribed to both streams. The
    list of PEs is the test's to change (a PE restarted replaces its entry); every server in it ends."""
    tmp_path = tmp_path_factory.mktemp("kv-aware-cluster")
    common = ("--model", MODEL, "--block-size", str(BLOCK), "--max-model-len", "2048", "--kv-cache-gb", "0.25")
    env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": TOKEN}
    env.pop("PDSERVE_CLUSTER_TOKEN_FILE", None)
    pes = []
    for i in range(2):
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}",
                  "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}  # fmt: skip
        pes.append(ServerProcess("--role", "pe", *common, "--kv-events-config", json.dumps(events),
                                 log_path=tmp_path / f"pe{i}.log", env=env))  # fmt: skip
    ce = ServerProcess(
        "--role", "ce", *common, "--prefill-url", ",".join(p.url for p in pes), "--pe-routing", "kv-aware",
        "--kv-port-base", str(free_port()), log_path=tmp_path / "ce.log", env=env,
    )  # fmt: skip
    try:
        for s in (*pes, ce):
            s.start()
        for s in (*pes, ce):
            s.wait_ready()
        deadline = time.monotonic() + 60
        while get_json(ce.url + "/health")[1].get("kv_index", {}).get("streams") != 2:
            assert time.monotonic() < deadline, get_json(ce.url + "/health")[1]
            time.sleep(0.2)
        yield pes, ce, tmp_path
    finally:
        for s in (*pes, ce):
            s.terminate()
        for s in (*pes, ce):
            s.stop()


def test_chats_sharing_a_system_prompt_meet_its_pages_on_one_pe(cluster):
    _, ce, _ = cluster
    first = chat(ce.url, "Which item is the lightest?")
    deadline = time.monotonic() + 30  # the PE's pages reach the CE's index
    while get_json(ce.url + "/health")[1]["kv_index"]["blocks"] * BLOCK < first["usage"]["prompt_tokens"] - BLOCK:
        assert time.monotonic() < deadline, get_json(ce.url + "/health")[1]
        time.sleep(0.1)
    users = ["Tell me about item 3.", "Is item 7 in stock?", "Hi", "What about item 12?", "Thanks, bye."]
    answers = [chat(ce.url, u) for u in users]
    got = selected(ce.url)
    hits = {pe: n for (pe, reason), n in got.items() if reason == "kv-hit" and n}
    assert len(hits) == 1 and sum(hits.values()) == len(users), got  # every later chat went to one PE
    assert got[(next(iter(hits)), "kv-miss")] == 1, got  # and that PE took the first one too
    system_tokens = first["usage"]["prompt_tokens"] - 40  # the system prompt's share, at least
    for a in answers:
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] >= system_tokens // BLOCK * BLOCK - BLOCK, a["usage"]


def index_of(endpoint: str, replay: str, block_size: int) -> int:
    """The pages a fresh subscriber learns from an engine rank's stream (its replay from the start)."""

    async def read() -> int:
        index = PrefixIndex(block_size)
        sub = Subscription(index, "fresh", endpoint, replay)
        sub.start()
        await asyncio.sleep(1.0)
        await sub.stop()
        return index.num_blocks()

    return asyncio.run(read())


def test_a_pe_killed_and_started_again_under_load(cluster):
    pes, ce, tmp_path = cluster
    chat(ce.url, "Which item is the heaviest?")  # the system prompt's pages are somewhere now
    i_home = max(range(2), key=lambda i: metric(ce.url, "pdserve_pe_kv_index_blocks", pe=pes[i].url))
    home = pes[i_home]
    assert metric(ce.url, "pdserve_pe_kv_index_blocks", pe=home.url) > 0
    results: list[tuple[str, Any]] = []

    def load() -> None:
        for i in range(8):  # bounded: one chat at a time
            try:
                results.append(("ok", chat(ce.url, f"Is item {i} heavier than item {i + 1}?")))
            except Exception as e:  # counted: the assertion below shows it
                results.append(("error", repr(e)))

    worker = threading.Thread(target=load)
    worker.start()
    deadline = time.monotonic() + 300
    while len(results) < 2:
        assert time.monotonic() < deadline and worker.is_alive(), results
        time.sleep(0.05)
    os.killpg(home.pid, signal.SIGKILL)  # the PE and its rank, at once
    home.stop()
    again = ServerProcess(*home.args[2:], port=home.port, env=home.env, log_path=tmp_path / "pe-again.log")
    pes[i_home] = again  # the fixture ends it
    again.start().wait_ready()
    worker.join(timeout=600)
    assert not worker.is_alive()
    assert [status for status, _ in results] == ["ok"] * 8, results
    # the CE's index for the new process agrees with what that process's own stream says (the old
    # process's pages are gone from it), before and after a chat that may go there
    (stream,) = get_json(again.url + "/health")[1]["kv_events"]
    for _ in range(2):
        deadline = time.monotonic() + 30
        while (held := metric(ce.url, "pdserve_pe_kv_index_blocks", pe=again.url)) != (
                truth := index_of(stream["endpoint"], stream["replay_endpoint"], BLOCK)):  # fmt: skip
            assert time.monotonic() < deadline, (held, truth)
            time.sleep(0.5)
        chat(ce.url, "One more question about item 2.")
