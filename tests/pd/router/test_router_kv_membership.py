"""CEs joining and leaving `pdserve router --routing kv-aware` while chats run (issue 51, faults). The
router's --decode-url is dns+http://ce.test:PORT, its name resolved from a file the test rewrites
(tests/pd/fake_resolver.py: the router is a real process, only its lookups are faked); three single-engine
servers publishing KV events stand for the CEs on loopback "hosts" 127.0.0.2-4, one port. While two
clients run a bounded load of (unstreamed) chats: a third CE joins (subscribed, given work, its pages in
the router's index); one leaves cleanly (SIGTERM: it drains and exits, and its name goes) and one is
killed (SIGKILL, then its name goes). What the router promises and the test asserts: no chat fails (a CE
refused, cut, or answering 503 before any byte reached the client is failed over to the next CE,
pd/router/server.py _attempt; an unstreamed chat sends nothing before its end), every leaver's pages
leave the index (forget), and once idle the index holds exactly what the one CE left publishes (an
independent subscriber of its stream), nothing of the others."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd.disagg.membership import hrw_order
from pd.tools.server_process import ServerProcess, free_port, get_json
from tests.pd.kv_events.test_kv_aware_membership import BLOCK, MODEL, chat, stream_blocks, wait_for
from tests.server_fixtures import metric, skip_unless_bindable

pytestmark = pytest.mark.slow  # four processes, three engines, then half a minute of load on 2 cores

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
NAME = "ce.test"
MAX_CHATS_PER_CLIENT = 40  # the load ends when the test says so, or at this


class Cluster:
    def __init__(self, tmp_path: Path) -> None:
        self.hosts_path = tmp_path / "hosts.json"
        self.ce_port = free_port()
        common = ("--model", MODEL, "--block-size", str(BLOCK), "--max-model-len", "2048", "--kv-cache-gb", "0.25")
        self.ces = {}
        for i, host in enumerate(HOSTS):
            events = {"enable_kv_cache_events": True, "endpoint": f"tcp://{host}:{free_port()}",
                      "replay_endpoint": f"tcp://{host}:{free_port()}"}  # fmt: skip
            self.ces[host] = ServerProcess(*common, "--kv-events-config", json.dumps(events), port=self.ce_port,
                                           host=host, log_path=tmp_path / f"ce{i}.log")  # fmt: skip
        self.resolve_to(HOSTS[:2])
        self.router = ServerProcess(
            "--decode-url", f"dns+http://{NAME}:{self.ce_port}", "--routing", "kv-aware", "--dns-refresh-s", "0.3",
            "--health-interval-s", "0.5", log_path=tmp_path / "router.log",
            command=(sys.executable, "-m", "tests.pd.fake_resolver", str(self.hosts_path), "pd.router.server"),
        )  # fmt: skip

    def url(self, host: str) -> str:
        return f"http://{host}:{self.ce_port}"

    def resolve_to(self, hosts: tuple[str, ...]) -> None:
        tmp = self.hosts_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({NAME: list(hosts)}))
        tmp.replace(self.hosts_path)  # a lookup reads the old list or the new one, never half of one

    def health(self) -> dict[str, Any]:
        return get_json(self.router.url + "/health")[1]

    def wait_members(self, hosts: tuple[str, ...], timeout_s: float = 60.0) -> None:
        """Until the router's CEs are exactly these, each up, and a stream of each subscribed."""
        want = sorted(self.url(h) for h in hosts)
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            ces = h.get("decode_engines") or []
            if (sorted(b["url"] for b in ces) == want and all(b["state"] == "up" for b in ces)
                    and h.get("kv_index", {}).get("streams") == len(hosts)):  # fmt: skip
                return
            assert time.monotonic() < deadline, (want, h)
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    skip_unless_bindable(*HOSTS)
    c = Cluster(tmp_path_factory.mktemp("router-kv-membership"))
    servers = [*c.ces.values(), c.router]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        c.wait_members(HOSTS[:2])
        yield c
    finally:
        for s in servers:
            s.terminate()
        for s in servers:
            s.stop()


