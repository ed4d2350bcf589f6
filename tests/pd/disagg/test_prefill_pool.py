"""The CE's choice of PE (pd/disagg/prefill_pool.py; the --prefill-url entries in pd/config.py): --prefill-url parsing, rendezvous order
shared by every CE, the load bound, least-loaded and round-robin, fallback while no PE is known up,
dns+ membership, and the health and metrics a CE shows per PE. PEs here are PrefillClients whose
state the test sets (their probes aim at ports nothing listens on)."""

from __future__ import annotations

import collections

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pd.config import ServerConfig, Target, parse_prefill_urls
from pd.disagg import membership
from pd.disagg.membership import hrw_order, url_of
from pd.disagg.metrics import ClusterMetrics
from pd.disagg.prefill_pool import PrefillPool
from pd.tools.server_process import free_port

TOKEN = b"pe-pool-test-token-0123456789abcdef"


def urls(n: int) -> list[str]:
    return [f"http://127.0.0.{i + 2}:{free_port()}" for i in range(n)]


async def pool_of(
    pe_urls: list[str], routing: str = "affinity", slack: float = 0.5, up: bool = True
) -> tuple[PrefillPool, CollectorRegistry]:
    registry = CollectorRegistry()
    pool = PrefillPool(",".join(pe_urls), TOKEN, 5.0, ClusterMetrics(registry), routing, slack)
    await pool.start()
    for c in pool.clients.values():
        c._watch_task.cancel()  # type: ignore[union-attr]  # the test owns each PE's state
        c.state = "up" if up else "down"
    return pool, registry


