"""The KV receiver's port against peers without the token, on 127.0.0.1: a cap on connections, a share
of them for unauthenticated ones, a short deadline to authenticate; and text a peer sends (a nack's
reason, a sender or request id) logged and passed on escaped and cut short, never as lines of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import Callable

import pytest

from tests.transfer.support import FAST, LAYOUT_SWA, TOKEN, Sink, make_export, receiver
from transfer.auth import client_handshake
from transfer.config import TransferConfig
from transfer.errors import MESSAGE_CHARS, PROTOCOL, UNEXPECTED, HandoffError, printable
from transfer.header import make_header
from transfer.messages import Nack, Offer
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.wire import Channel, pack

# four connections, two of them unauthenticated at most; nobody times out unless a test says so
LIMITED = dataclasses.replace(FAST, max_connections=4, auth_timeout_s=30.0, handshake_timeout_s=30.0)
FORGED = "\nFAKE LOG LINE"


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bytes | None:
    """What the receiver sent before closing the connection, or None if it is still open."""
    try:
        return await asyncio.wait_for(reader.read(), timeout_s)
    except asyncio.TimeoutError:
        return None


async def authenticated(r: KVReceiver, sender_id: str = "test-pe") -> Channel:
    """A connection that has authenticated and then sends nothing (a PE's kept connection)."""
    ch = Channel(socket.create_connection(("127.0.0.1", r.port)), r.address)
    await client_handshake(ch, TOKEN, sender_id)
    return ch


async def send_one(r: KVReceiver, sink: Sink, rid: str) -> None:
    sink.expected.add(rid)
    sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
    try:
        await sender.send(r.address, dataclasses.replace(make_export(), request_id=rid), timeout_s=5.0)
    finally:
        sender.close()
    assert rid in sink.delivered


def forged_lines(records: list[logging.LogRecord], text: str) -> list[str]:
    """The messages of the records that mention text, each checked to be one line."""
    lines = [m for m in (rec.getMessage() for rec in records) if text in m]
    assert all("\n" not in m and "\r" not in m for m in lines)
    return lines


# ---- printable --------------------------------------------------------------------------------------


def test_printable_escapes_and_cuts() -> None:
    same = "req-1 é 日本 'q' \\n"
    assert printable(same) == same  # printable text, backslashes included, as it is
    assert printable("a\nb\r\x1b[31m\x00\u2028\t") == "a\\nb\\r\\x1b[31m\\x00\\u2028\\t"
    assert printable(ValueError("x\ny")) == "x\\ny"
    assert printable(b"\n") == "b'\\n'"
    long = printable("x" * 10_000)
    assert long == "x" * 200 + "..."
    assert len(printable("\n" * 10_000, 50)) <= 53  # escapes count towards the limit
    once = printable("y\n" * 30)
    assert printable(once, 1000) == once  # escaping again changes nothing


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        TransferConfig(max_connections=0)
    with pytest.raises(ValueError):
        TransferConfig(auth_timeout_s=0)


# ---- the cap and the unauthenticated share ------------------------------------------------------------


async def test_silent_peers_hold_at_most_their_share() -> None:
    sink = Sink()
    async with receiver(sink, config=LIMITED) as r:
        assert r.max_unauthenticated == 2
        conns = [await asyncio.open_connection("127.0.0.1", r.port) for _ in range(10)]
        await until(lambda: r.counters["evicted_unauthenticated"] == 8)
        assert r.num_connections == 2
        # the oldest eight were closed at once (some before their hello); the newest two are held
        got = await asyncio.gather(*(closed_within(reader, 2.0) for reader, _ in conns[:8]))
        assert all(g is not None for g in got)
        held = await asyncio.gather(*(closed_within(reader, 0.3) for reader, _ in conns[8:]))
        assert held == [None, None]
        assert r.counters["refused_auth"] == 0 and r.counters["refused_connections"] == 0
        for _, writer in conns:
            writer.close()
        await until(lambda: r.num_connections == 0)
        assert r.counters["refused_auth"] == 2  # the two held, closed by their peer before auth
        await send_one(r, sink, "after-flood")


async def test_connections_past_the_cap_are_closed_unread(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="transfer.receiver")
    sink = Sink()
    async with receiver(sink, config=LIMITED) as r:
        kept = [await authenticated(r) for _ in range(4)]
        await until(lambda: r.num_connections == 4)
        conns = [await asyncio.open_connection("127.0.0.1", r.port) for _ in range(5)]
        got = await asyncio.gather(*(closed_within(reader, 2.0) for reader, _ in conns))
        assert got == [b""] * 5  # closed before anything, not even a hello
        assert r.counters["refused_connections"] == 5 and r.num_connections == 4
        for _, writer in conns:
            writer.close()
        kept.pop().close()  # a slot comes free: a PE gets in again
        await until(lambda: r.num_connections == 3)
        await send_one(r, sink, "after-cap")
        for ch in kept:
            ch.close()
    refusals = [m for m in caplog.messages if m.startswith("refused KV connection from 127.0.0.1")]
    assert len(refusals) == 1 and "4 connections open" in refusals[0]  # throttled


async def test_silent_peers_do_not_keep_a_pe_out() -> None:
    sink = Sink()
    async with receiver(sink, config=LIMITED) as r:
        kept = [await authenticated(r) for _ in range(2)]
        silent = [await asyncio.open_connection("127.0.0.1", r.port) for _ in range(2)]
        await until(lambda: r.num_connections == 4)  # at the cap, the share of the silent ones full
        t0 = time.monotonic()
        await send_one(r, sink, "past-the-silent")
        assert time.monotonic() - t0 < 3.0  # not after a silent peer's auth timeout (30 s)
        assert r.counters["evicted_unauthenticated"] == 1
        assert await closed_within(silent[0][0], 2.0) is not None  # the oldest made room
        for ch in kept:
            ch.close()
        for _, writer in silent:
            writer.close()


async def test_unauthenticated_peer_dropped_after_auth_timeout(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="transfer.receiver")
    sink = Sink()
    async with receiver(sink, config=dataclasses.replace(FAST, auth_timeout_s=0.3)) as r:
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        t0 = time.monotonic()
        got = await closed_within(reader, 5.0)
        elapsed = time.monotonic() - t0
        writer.close()
        assert got and 0.25 < elapsed < 3.0  # the hello, a nack, closed
        await send_one(r, sink, "authenticated-in-time")  # a PE authenticates well within 0.3 s
    assert r.counters["refused_auth"] == 1
    assert "no authentication within 0.3 s" in caplog.text


# ---- peer text in logs and errors ----------------------------------------------------------------------


async def test_nack_before_auth_is_logged_escaped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="transfer.receiver")
    async with receiver(Sink()) as r:
        ch = Channel(socket.create_connection(("127.0.0.1", r.port)), r.address)
        await ch.recv()  # the hello
        await ch.send(Nack(PROTOCOL, FORGED + "x" * 3000))  # a frame before auth: at most 4 KiB
        reply = await asyncio.wait_for(ch.recv(), 5.0)
        ch.close()
    assert isinstance(reply, Nack) and "\n" not in reply.reason
    (line,) = forged_lines(caplog.records, "FAKE LOG LINE")
    assert "\\nFAKE LOG LINE" in line and line.endswith("...") and len(line) < MESSAGE_CHARS + 200