def index_blocks(c: Cluster, host: str) -> float:
    return metric(c.router.url, "pdserve_router_kv_index_blocks", backend=c.url(host))


def test_ces_join_and_leave_while_chats_run(cluster: Cluster) -> None:
    c = cluster
    a, b, new = HOSTS
    nonce = uuid.uuid4().hex
    answers: list[dict] = []
    errors: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(k: int) -> None:
        for i in range(MAX_CHATS_PER_CLIENT):
            if stop.is_set():
                return
            system = f"Session {nonce}-{k}-{i}. " + " ".join(f"Rule {j}: item {j} costs {k + i + j} coins." for j in range(8))
            try:
                got = chat(c.router.url, system, f"Client {k}, chat {i}: which item is cheapest?")
            except Exception as e:  # counted: must stay empty
                with lock:
                    errors.append(repr(e))
                return
            with lock:
                answers.append(got)

    workers = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for w in workers:
        w.start()

    def answered(n: int) -> Any:
        def check() -> bool:
            assert not errors, errors
            assert any(w.is_alive() for w in workers), "the load ended early"
            return len(answers) >= n

        return check

    try:
        wait_for("the load runs", answered(2), 300)
        # a CE joins: subscribed, its stream read, and given work
        c.resolve_to(HOSTS)
        c.wait_members(HOSTS)
        urls = [c.url(h) for h in HOSTS]
        user = next(u for u in (f"Tell me about item {i}." for i in range(200)) if hrw_order(u, urls)[0] == c.url(new))
        # its own head: the load's prompts open with "Session {nonce}", whose first page the old CEs hold (they
        # would win it by their cached page when they have nothing in flight)
        chat(c.router.url, f"{uuid.uuid4().hex} asks the new CE. " + "Rules follow. " * 20, user)
        assert sum(metric(c.router.url, "pdserve_router_backend_selected_total", backend=c.url(new), reason=r)
                   for r in ("kv-miss", "kv-hit")) >= 1  # fmt: skip
        wait_for("the new CE's pages in the router's index", lambda: index_blocks(c, new) > 0)
        seen = len(answers)
        wait_for("the load goes on", answered(seen + 2), 300)

        # one leaves cleanly: SIGTERM to the server (as Kubernetes sends it) and its name goes; it drains
        leaving = c.ces[b].proc
        assert leaving is not None
        os.kill(leaving.pid, signal.SIGTERM)
        c.resolve_to((a, new))
        c.wait_members((a, new))
        assert index_blocks(c, b) == 0
        assert leaving.wait(60) == 0  # its chats in flight done, it exits by itself
        c.ces[b].stop()
        seen = len(answers)
        wait_for("the load goes on", answered(seen + 2), 300)

        # one is killed: its chats in flight are failed over (nothing of them reached a client); then its name goes
        os.killpg(c.ces[a].pid, signal.SIGKILL)
        c.ces[a].stop()
        seen = len(answers)
        wait_for("the load goes on past the kill", answered(seen + 2), 300)
        c.resolve_to((new,))
        c.wait_members((new,))
        assert index_blocks(c, a) == 0
        seen = len(answers)
        wait_for("the load goes on with one CE", answered(seen + 2), 300)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=600)
    assert not any(w.is_alive() for w in workers)
    assert errors == [], errors
    assert len(answers) >= 10

    # idle: the router's index is what the one CE left publishes, nothing of the two that left
    deadline = time.monotonic() + 30
    while (held := c.health()["kv_index"]["blocks"]) != (truth := stream_blocks(c.url(new))) or index_blocks(c, new) != truth:
        assert time.monotonic() < deadline, (held, truth, c.health())
        time.sleep(0.5)
    assert truth > 0
    assert [b["url"] for b in c.health()["decode_engines"]] == [c.url(new)]
