"""The tcp payload striped over several sockets (--kv-tcp-streams), on 127.0.0.1: how a payload is cut,
the same pages arriving over 1 or 3 sockets, and a stream broken mid-payload failing the handoff on
both ends without a hang, a leaked connection or a stuck thread."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import socket
import struct
import threading

import pytest
import torch

from engine.handoff import KVLayout, SequenceExport
from pdkernels.checksum import CHUNK_BYTES
from tests.transfer.support import FAST, TOKEN, Sink, make_export, receiver
from transfer.auth import client_handshake, server_handshake
from transfer.checksum import payload_checksum
from transfer.config import MAX_TCP_STREAMS, TransferConfig
from transfer.errors import INCOMPLETE, PROTOCOL, TIMEOUT, HandoffError
from transfer.header import HandoffHeader, make_header, payload_segments
from transfer.messages import AuthOk, Join, Nack, Offer, Ready, Streams
from transfer.sender import KVSender
from transfer.tcp import byte_view, stripe
from transfer.wire import Channel

# pages of 128 KiB (fp32, 8 heads of 64, 16 tokens, 2 layers): a few MiB of payload in a few dozen pages;
# the SWA state (2 layers, a window of 24) is one segment smaller than a checksum chunk
LAYOUT = KVLayout(
    num_full_layers=2, num_swa_layers=2, block_size=16, window=24, num_kv_heads=8, head_dim=64, dtype=torch.float32
)
RST = struct.pack("ii", 1, 0)  # SO_LINGER: reset on close


def streams(n: int, **kw: object) -> TransferConfig:
    return dataclasses.replace(FAST, tcp_streams=n, **kw)  # type: ignore[arg-type]


def test_config_bounds_the_number_of_streams() -> None:
    for bad in (0, MAX_TCP_STREAMS + 1):
        with pytest.raises(ValueError, match="tcp_streams"):
            TransferConfig(tcp_streams=bad)
    with pytest.raises(ValueError, match="tcp_streams 2 stripes tcp payloads; transport is 'ipc'"):
        TransferConfig(transport="ipc", tcp_streams=2)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_stripe_covers_each_byte_once_in_order(n: int) -> None:
    """Runs are contiguous, in payload order, start at checksum chunks, pieces at most chunk_bytes;
    segments of any size (empty, under a chunk, not a multiple of 8 bytes)."""
    sizes = [3 * CHUNK_BYTES + 12345, 0, 100 << 10, 2 * CHUNK_BYTES + 5, 7]
    segments = [torch.empty(s, dtype=torch.uint8) for s in sizes]
    runs = stripe(segments, n, 2 * CHUNK_BYTES)
    assert len(runs) == n
    flat = [p for run in runs for p in run]
    for i, size in enumerate(sizes):
        mine = [p for p in flat if p.segment == i]
        offsets = [p.offset for p in mine]
        assert offsets == sorted(offsets) and sum(p.data.numel() for p in mine) == size
        assert all(p.offset % CHUNK_BYTES == 0 and 0 < p.data.numel() <= 2 * CHUNK_BYTES for p in mine)
        assert all(a.offset + a.data.numel() == b.offset for a, b in zip(mine, mine[1:]))
        assert all(p.data.data_ptr() == segments[i].data_ptr() + p.offset for p in mine)
    assert [(p.segment, p.offset) for p in flat] == sorted((p.segment, p.offset) for p in flat)
    if n > 1:  # each run near its share of the payload (it rounds up to a chunk)
        total = sum(sizes)
        assert all(abs(sum(p.data.numel() for p in run) - total / n) <= 2 * CHUNK_BYTES for run in runs)


def export(num_prompt: int, rid: str = "req-1", seed: int = 0) -> SequenceExport:
    return dataclasses.replace(make_export(LAYOUT, num_prompt=num_prompt, seed=seed), request_id=rid)


@pytest.mark.parametrize("n", [1, 3])
async def test_pages_arrive_identical(n: int) -> None:
    """Payloads of 5.6 MiB (not a multiple of 3 bytes), 2.1 MiB (fewer chunks than 3 per stream),
    1.4 MiB (fewer chunks than streams: 2 used) and 0.3 MiB (one chunk: the control connection alone)
    over one kept connection; then the same concurrently (more connections, each with its streams)."""
    exps = [export(t, f"r{t}", seed=t) for t in (700, 250, 150, 20)]
    assert sum(byte_view(s).numel() for s in payload_segments(exps[0], LAYOUT)) % 3
    more = [export(t, f"c{i}", seed=100 + i) for i, t in enumerate((300, 400, 500))]
    sink = Sink(*[e.request_id for e in exps + more])
    async with receiver(sink, LAYOUT, config=streams(1)) as r:  # the receiver's own setting does not matter
        sender = KVSender(TOKEN, LAYOUT, config=streams(n))
        try:
            for e in exps:
                ack = await sender.send(r.address, e)
                assert ack.payload_bytes == sum(byte_view(s).numel() for s in payload_segments(e, LAYOUT))
            assert sender.counters["connects"] == 1 and r.num_connections == n  # kept, with its streams
            await asyncio.gather(*[sender.send(r.address, e) for e in more])
        finally:
            sender.close()
    for e in exps + more:
        got = sink.delivered[e.request_id]
        assert got.state is not None and e.state is not None
        assert torch.equal(got.pages, e.pages) and torch.equal(got.state, e.state)
        assert payload_checksum(payload_segments(got, LAYOUT)) == payload_checksum(payload_segments(e, LAYOUT))
    assert sink.errors == [] and r.counters["handoffs"] == len(exps + more)


async def _wait_until(cond: object, what: str, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kv-stream")]


async def _open(addr: str, sender_id: str) -> Channel:
    host, port = addr.rsplit(":", 1)
    ch = Channel(socket.create_connection((host, int(port))), addr)
    await client_handshake(ch, TOKEN, sender_id)
    return ch


async def test_receiver_fails_a_handoff_whose_stream_breaks() -> None:
    """A hand-driven sender of 3 streams sends the first and last runs whole, half of the middle one,
    then resets that socket: the receiver tells its engine (INCOMPLETE, which stream), nacks on the
    control connection, and closes all three; nothing is delivered."""
    exp = export(700)
    header = make_header(exp, LAYOUT)
    runs = stripe(payload_segments(exp, LAYOUT), 3, FAST.chunk_bytes)
    sink = Sink("req-1")
    async with receiver(sink, LAYOUT) as r:
        key = secrets.token_bytes(16)
        data = [await _open(r.address, f"data{i}") for i in range(2)]
        for i, d in enumerate(data):
            await d.send(Join(key, i))
        ch = await _open(r.address, "control")
        ch.data = data
        try:
            await ch.send(Streams(key, 2))
            await ch.send(Offer("tcp", header.encode(), {"streams": 3}))
            await ch.expect(Ready)
            loop = asyncio.get_running_loop()
            for k in (0, 2):
                sock = ch.sock if k == 0 else data[1].sock
                for p in runs[k]:
                    await loop.sock_sendall(sock, p.data.numpy().tobytes())
            middle = b"".join(p.data.numpy().tobytes() for p in runs[1])
            await loop.sock_sendall(data[0].sock, middle[: len(middle) // 2])
            data[0].sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
            data[0].sock.close()
            reply = await asyncio.wait_for(ch.recv(), 10)
            await _wait_until(lambda: r.num_connections == 0, "the receiver closed all three connections")
        finally:
            ch.close()
    assert isinstance(reply, Nack) and reply.code == INCOMPLETE
    assert sink.delivered == {} and [e.code for e in sink.errors] == [INCOMPLETE]
    assert "stream 1 of 3" in sink.errors[0].message


async def _raw_receiver(lst: socket.socket, got_offer: asyncio.Event) -> None:
    """A hand-driven receiver: serves one sender's control connection and its 2 data connections, reads
    1 MiB of the first data connection's run, then resets it and reads nothing more."""
    loop = asyncio.get_running_loop()
    chans: list[Channel] = []
    try:
        for _ in range(3):
            sock, addr = await loop.sock_accept(lst)
            ch = Channel(sock, str(addr))
            chans.append(ch)
            _, proof = await server_handshake(ch, TOKEN)
            await ch.send(AuthOk(proof, "", LAYOUT.fields()))
        firsts = [await ch.recv() for ch in chans]
        control = next(ch for ch, m in zip(chans, firsts) if isinstance(m, Streams))
        first_data = next(ch for ch, m in zip(chans, firsts) if isinstance(m, Join) and m.index == 0)
        offer = await control.expect(Offer)
        assert offer.extra == {"streams": 3}
        HandoffHeader.decode(offer.header)
        await control.send(Ready())
        got_offer.set()
        buf = bytearray(CHUNK_BYTES)
        view, n = memoryview(buf), 0
        while n < len(buf):
            n += await loop.sock_recv_into(first_data.sock, view[n:])
        first_data.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
        first_data.sock.close()
        await asyncio.sleep(30)  # holds the others open, unread
    finally:
        for ch in chans:
            ch.close()


