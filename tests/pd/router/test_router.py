"""`pdserve router` in front of two CEs (and one PE) on loopback "hosts" 127.0.0.2-127.0.0.6, all real
processes (a tiny random Llama with SmolLM2's tokenizer, 16-token pages so short turns fill pages):
two router replicas send a conversation's turns to the same CE, the one rendezvous hashing ranks first,
whose decode cache then hits; answers stream through as the CE writes them; X-Request-Id reaches the CE;
when that CE is killed, the next turn is served by the other CE (failover before the first byte), and
the router's /metrics count it all; a CE that drains (503) is failed over too. The units below them need no server: the conversation key equals the
CE's own, and the choice (replicas agree, load bound, down CEs last)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pd.api.chat import affinity_key
from pd.api.protocol import parse_chat_request
from pd.disagg.membership import hrw_order
from pd.router.backends import Backend, BackendPool
from pd.router.key import conversation_key
from pd.tools.server_process import ServerProcess, free_port, get_json, wait_idle
from tests.server_fixtures import metric, openai_client, skip_unless_bindable
from tests.tiny_models import make_servable

PE_HOST, CE_HOSTS, ROUTER_HOSTS = "127.0.0.2", ("127.0.0.3", "127.0.0.4"), ("127.0.0.5", "127.0.0.6")
MODEL = "tiny-llama"
TOKEN = "router-test-cluster-token-0123456789"
FLAGS = ("--served-model-name", MODEL, "--max-model-len", "2048", "--kv-cache-gb", "0.05", "--block-size", "16")


# ---- units ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Plan a trip to Lisbon."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}],
        [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
        [{"role": "system", "content": "No user yet."}],
    ],
)  # fmt: skip
def test_key_is_the_ce_key(messages: list[dict]) -> None:
    body = {"model": MODEL, "messages": messages}
    assert conversation_key("/v1/chat/completions", body) == affinity_key(parse_chat_request(body))


def test_completion_keys() -> None:
    assert conversation_key("/v1/completions", {"prompt": "x" * 2000}) == "x" * 1024
    assert conversation_key("/v1/completions", {"prompt": ["ab", "cd"]}) == "ab"
    assert conversation_key("/v1/completions", {"prompt": [[5, 6], [7]]}) == "5,6"
    assert conversation_key("/v1/completions", {"prompt": list(range(300))}) == ",".join(map(str, range(256)))
    assert conversation_key("/invocations", {"prompt": "x" * 2000}) == "x" * 1024
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert conversation_key("/invocations", chat) == conversation_key("/v1/chat/completions", chat) == "hi"
    assert conversation_key("/v1/models", {}) is None
    assert conversation_key("/v1/chat/completions", ["not", "an", "object"]) is None


def _pool(urls: list[str], slack: float = 0.5, floor: int = 0) -> BackendPool:
    pool = BackendPool(",".join(urls), slack, floor, 2.0, 10.0)
    for u in urls:
        b = Backend(u, u, lambda b: None)
        b.is_up = True
        pool.backends[u] = b
    return pool


def test_replicas_agree_and_the_load_bound() -> None:
    urls = [f"http://10.0.0.{i}:8888" for i in range(1, 5)]
    a, b = _pool(urls), _pool(list(reversed(urls)))  # two replicas, the list written in another order
    keys = [f"conversation {i}" for i in range(40)]
    firsts = [a.order(k)[0][0].url for k in keys]
    assert firsts == [b.order(k)[0][0].url for k in keys] == [hrw_order(k, urls)[0] for k in keys]
    assert len(set(firsts)) == 4  # the conversations spread over every CE
    k = keys[0]
    ranked = hrw_order(k, urls)
    assert [(x.url, why) for x, why in a.order(k)] == [(ranked[0], "affinity")] + [(u, "failover") for u in ranked[1:]]
    # at ceil(1.5 * (in flight + 1) / 4): the next of the conversation's order takes it
    a.backends[ranked[0]].num_inflight = 2  # capacity ceil(1.5 * 3 / 4) = 2
    assert [(x.url, why) for x, why in a.order(k)][:2] == [(ranked[1], "overflow"), (ranked[0], "failover")]
    a.backends[ranked[1]].num_inflight = 4  # capacity ceil(1.5 * 7 / 4) = 3: back on its own CE
    assert a.order(k)[0] == (a.backends[ranked[0]], "affinity")
    a.backends[ranked[0]].num_inflight = 3  # capacity ceil(1.5 * 8 / 4) = 3: both full, the third
    assert a.order(k)[0] == (a.backends[ranked[2]], "overflow")
    a.backends[ranked[1]].num_inflight = 0
    a.backends[ranked[0]].num_inflight = 1  # capacity ceil(1.5 * 2 / 4) = 1
    assert a.order(k)[0] == (a.backends[ranked[1]], "overflow")
    # with a floor of 4, a CE holding fewer keeps its conversations whatever the others hold
    floored = _pool(urls, floor=4)
    floored.backends[ranked[0]].num_inflight = 3
    assert floored.order(k)[0] == (floored.backends[ranked[0]], "affinity")
    floored.backends[ranked[0]].num_inflight = 4
    assert floored.order(k)[0] == (floored.backends[ranked[1]], "overflow")
    # a CE down: the conversation's next CE, the down one last (a probe can lag)
    a.backends[ranked[0]].num_inflight = 0
    a.backends[ranked[0]].is_up = False
    assert [x.url for x, _ in a.order(k)] == [*ranked[1:], ranked[0]]
    assert a.order(k)[-1][1] == "fallback"
    # no key: the least loaded
    a.backends[ranked[1]].num_inflight = 1
    assert a.order(None)[0][0].url in ranked[2:]


# ---- real processes -------------------------------------------------------------------------------------


@dataclass
class Cluster:
    pe: ServerProcess
    ces: dict[str, ServerProcess]  # url -> CE
    routers: list[ServerProcess]
    new_ce: Callable[[str, int | None], ServerProcess]  # (host, port): a CE there, not started

    def restart_ce(self, url: str) -> ServerProcess:
        """A new CE where a dead one was (same host and port: the same URL), ready."""
        old = self.ces[url]
        old.stop()
        self.ces[url] = ce = self.new_ce(old.host, old.port)
        return ce.start().wait_ready()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    skip_unless_bindable(PE_HOST, *CE_HOSTS, *ROUTER_HOSTS)
    from engine.checkpoints import resolve_model

    model = make_servable("llama", tmp_path_factory.mktemp("tiny-llama"), resolve_model("smollm2-135m-instruct"))
    logs = tmp_path_factory.mktemp("router")
    env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": TOKEN}
    env.pop("PDSERVE_CLUSTER_TOKEN_FILE", None)
    args = ("--model", str(model), *FLAGS)
    pe = ServerProcess("--role", "pe", *args, host=PE_HOST, env=env, log_path=logs / "pe.log")

    def new_ce(host: str, port: int | None = None) -> ServerProcess:
        return ServerProcess(
            "--role", "ce", *args, "--prefill-url", pe.url, "--kv-host", host, "--kv-port-base", str(free_port()),
            host=host, port=port, env=env, log_path=logs / f"ce-{host}.log",
        )  # fmt: skip

    ces = [new_ce(h) for h in CE_HOSTS]
    decode_url = ",".join(c.url for c in ces)
    # one replica as `python -m pd.router.server`, probing an up CE once a minute (so that a request finds
    # the dead CE first: the failover path), the other as `pdserve router`, probing twice a second (its
    # probe finds it: the CE is left out before a request tries it)
    replicas = (
        ((sys.executable, "-m", "pd.router.server"), "60"),
        ((sys.executable, "-m", "pd.tools.cli", "router"), "0.5"),
    )
    routers = [
        ServerProcess(
            "--decode-url", decode_url, "--health-interval-s", interval, "--access-log",
            command=cmd, host=h, log_path=logs / f"router-{h}.log",
        )
        for h, (cmd, interval) in zip(ROUTER_HOSTS, replicas)
    ]  # fmt: skip
    every = [pe, *ces, *routers]
    c = Cluster(pe, {ce.url: ce for ce in ces}, routers, new_ce)
    try:
        for s in every:
            s.start()
        for s in every:
            s.wait_ready()
        deadline = time.monotonic() + 30
        for r in routers:  # both CEs seen up by both routers
            while [b["state"] for b in get_json(r.url + "/health")[1]["decode_engines"]] != ["up", "up"]:
                assert time.monotonic() < deadline, get_json(r.url + "/health")
                time.sleep(0.1)
        yield c
    finally:
        every = [pe, *c.ces.values(), *routers]  # a CE started again included
        for s in every:
            s.terminate()
        for s in every:
            s.stop()


def served(c: Cluster, ce_url: str) -> float:
    return metric(ce_url, "pdserve_requests_total")


@pytest.mark.slow
def test_conversation_keeps_its_ce_then_fails_over(cluster: Cluster) -> None:
    c = cluster
    urls = list(c.ces)
    first_user = "Tell me about the old lighthouse keeper and the storms of the northern coast, " * 4
    history: list[dict] = [{"role": "user", "content": first_user}]
    home = hrw_order(first_user, urls)[0]  # every router, and every CE for its PE, ranks the same way
    other = next(u for u in urls if u != home)
    before = {u: served(c, u) for u in urls}
    hits0 = metric(home, "pdserve_engine_decode_cache_hit_tokens_total")

    # turn 1 through router 1, streamed: the chunks pass through one by one
    stream = openai_client(c.routers[0].url).chat.completions.create(
        model=MODEL, messages=history, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    answer = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1
    assert chunks[-1].usage.completion_tokens == 12
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]

    # turn 2 through router 2 (another replica), with our request id: the same CE, its decode cache hits
    raw = openai_client(c.routers[1].url).chat.completions.with_raw_response.create(
        model=MODEL, messages=history, max_tokens=6, temperature=0, extra_headers={"X-Request-Id": "conv-turn-2"},
    )  # fmt: skip
    r2 = raw.parse()
    assert raw.headers["X-Request-Id"] == "conv-turn-2" and r2.id == "chatcmpl-conv-turn-2"  # the CE's id
    assert {u: served(c, u) - before[u] for u in urls} == {home: 2, other: 0}
    assert metric(home, "pdserve_engine_decode_cache_hit_tokens_total") - hits0 >= 16  # a page at least
    for r in c.routers:
        assert metric(r.url, "pdserve_router_backend_selected_total", backend=home, reason="affinity") == 1
    # the CE's vLLM-named series count what it served (pd/frontend/vllm_metrics.py)
    assert metric(home, "vllm:generation_tokens_total", model_name=MODEL, engine="0") == 12 + 6
    assert metric(home, "vllm:request_success_total", finished_reason="length") == 2
    history += [{"role": "assistant", "content": r2.choices[0].message.content}, {"role": "user", "content": "Why?"}]

    # a client gone mid-stream: the router closes its CE request, the CE aborts it and frees its KV
    body = json.dumps({"model": MODEL, "messages": history, "max_tokens": 1000, "stream": True,
                       "ignore_eos": True}).encode()  # fmt: skip
    req = urllib.request.Request(c.routers[0].url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as stream_resp:
        assert stream_resp.readline().startswith(b"data: ")
    ce = c.ces[home]
    wait_idle(ce.port, host=ce.host, timeout_s=30)
    assert metric(c.routers[0].url, "pdserve_router_backend_inflight", backend=home) == 0
    assert served(c, home) - before[home] == 2  # the aborted one is no finished request

    # the conversation's CE dies: the next turn is served by the other CE, through either router
    os.killpg(c.ces[home].pid, signal.SIGKILL)
    c.ces[home].stop()
    r3 = openai_client(c.routers[0].url).chat.completions.create(
        model=MODEL, messages=history, max_tokens=6, temperature=0, extra_headers={"X-Request-Id": "conv-turn-3"},
    )  # fmt: skip
    assert r3.id == "chatcmpl-conv-turn-3" and r3.usage.completion_tokens == 6
    assert served(c, other) - before[other] == 1
    router = c.routers[0].url
    assert metric(router, "pdserve_router_failovers_total", backend=home) == 1
    assert metric(router, "pdserve_router_backend_selected_total", backend=other, reason="failover") == 1
    assert metric(router, "pdserve_router_backend_up", backend=home) == 0
    assert metric(router, "pdserve_router_requests_total", backend=other, status="200") == 1
    # and the turn after it stays there, through the replica whose probe saw the CE go
    deadline = time.monotonic() + 10
    while metric(c.routers[1].url, "pdserve_router_backend_up", backend=home) != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r4 = openai_client(c.routers[1].url).chat.completions.create(
        model=MODEL, messages=[*history, {"role": "assistant", "content": r3.choices[0].message.content},
                               {"role": "user", "content": "Go on."}], max_tokens=4, temperature=0,
    )  # fmt: skip
    assert r4.usage.completion_tokens == 4 and served(c, other) - before[other] == 2
    assert metric(c.routers[1].url, "pdserve_router_failovers_total") == 0
    assert metric(c.routers[1].url, "pdserve_router_backend_selected_total", backend=other, reason="affinity") == 1


@pytest.mark.slow
def test_a_draining_ce_is_failed_over(cluster: Cluster) -> None:
    """A CE that drains (SIGTERM: a rolling update) answers 503 to new requests while it finishes its own:
    a router that still counts it up sends the conversation's next turn to the next CE, and the client
    sees a normal answer. (Runs after the conversation test, which killed one CE: it is started again.)"""
    c = cluster
    dead = next(u for u, ce in c.ces.items() if ce.proc is None or ce.proc.poll() is not None)
    drainee = c.restart_ce(dead)
    survivor = next(u for u in c.ces if u != dead)
    router = c.routers[0].url  # probes an up CE once a minute: it will not see the drain before a request
    deadline = time.monotonic() + 30
    while metric(router, "pdserve_router_backend_up", backend=dead) != 1:  # its backoff probe sees it back
        assert time.monotonic() < deadline
        time.sleep(0.2)
    user = next(f"conversation {i}" for i in range(100) if hrw_order(f"conversation {i}", list(c.ces))[0] == dead)
    # a long answer in flight on the drainee keeps it draining (not gone) while the next turn arrives
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Talk."}], "max_tokens": 1500,
                       "stream": True, "ignore_eos": True}).encode()  # fmt: skip
    req = urllib.request.Request(drainee.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as long_answer:
        assert long_answer.readline().startswith(b"data: ")
        drainee.terminate()  # SIGTERM: it drains
        deadline = time.monotonic() + 10
        while get_json(drainee.url + "/health")[1].get("status") != "draining":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before = served(c, survivor)
        failovers = metric(router, "pdserve_router_failovers_total", backend=dead)
        r = openai_client(router).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": user}], max_tokens=3, temperature=0,
        )  # fmt: skip
        assert r.usage.completion_tokens == 3
        assert served(c, survivor) - before == 1
        assert metric(router, "pdserve_router_failovers_total", backend=dead) - failovers == 1
        assert f"failing over from {dead} to {survivor}: answered 503" in c.routers[0].log_tail()

def test_no_ce_answers(tmp_path: Path) -> None:
    """A router whose only CE is not there: /health 503, a request 502 in OpenAI's error shape (after
    trying it: the probe may not have run yet), a malformed X-Request-Id 400; never a hang or a 500."""
    dead = f"http://127.0.0.1:{free_port()}"
    r = ServerProcess("--decode-url", dead, command=(sys.executable, "-m", "pd.router.server"),
                      log_path=tmp_path / "router.log")  # fmt: skip
    r.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if get_json(r.url + "/health/live")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, r.log_tail()
            time.sleep(0.1)
        status, body = get_json(r.url + "/health")
        assert status == 503 and body["decode_engines"][0]["url"] == dead
        assert get_json(r.url + "/health/ready")[0] == 503
        chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
        for headers, want, code in (
            ({"X-Request-Id": "ok-1"}, 502, "decode_engines_failed"),
            ({"X-Request-Id": "not ok"}, 400, "invalid_request_id"),
        ):
            req = urllib.request.Request(r.url + "/v1/chat/completions", chat, {"Content-Type": "application/json", **headers})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == want
            assert json.loads(e.value.read())["error"]["code"] == code
        assert metric(r.url, "pdserve_router_requests_total", backend="none", status="502") == 1
        assert metric(r.url, "pdserve_router_backend_selected_total", backend=dead, reason="fallback") == 1
        assert metric(r.url, "pdserve_router_backend_up", backend=dead) == 0
    finally:
        r.stop()


async def test_dns_membership_follows_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """dns+http://NAME:PORT: every address NAME resolves to is a CE; looked up again, the CEs follow; a
    failed lookup keeps the CEs it had. (The resolver is replaced: no DNS server here; the real one is
    pd.disagg.membership.resolve, tested in tests/pd/disagg/test_prefill_pool.py.)"""
    from pd.disagg import membership

    answers = {"ce.test": ["127.0.0.3", "127.0.0.4"]}

    async def resolve(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError(f"cannot resolve {host}")
        return answers[host]

    monkeypatch.setattr(membership, "resolve", resolve)
    port = free_port()
    joined: list[str] = []
    left: list[str] = []
    pool = BackendPool(
        f"http://127.0.0.9:{port},dns+http://ce.test:{port}", 0.5, 8, 60.0, 60.0,
        on_state=lambda b: joined.append(b.url), on_leave=lambda b: left.append(b.url),
    )  # fmt: skip
    await pool.start()
    try:
        assert list(pool.backends) == [f"http://127.0.0.{i}:{port}" for i in (9, 3, 4)]
        assert pool.backends[f"http://127.0.0.3:{port}"].source == f"dns+http://ce.test:{port}"
        answers["ce.test"] = ["127.0.0.4", "127.0.0.5"]
        await pool.peers.refresh()
        assert list(pool.backends) == [f"http://127.0.0.{i}:{port}" for i in (9, 4, 5)]
        assert left == [f"http://127.0.0.3:{port}"]
        del answers["ce.test"]  # a failed lookup keeps the CEs it had
        await pool.peers.refresh()
        assert list(pool.backends) == [f"http://127.0.0.{i}:{port}" for i in (9, 4, 5)]
        # none is known up (nothing listens there): each is tried as a fallback, in the hash order
        assert [why for _, why in pool.order("k")] == ["fallback"] * 3
    finally:
        await pool.stop()