async def test_nack_and_ids_after_auth_are_logged_escaped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="transfer.receiver")
    huge = FORGED + "x" * 10_000
    async with receiver(Sink()) as r:
        ch = await authenticated(r, sender_id=FORGED + "y" * 3000)
        await ch.send(Nack(PROTOCOL, huge))  # a nack where an offer belongs
        assert isinstance(await asyncio.wait_for(ch.recv(), 5.0), Nack)
        ch.close()
        ch = await authenticated(r)
        await ch.send(Nack("\nnot-a-code", huge))  # a code this side does not know: PROTOCOL
        assert isinstance(await asyncio.wait_for(ch.recv(), 5.0), Nack)
        ch.close()
        ch = await authenticated(r)
        exp = dataclasses.replace(make_export(), request_id=huge)  # nobody expects it: refused
        await ch.send(Offer("tcp", make_header(exp, LAYOUT_SWA).encode()))
        reply = await asyncio.wait_for(ch.recv(), 5.0)
        ch.close()
    assert isinstance(reply, Nack) and reply.code == UNEXPECTED
    lines = forged_lines(caplog.records, "FAKE LOG LINE")
    assert len(lines) == 4  # the sender id, the two nacks, the request id
    for line in lines:
        assert "\\nFAKE LOG LINE" in line and line.endswith("...") and len(line) < MESSAGE_CHARS + 200
    (sender,) = [m for m in lines if "authenticated as" in m]
    assert sender.endswith("y" * (200 - len(printable(FORGED))) + "...")  # a field: 200 characters
    assert any("\\nnot-a-code" in m and m.count("protocol") >= 1 for m in lines)


async def test_sender_escapes_a_listeners_nack() -> None:
    """A listener at the receiver's address that answers with a nack of its own making: its text
    reaches the PE's error (and from there an HTTP client) escaped and cut short."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(pack(Nack("\nEVIL", FORGED + "z" * 3000)))  # a frame before auth: at most 4 KiB
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
    try:
        with pytest.raises(HandoffError) as e:
            await sender.send(f"127.0.0.1:{port}", make_export(), timeout_s=5.0)
    finally:
        sender.close()
        server.close()
        await server.wait_closed()
    assert e.value.code == PROTOCOL  # not the listener's own code
    text = str(e.value)
    assert "\n" not in text and "\\nEVIL: \\nFAKE LOG LINE" in text
    assert text.endswith("...") and len(e.value.message) <= MESSAGE_CHARS + 3