async def test_sender_fails_a_handoff_whose_stream_breaks() -> None:
    """The receiver resets one of three sockets 1 MiB into its run of a 48 MiB payload and reads no
    other: the sender's send raises INCOMPLETE well before its idle timeout (the other two threads,
    blocked on full sockets, are released), closes its connections, and its threads end with it."""
    exp = export(16 * 192)  # 192 pages of 128 KiB, 48 MiB in all
    got_offer = asyncio.Event()
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        lst.setblocking(False)
        serving = asyncio.create_task(_raw_receiver(lst, got_offer))
        sender = KVSender(TOKEN, LAYOUT, config=streams(3, idle_timeout_s=20.0))
        try:
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(HandoffError) as e:
                await sender.send(f"127.0.0.1:{lst.getsockname()[1]}", exp, timeout_s=15.0)
            elapsed = asyncio.get_running_loop().time() - t0
        finally:
            sender.close()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
    assert got_offer.is_set() and e.value.code == INCOMPLETE, e.value
    assert elapsed < 10.0 and sender._idle == {}
    await _wait_until(lambda: not _stream_threads(), "the sender's stream threads ended")


async def test_unclaimed_and_missing_data_connections_are_closed() -> None:
    """A data connection no control connection claims is closed after handshake_timeout_s; a control
    connection whose announced data connections do not all join is nacked (TIMEOUT) and closed, as is
    one announcing an index twice or data connections of other indices (PROTOCOL), both ends."""
    cfg = streams(1, handshake_timeout_s=0.5)
    sink = Sink()
    async with receiver(sink, LAYOUT, config=cfg) as r:
        lone = await _open(r.address, "lone")
        await lone.send(Join(b"k" * 16, 0))
        reply = await asyncio.wait_for(lone.recv(), 5)
        assert isinstance(reply, Nack) and reply.code == TIMEOUT and "claimed" in reply.reason
        control = await _open(r.address, "control")
        joined = await _open(r.address, "data")
        await joined.send(Join(b"j" * 16, 0))
        await control.send(Streams(b"j" * 16, 2))  # two announced, one joined
        reply = await asyncio.wait_for(control.recv(), 5)
        assert isinstance(reply, Nack) and reply.code == TIMEOUT and "of 2 data connections" in reply.reason
        twice = [await _open(r.address, f"twice{i}") for i in range(2)]
        for ch in twice:
            await ch.send(Join(b"t" * 16, 0))
        reply = await asyncio.wait_for(twice[1].recv(), 5)
        assert isinstance(reply, Nack) and reply.code == PROTOCOL and "twice" in reply.reason
        control2 = await _open(r.address, "control2")
        wrong = await _open(r.address, "wrong")
        await wrong.send(Join(b"w" * 16, 1))  # index 1 of a count of 1
        await control2.send(Streams(b"w" * 16, 1))
        for ch in (control2, wrong):
            reply = await asyncio.wait_for(ch.recv(), 5)
            assert isinstance(reply, Nack) and reply.code == PROTOCOL and "[1] joined" in reply.reason
        await _wait_until(lambda: r.num_connections == 0, "the receiver closed every connection")
        for ch in (lone, control, joined, *twice, control2, wrong):
            ch.close()
    assert r.counters["handoffs"] == 0


async def test_an_idled_out_connection_and_its_streams_are_replaced() -> None:
    """The receiver closes a kept connection idle past its keepalive, data connections included: the
    sender sees it, opens a new one with its streams, and the receiver holds just those afterwards."""
    sink = Sink("a", "b")
    sender = KVSender(TOKEN, LAYOUT, config=streams(3))
    try:
        async with receiver(sink, LAYOUT, config=streams(1, keepalive_s=0.3)) as r:
            await sender.send(r.address, export(150, "a"))
            assert r.num_connections == 3
            await _wait_until(lambda: r.num_connections == 0, "the receiver idled out all three")
            ack = await sender.send(r.address, export(150, "b"))
            assert r.num_connections == 3
    finally:
        sender.close()
    assert not ack.reused and sender.counters["connects"] == 2 and sink.errors == []
    assert sorted(sink.delivered) == ["a", "b"]