def test_parse_prefill_urls():
    assert parse_prefill_urls("http://a:1, https://b:2/ ,dns+http://pe.ns.svc:8889") == [
        Target("http://a:1"),
        Target("https://b:2"),
        Target("dns+http://pe.ns.svc:8889", dns=True),
    ]
    t = parse_prefill_urls("dns+http://pe.ns.svc:8889")[0]
    assert (t.scheme, t.host, t.port) == ("http", "pe.ns.svc", 8889)
    for bad, why in [
        ("", "empty entry"),
        ("http://a:1,,http://b:2", "empty entry"),
        ("ftp://a:1", "not http"),
        ("http://a:1/prefill", "path"),
        ("dns+http://name", "needs a port"),
        ("http://a:1,http://a:1", "twice"),
        ("http://a:99999", "(?i)port out of range"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_prefill_urls(bad)
    # the server's own flag check uses it
    with pytest.raises(ValueError, match="not http"):
        ServerConfig.from_argv(["--role", "ce", "--prefill-url", "tcp://a:1"])
    cfg = ServerConfig.from_argv(["--role", "ce", "--prefill-url", "http://a:1,http://b:2", "--pe-routing", "round-robin"])
    assert cfg.pe_routing == "round-robin" and cfg.pe_load_slack == 0.5
    assert url_of("http", "::1", 8889) == "http://[::1]:8889"


def test_rendezvous_order_is_shared_and_moves_only_the_lost_pe_keys():
    pes = [f"http://10.0.0.{i}:8889" for i in range(4)]
    keys = [f"conversation {i}" for i in range(400)]
    first = {k: hrw_order(k, pes)[0] for k in keys}
    # any CE, given the list in any order, ranks the same way
    assert all(hrw_order(k, list(reversed(pes)))[0] == first[k] for k in keys)
    spread = collections.Counter(first.values())
    assert len(spread) == 4 and min(spread.values()) > 60  # 100 each expected
    # a PE leaving moves its own keys only, each to the next of its order
    gone = pes[1]
    rest = [p for p in pes if p != gone]
    for k in keys:
        if first[k] != gone:
            assert hrw_order(k, rest)[0] == first[k]
        else:
            assert hrw_order(k, rest)[0] == hrw_order(k, pes)[1]


async def test_affinity_then_overflow_past_the_load_bound():
    pool, _ = await pool_of(urls(2), slack=0.5)
    try:
        key = "the conversation"
        home, _ = pool.choose(key)  # type: ignore[misc]
        other = next(c for c in pool.clients.values() if c is not home)
        assert pool.choose(key) == (home, "affinity")
        # 2 in flight at home, 0 elsewhere: mean with the new one 1.5, bound ceil(1.5 * 1.5) = 3
        home.num_inflight = 2
        assert pool.choose(key) == (home, "affinity")
        home.num_inflight = 3
        assert pool.choose(key) == (other, "overflow")
        home.num_inflight = 0
        # the failover choice skips the first PE
        assert pool.choose(key, exclude=frozenset({home.url})) == (other, "affinity")
        assert pool.choose(key, exclude=frozenset(pool.clients)) is None
        # a draining or down PE is left out at once
        home.state = "draining"
        assert pool.choose(key) == (other, "affinity")
        other.state = "down"  # none known up: tried anyway, in the conversation's order
        assert pool.choose(key) == (home, "fallback")
    finally:
        await pool.stop()


async def test_least_loaded_and_round_robin():
    pool, _ = await pool_of(urls(3), routing="least-loaded")
    try:
        a, b, c = pool.clients.values()
        a.num_inflight, b.num_inflight, c.num_inflight = 2, 0, 1
        assert pool.choose("k") == (b, "least-loaded")
        b.state = "down"
        assert pool.choose("k") == (c, "least-loaded")
    finally:
        await pool.stop()
    pool, _ = await pool_of(urls(3), routing="round-robin")
    try:
        picks = [pool.choose("same key")[0].url for _ in range(6)]  # type: ignore[index]
        assert sorted(picks[:3]) == sorted(pool.clients) and picks[3:] == picks[:3]
    finally:
        await pool.stop()


async def test_health_and_metrics_per_pe():
    pool, registry = await pool_of(urls(2))
    try:
        c = next(iter(pool.clients.values()))
        with pool.attempt(c, "affinity"):
            desc = {d["url"]: d for d in pool.describe()}
            assert desc[c.url]["inflight"] == 1 and desc[c.url]["state"] == "up"
            text = generate_latest(registry).decode()
            assert f'pdserve_pe_inflight{{pe="{c.url}"}} 1.0' in text
        text = generate_latest(registry).decode()
        assert f'pdserve_pe_inflight{{pe="{c.url}"}} 0.0' in text
        assert f'pdserve_pe_selected_total{{pe="{c.url}",reason="affinity"}} 1.0' in text
        assert f'pdserve_pe_selected_total{{pe="{c.url}",reason="failover"}} 0.0' in text
    finally:
        await pool.stop()


async def test_dns_membership_follows_the_name(monkeypatch):
    answers = {"pe.test": ["127.0.0.2", "127.0.0.3"]}

    async def resolve(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError(f"cannot resolve {host}")
        return answers[host]

    monkeypatch.setattr(membership, "resolve", resolve)
    port = free_port()
    pool = PrefillPool(
        f"http://127.0.0.9:{port},dns+http://pe.test:{port}", TOKEN, 5.0, ClusterMetrics(CollectorRegistry())
    )
    await pool.start()
    try:
        assert list(pool.clients) == [f"http://127.0.0.{i}:{port}" for i in (9, 2, 3)]
        assert pool.clients[f"http://127.0.0.2:{port}"].describe()["source"] == f"dns+http://pe.test:{port}"
        answers["pe.test"] = ["127.0.0.3", "127.0.0.4"]
        gone = pool.clients[f"http://127.0.0.2:{port}"]
        gone.num_inflight = 1  # a prefill in flight there: its client closes once it ends
        await pool.peers.refresh()
        assert list(pool.clients) == [f"http://127.0.0.{i}:{port}" for i in (9, 3, 4)]
        assert gone.retired and gone in pool._retired
        with pool.attempt(gone, "affinity"):
            pass
        gone.num_inflight -= 1
        with pool.attempt(gone, "affinity"):
            pass
        assert gone not in pool._retired
        del answers["pe.test"]  # a failed lookup keeps the PEs it had
        await pool.peers.refresh()
        assert len(pool.clients) == 3 and "cannot resolve" in (pool.dns_error or "")
    finally:
        await pool.stop()


async def test_dns_resolves_a_real_name():
    assert "127.0.0.1" in await membership.resolve("localhost", 80)
    assert await membership.resolve("127.0.0.7", 80) == ["127.0.0.7"]


async def test_a_draining_pe_is_left_out_at_once():
    """The PE's own app (pd.server.make_prefill_app; no engine ranks needed for this path) drains: its
    /prefill answers 503 shutting_down and its /health says draining; the CE's client marks it
    draining on the answer (before any probe) and the pool chooses the other PE."""
    from aiohttp import web

    from engine.request import SamplingParams
    from pd.disagg.prefill_client import PrefillFailed
    from pd.frontend.coordinator import Coordinator
    from pd.messages import PrefillBody
    from pd.server import make_prefill_app

    co = Coordinator(ServerConfig(role="pe"))
    runner = web.AppRunner(make_prefill_app(co, TOKEN))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    pe = f"http://127.0.0.1:{port}"
    pool, _ = await pool_of([pe, urls(1)[0]])
    try:
        client = pool.clients[pe]
        body = PrefillBody("r-1", (1, 2, 3), SamplingParams(max_tokens=2), "127.0.0.1:1")
        co.admission.drain()
        with pytest.raises(PrefillFailed) as e:
            await client.prefill(body)
        assert e.value.status == 503 and e.value.code == "shutting_down"
        assert client.state == "draining" and not client.is_up
        key = next(k for k in (f"k{i}" for i in range(100)) if hrw_order(k, list(pool.clients))[0] == pe)
        assert pool.choose(key)[0] is not client  # type: ignore[index]
        assert await client._probe() == ("draining", "the prefill engine is shutting down")
    finally:
        await pool.stop()
        await runner.cleanup()
        await co.stop()


async def test_a_reset_connection_is_sent_again_signed_anew():
    """The PE closing a pooled connection as the CE reuses it shows as a reset: the client sends once
    more on a new connection with a fresh signature (a nonce is good once). Here a loopback server
    resets the first connection after reading the request and answers the second with a 400."""
    import asyncio
    import socket
    import struct

    from engine.request import SamplingParams
    from pd.disagg.prefill_client import PrefillClient, PrefillFailed
    from pd.messages import PrefillBody

    auths: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        auths.append(next(v for k, _, v in (h.partition(": ") for h in lines) if k.lower() == "authorization"))
        length = int(next(v for k, _, v in (h.partition(": ") for h in lines) if k.lower() == "content-length"))
        await reader.readexactly(length)
        if len(auths) == 1:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: RST
            writer.transport.abort()
            return
        body = b'{"error": {"message": "bad", "type": "invalid_request_error", "code": "x"}}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n")
        writer.write(f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = PrefillClient(f"http://127.0.0.1:{port}", TOKEN, 10.0)
    await client.start()
    client._watch_task.cancel()  # type: ignore[union-attr]
    try:
        with pytest.raises(PrefillFailed) as e:
            await client.prefill(PrefillBody("r", (1, 2), SamplingParams(max_tokens=2), "127.0.0.1:1"))
        assert e.value.status == 400 and len(auths) == 2 and auths[0] != auths[1]
    finally:
        await client.stop()
        server.close()
        await server.wait_closed()
