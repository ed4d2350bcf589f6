"""`pdserve router --routing kv-aware` restarted under load (issue 51, faults), over the shared SmolLM2
servers (tests/pd/conftest.py: a single server and a P/D pair's CE, both publishing KV events). Clients
running a bounded load of chats that share a system prompt retry what a real client retries: a connection
refused while no router listens, and one cut before any answer came (the router died under it). What is
asserted: no chat ever gets an HTTP error (no 5xx from the cluster, nothing else either), every chat is
answered, at least one attempt met the gap; the new router subscribes to both streams again, its index for
each CE equals what an independent subscriber reads from that CE's stream, and the shared prefix is
routed as a kv-hit again."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd.kv_events.index import PrefixIndex, Subscription
from pd.tools.server_process import PDPair, ServerProcess, get_json
from tests.pd.conftest import KV_EVENTS, SMOLLM
from tests.server_fixtures import metric

pytestmark = pytest.mark.slow  # about a minute on 2 cores, beside the shared servers' start

NUM_CLIENTS = 3
CHATS_PER_CLIENT = 5
MAX_TRIES = 400  # per chat, 0.05 s apart at least: the gap while no router listens is far shorter


def streams_seen(url: str) -> int:
    try:
        status, body = get_json(url + "/health")
    except OSError:
        return -1
    return int(body.get("kv_index", {}).get("streams", -1)) if status == 200 else -1


def start_router(r: ServerProcess) -> ServerProcess:
    r.start().wait_ready()
    deadline = time.monotonic() + 60
    while streams_seen(r.url) != 2:  # both CEs up, and a stream of each subscribed
        assert time.monotonic() < deadline, r.log_tail()
        time.sleep(0.2)
    return r


@pytest.fixture(scope="module")
def router(smollm_servers: tuple[ServerProcess, PDPair], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """[the router]: the test replaces it by a new process on the same port; the fixture ends whichever runs."""
    ref, pair = smollm_servers
    r = ServerProcess("--decode-url", f"{ref.url},{pair.url}", "--routing", "kv-aware",
                      command=(sys.executable, "-m", "pd.router.server"),
                      log_path=Path(tmp_path_factory.mktemp("router-kv-faults")) / "router.log")  # fmt: skip
    held = [r]
    try:
        start_router(r)
        yield held
    finally:
        held[0].stop()


def post_chat(url: str, system: str, user: str) -> dict:
    body = {"model": SMOLLM, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 2, "temperature": 0}  # fmt: skip
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def is_connection_error(e: Exception) -> bool:
    """What a client retries: no router listening, or the connection cut before an answer (an HTTPError,
    an answer with a status, is not one of these)."""
    if isinstance(e, urllib.error.HTTPError):
        return False
    if isinstance(e, urllib.error.URLError):
        return isinstance(e.reason, ConnectionError)
    return isinstance(e, (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead))


def stream_blocks(name: str) -> int:
    """The pages a fresh subscriber learns from a shared server's stream (its replay from the start)."""
    endpoint, replay = KV_EVENTS[name]

    async def read() -> int:
        index = PrefixIndex(128)
        sub = Subscription(index, name, endpoint, replay, "kv")
        sub.start()
        await asyncio.sleep(1.0)
        await sub.stop()
        return index.num_blocks()

    return asyncio.run(read())


def test_the_router_killed_and_started_again_under_load(
    router: list[ServerProcess], smollm_servers: tuple[ServerProcess, PDPair]
) -> None:
    ref, pair = smollm_servers
    old = router[0]
    nonce = uuid.uuid4().hex
    system = f"Session {nonce}. You answer questions about a garden. " + " ".join(
        f"Bed {i} grows {nonce[i % 32]} rows of plant {i * 5}." for i in range(50)
    )  # several 128-token pages, held by no engine yet
    answers: list[dict] = []
    errors: list[str] = []  # anything but a connection error: must stay empty
    retried: list[str] = []  # connection errors, each retried
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(CHATS_PER_CLIENT):
            for _ in range(MAX_TRIES):
                try:
                    got = post_chat(old.url, system, f"Client {c}: what grows in bed {i}?")
                except Exception as e:  # sorted below: a connection error is retried, the rest fail the test
                    with lock:
                        (retried if is_connection_error(e) else errors).append(repr(e))
                    if not is_connection_error(e):
                        return
                    time.sleep(0.05)
                    continue
                with lock:
                    answers.append(got)
                break
            else:
                with lock:
                    errors.append(f"client {c}: chat {i} not answered in {MAX_TRIES} tries")
                return

    workers = [threading.Thread(target=client, args=(c,)) for c in range(NUM_CLIENTS)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 300
    while len(answers) < NUM_CLIENTS:  # the load is running, the prefix is in the index
        assert time.monotonic() < deadline and not errors, (answers, errors)
        time.sleep(0.05)
    os.killpg(old.pid, signal.SIGKILL)
    old.stop()
    deadline = time.monotonic() + 60
    while not retried:  # a client met the gap (in flight when it died, or refused since)
        assert time.monotonic() < deadline and any(w.is_alive() for w in workers), (answers, errors)
        time.sleep(0.02)
    again = ServerProcess(*old.args[2:], port=old.port, command=old.command, log_path=old.log_path)
    router[0] = again  # the fixture ends it
    start_router(again)
    for w in workers:
        w.join(timeout=600)
    assert not any(w.is_alive() for w in workers)
    assert errors == [], errors
    assert len(answers) == NUM_CLIENTS * CHATS_PER_CLIENT and len(retried) >= 1, (len(answers), retried)
    assert all(a["choices"][0]["message"]["content"] is not None for a in answers)

    # the new router's index, per CE, is what that CE's own stream says (idle now: nothing changes it)
    for name, ce in (("ref", ref.url), ("ce", pair.url)):
        deadline = time.monotonic() + 30
        while (held := metric(again.url, "pdserve_router_kv_index_blocks", backend=ce)) != (truth := stream_blocks(name)):
            assert time.monotonic() < deadline, (name, held, truth, again.log_tail())
            time.sleep(0.5)
        assert truth > 0, name
    # and it routes by it: the shared prefix is a hit where it lives
    hits = sum(metric(again.url, "pdserve_router_backend_selected_total", backend=u, reason="kv-hit") for u in (ref.url, pair.url))
    last = post_chat(again.url, system, "One more question about bed 3.")
    assert sum(metric(again.url, "pdserve_router_backend_selected_total", backend=u, reason="kv-hit")
               for u in (ref.url, pair.url)) == hits + 1  # fmt: skip
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 128, last["usage"]
    assert metric(again.url, "pdserve_router_kv_events_gaps_total") == 0
