"""PEs joining and leaving a kv-aware CE while chats run (issue 51, faults). The CE's --prefill-url is
dns+http://pe.test:PORT, its name resolved from a file the test rewrites (tests/pd/fake_resolver.py: the
CE is a real process, only its lookups are faked), three PEs on loopback "hosts" 127.0.0.2-4, one port.
While two clients run a bounded load of chats: a third PE joins (subscribed, given work, its pages in the
CE's index); one leaves cleanly (SIGTERM: it drains and exits, and its name goes) and one is killed (SIGKILL, then gone
from the name). What the CE promises and the test asserts: no chat fails (a prefill refused or cut before
its KV reached the CE is retried once on the next PE, pd/disagg/decode_path.py _may_fail_over), every
leaver's pages leave the index (forget), and once idle the index holds exactly what the one PE left
publishes (an independent subscriber of its stream), nothing of the others."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd.disagg.membership import hrw_order
from pd.kv_events.index import PrefixIndex, Subscription
from pd.tools.server_process import ServerProcess, free_port, get_json
from tests.server_fixtures import metric, skip_unless_bindable

pytestmark = pytest.mark.slow  # four engines start, then a minute or two of load on 2 cores

MODEL = "smollm2-135m-instruct"
TOKEN = "kv-aware-membership-token-0123456789"
BLOCK = 16
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
NAME = "pe.test"
MAX_CHATS_PER_CLIENT = 40  # the load ends when the test says so, or at this


class Cluster:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.hosts_path = tmp_path / "hosts.json"
        self.pe_port = free_port()
        common = ("--model", MODEL, "--block-size", str(BLOCK), "--max-model-len", "2048", "--kv-cache-gb", "0.25")
        self.env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": TOKEN}
        self.env.pop("PDSERVE_CLUSTER_TOKEN_FILE", None)
        self.pes = {}
        for i, host in enumerate(HOSTS):
            events = {"enable_kv_cache_events": True, "endpoint": f"tcp://{host}:{free_port()}",
                      "replay_endpoint": f"tcp://{host}:{free_port()}"}  # fmt: skip
            self.pes[host] = ServerProcess("--role", "pe", *common, "--kv-events-config", json.dumps(events),
                                           port=self.pe_port, host=host, env=self.env,
                                           log_path=tmp_path / f"pe{i}.log")  # fmt: skip
        self.resolve_to(HOSTS[:2])
        self.ce = ServerProcess(
            "--role", "ce", *common, "--prefill-url", f"dns+http://{NAME}:{self.pe_port}", "--pe-routing", "kv-aware",
            "--pe-dns-refresh-s", "0.3", "--kv-port-base", str(free_port()), log_path=tmp_path / "ce.log",
            env=self.env, command=(sys.executable, "-m", "tests.pd.fake_resolver", str(self.hosts_path), "pd.server"),
        )  # fmt: skip

    def url(self, host: str) -> str:
        return f"http://{host}:{self.pe_port}"

    def resolve_to(self, hosts: tuple[str, ...]) -> None:
        tmp = self.hosts_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({NAME: list(hosts)}))
        tmp.replace(self.hosts_path)  # a lookup reads the old list or the new one, never half of one

    def health(self) -> dict[str, Any]:
        return get_json(self.ce.url + "/health")[1]

    def wait_members(self, hosts: tuple[str, ...], timeout_s: float = 60.0) -> None:
        """Until the CE's PEs are exactly these, each up, and a stream of each subscribed."""
        want = sorted(self.url(h) for h in hosts)
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            pes = h.get("prefill_engines") or []
            if (sorted(p["url"] for p in pes) == want and all(p["state"] == "up" for p in pes)
                    and h.get("kv_index", {}).get("streams") == len(hosts)):  # fmt: skip
                return
            assert time.monotonic() < deadline, (want, h)
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    skip_unless_bindable(*HOSTS)
    c = Cluster(tmp_path_factory.mktemp("kv-aware-membership"))
    servers = [*c.pes.values(), c.ce]
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


def chat(url: str, system: str, user: str) -> dict:
    body = {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 2, "temperature": 0}  # fmt: skip
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def stream_blocks(pe_url: str) -> int:
    """The pages a fresh subscriber learns from a PE's stream (its replay from the start)."""
    (stream,) = get_json(pe_url + "/health")[1]["kv_events"]

    async def read() -> int:
        index = PrefixIndex(BLOCK)
        sub = Subscription(index, "fresh", stream["endpoint"], stream["replay_endpoint"], stream.get("topic") or "")
        sub.start()
        await asyncio.sleep(1.0)
        await sub.stop()
        return index.num_blocks()

    return asyncio.run(read())


def index_blocks(c: Cluster, host: str) -> float:
    return metric(c.ce.url, "pdserve_pe_kv_index_blocks", pe=c.url(host))


def wait_for(what: str, check: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_pes_join_and_leave_while_chats_run(cluster: Cluster) -> None:
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
                got = chat(c.ce.url, system, f"Client {k}, chat {i}: which item is cheapest?")
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
        # a PE joins: subscribed, its stream read, and given work
        c.resolve_to(HOSTS)
        c.wait_members(HOSTS)
        user = next(u for u in (f"Tell me about item {i}." for i in range(200)) if hrw_order(u, [c.url(h) for h in HOSTS])[0] == c.url(new))
        # its own head: the load's prompts open with "Session {nonce}", whose first page the old PEs hold (they
        # would win it by their cached page when they have nothing in flight)
        chat(c.ce.url, f"{uuid.uuid4().hex} asks the new PE. " + "Rules follow. " * 20, user)
        assert sum(metric(c.ce.url, "pdserve_pe_selected_total", pe=c.url(new), reason=r) for r in ("kv-miss", "kv-hit")) >= 1
        wait_for("the new PE's pages in the CE's index", lambda: index_blocks(c, new) > 0)
        seen = len(answers)
        wait_for("the load goes on", answered(seen + 2), 300)

        # one leaves cleanly: SIGTERM to the server (as Kubernetes sends it) and its name goes; it drains
        leaving = c.pes[b].proc
        assert leaving is not None
        os.kill(leaving.pid, signal.SIGTERM)
        c.resolve_to((a, new))
        c.wait_members((a, new))
        assert index_blocks(c, b) == 0
        assert leaving.wait(60) == 0  # its prefills in flight done, it exits by itself
        c.pes[b].stop()
        seen = len(answers)
        wait_for("the load goes on", answered(seen + 2), 300)

        # one is killed: its prefills in flight are retried on the next PE; then its name goes
        os.killpg(c.pes[a].pid, signal.SIGKILL)
        c.pes[a].stop()
        seen = len(answers)
        wait_for("the load goes on past the kill", answered(seen + 2), 300)
        c.resolve_to((new,))
        c.wait_members((new,))
        assert index_blocks(c, a) == 0
        seen = len(answers)
        wait_for("the load goes on with one PE", answered(seen + 2), 300)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=600)
    assert not any(w.is_alive() for w in workers)
    assert errors == [], errors
    assert len(answers) >= 10

    # idle: the CE's index is what the one PE left publishes, nothing of the two that left
    deadline = time.monotonic() + 30
    while (held := c.health()["kv_index"]["blocks"]) != (truth := stream_blocks(c.url(new))) or index_blocks(c, new) != truth:
        assert time.monotonic() < deadline, (held, truth, c.health())
        time.sleep(0.5)
    assert truth > 0
    assert [p["url"] for p in c.health()["prefill_engines"]] == [c.url(new)]
