"""The handoff over real sockets on 127.0.0.1: delivery, and every way it must refuse or fail without
delivering anything (bad token, mismatched header, corrupt or cut-short payload, no ack in time)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from engine.handoff import KVLayout, SequenceExport
from tests.transfer.support import FAST, LAYOUT_SWA, TOKEN, Sink, make_export, receiver
from transfer.auth import client_handshake
from transfer.errors import (
    AUTH,
    CHECKSUM,
    INCOMPLETE,
    LAYOUT,
    PROTOCOL,
    REJECTED,
    TIMEOUT,
    UNEXPECTED,
    VERSION,
    HandoffError,
)
from transfer.header import HandoffHeader, make_header, payload_segments
from transfer.messages import Auth, AuthOk, ControlMessage, HandoffAck, Hello, Ids, Nack, Offer, Ready
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.tcp import byte_view
from transfer.wire import PROTOCOL_VERSION, Channel, pack, unpack

ROOT = Path(__file__).resolve().parents[2]


def payload_bytes(exp: SequenceExport, layout: KVLayout = LAYOUT_SWA) -> bytes:
    return b"".join(byte_view(t).numpy().tobytes() for t in payload_segments(exp, layout))


async def raw_offer(addr: str, header: bytes, payload: bytes | None, token: bytes = TOKEN) -> ControlMessage:
    """A hand-driven sender: authenticates, offers header, sends payload (or part of it), then closes
    (payload None) or waits for the receiver's verdict."""
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    ch = Channel(sock, addr)
    try:
        await client_handshake(ch, token, "raw-test-sender")
        await ch.send(Offer("tcp", header))
        reply = await ch.recv()
        if not isinstance(reply, Ready):
            return reply
        await asyncio.get_running_loop().sock_sendall(sock, payload or b"")
        if payload is None:
            return reply
        return await ch.recv()
    finally:
        ch.close()


# ---- control messages --------------------------------------------------------------------------------


def _frame(d: dict[str, Any]) -> bytes:
    """A frame as a peer of another make could send it (no dataclass, no checks)."""
    body = msgpack.packb(d, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def test_control_messages_round_trip() -> None:
    for msg in (
        Hello(PROTOCOL_VERSION, b"n" * 32),
        Auth(PROTOCOL_VERSION, "pe/1", b"c" * 32, b"m" * 32),
        AuthOk(b"m" * 32, "sha256:x", LAYOUT_SWA.fields()),
        Offer("nccl", b"header", {"comm": "k", "uid": b"u"}),
        Ids(b"\x01\x00\x00\x00"),
        Ready(),
        HandoffAck("r", 100, 0.5, 0, {"decode": 0.001}),
        Nack(AUTH, "no"),
    ):
        frame = pack(msg)
        assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
        assert unpack(msgpack.unpackb(frame[4:]), "peer") == msg
    assert msgpack.unpackb(pack(Ready())[4:]) == {"t": "ready", "fields": {}}


@pytest.mark.parametrize(
    "body, code, where",
    [
        ({"t": "ack", "request_id": "r", "payload_bytes": 1, "recv_s": 0.1, "verify_s": 0.1, "x": 1}, PROTOCOL, "x"),
        ({"t": "ack", "request_id": "r", "payload_bytes": True, "recv_s": 0.1, "verify_s": 0.1}, PROTOCOL, "payload_bytes"),
        ({"t": "ack", "request_id": "r", "recv_s": 0.1, "verify_s": 0.1}, PROTOCOL, "payload_bytes"),
        ({"t": "ids", "ids": [1, 2]}, PROTOCOL, "ids"),  # a list for the packed bytes
        ({"t": "offer", "transport": "tcp", "header": b"", "extra": "x"}, PROTOCOL, "extra"),
        ({"t": "nack", "code": "auth"}, PROTOCOL, "reason"),
        ({"t": "what"}, PROTOCOL, "what"),
        ({"t": "hello", "v": PROTOCOL_VERSION + 1, "nonce": b"n", "more": 1}, VERSION, "version"),
    ],
)
def test_control_messages_decode_strictly(body: dict[str, Any], code: str, where: str) -> None:
    with pytest.raises(HandoffError) as e:
        unpack(dict(body), "peer")
    assert e.value.code == code and where in e.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {"transport": "tcp", "header": b"", "extra": {}, "bogus": 1},  # an unknown field
        {"transport": 5, "header": b""},  # a wrong type
        {"transport": "tcp"},  # no header
    ],
)
async def test_malformed_offer_is_refused(fields: dict[str, Any]) -> None:
    sink = Sink("req-1")
    async with receiver(sink) as r:
        host, port = r.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        ch = Channel(sock, r.address)
        try:
            await client_handshake(ch, TOKEN, "malformed")
            await ch.loop.sock_sendall(sock, _frame({"t": "offer", **fields}))
            reply = await asyncio.wait_for(ch.recv(), 10)
        finally:
            ch.close()
    assert isinstance(reply, Nack) and reply.code == PROTOCOL and "offer" in reply.reason
    assert sink.offered == [] and r.counters["refused"] == 1


async def test_round_trip_synthetic() -> None:
    exp = make_export(num_prompt=100)
    sink = Sink("req-1")
    async with receiver(sink, model="m") as r:
        ack = await KVSender(TOKEN, LAYOUT_SWA, model="m", config=FAST).send(r.address, exp)
    got = sink.delivered["req-1"]
    assert (
        ack.request_id == "req-1"
        and ack.transport == "tcp"
        and ack.payload_bytes == 7 * LAYOUT_SWA.page_bytes + LAYOUT_SWA.state_bytes
    )
    assert torch.equal(got.pages, exp.pages) and got.state is not None and torch.equal(got.state, exp.state)
    assert got.params == exp.params and got.seed == exp.seed and got.output_token_ids == [42]
    assert r.counters["handoffs"] == 1 and r.counters["bytes"] == ack.payload_bytes


async def test_concurrent_handoffs_bf16() -> None:
    layout = dataclasses.replace(LAYOUT_SWA, dtype=torch.bfloat16)
    exps = [
        dataclasses.replace(make_export(layout, num_prompt=20 + i, seed=i), request_id=f"r{i}")
        for i in range(4)
    ]
    sink = Sink(*[e.request_id for e in exps])
    async with receiver(sink, layout) as r:
        sender = KVSender(TOKEN, layout, config=FAST)
        await asyncio.gather(*[sender.send(r.address, e) for e in exps])
    for e in exps:
        assert torch.equal(sink.delivered[e.request_id].pages, e.pages)


async def test_wrong_or_missing_token_refused(caplog: pytest.LogCaptureFixture) -> None:
    sink = Sink("req-1")
    caplog.set_level(logging.WARNING, logger="transfer.receiver")
    async with receiver(sink) as r:
        with pytest.raises(HandoffError) as e:
            await KVSender(b"not-the-cluster-token-xyz", LAYOUT_SWA, config=FAST).send(
                r.address, make_export()
            )
        assert e.value.code == AUTH
        # a peer that skips authentication and goes straight to an offer
        with socket.create_connection(("127.0.0.1", r.port)) as s:
            ch = Channel(s, "x")
            await ch.recv()  # the hello
            await ch.send(Offer("tcp", b""))
            reply = await ch.recv()
        assert isinstance(reply, Nack) and reply.code == AUTH
        # a peer that sends nothing but junk
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        writer.write(b"\xff" * 64)
        await asyncio.wait_for(reader.read(), 10)  # the hello, then the receiver hangs up
        writer.close()
    assert sink.offered == [] and sink.delivered == {}
    assert r.counters["refused_auth"] == 3
    assert "refused unauthenticated KV peer 127.0.0.1" in caplog.text
    with pytest.raises(ValueError):
        KVReceiver(b"", LAYOUT_SWA, sink.on_handoff, sink.on_complete)


async def test_mismatched_header_refused_by_receiver() -> None:
    sink = Sink("req-1")
    other = dataclasses.replace(LAYOUT_SWA, block_size=8)
    exp = make_export(other)
    async with receiver(sink) as r:
        reply = await raw_offer(r.address, make_header(exp, other).encode(), payload_bytes(exp, other))
        assert isinstance(reply, Nack) and reply.code == LAYOUT and "block_size" in reply.reason
    async with receiver(sink, model="mine") as r2:
        reply = await raw_offer(
            r2.address, make_header(make_export(), LAYOUT_SWA, model="other").encode(), None
        )
        assert isinstance(reply, Nack) and reply.code == LAYOUT and "model" in reply.reason
    assert sink.offered == [] and sink.delivered == {}


async def test_mismatched_receiver_refused_by_sender() -> None:
    sink = Sink("req-1")
    async with receiver(sink, dataclasses.replace(LAYOUT_SWA, num_kv_heads=4)) as r:
        with pytest.raises(HandoffError) as e:
            await KVSender(TOKEN, LAYOUT_SWA, config=FAST).send(r.address, make_export())
    assert e.value.code == LAYOUT and "num_kv_heads" in e.value.message
    assert sink.offered == []


async def test_corrupt_payload_refused() -> None:
    sink = Sink("req-1")
    exp = make_export()
    data = bytearray(payload_bytes(exp))
    data[len(data) // 2] ^= 0x10
    async with receiver(sink) as r:
        reply = await raw_offer(r.address, make_header(exp, LAYOUT_SWA).encode(), bytes(data))
    assert isinstance(reply, Nack) and reply.code == CHECKSUM
    assert sink.delivered == {} and [e.code for e in sink.errors] == [CHECKSUM]


async def test_unexpected_request_and_rejected_import() -> None:
    sink = Sink()  # expects nothing
    async with receiver(sink) as r:
        with pytest.raises(HandoffError) as e:
            await KVSender(TOKEN, LAYOUT_SWA, config=FAST).send(r.address, make_export())
        assert e.value.code == UNEXPECTED

    def refuse(header: HandoffHeader, export: SequenceExport) -> None:
        raise MemoryError("no free KV memory")

    sink = Sink("req-1")
    async with KVReceiver(
        TOKEN, LAYOUT_SWA, sink.on_handoff, refuse, on_error=sink.on_error, config=FAST
    ) as r:
        with pytest.raises(HandoffError) as e:
            await KVSender(TOKEN, LAYOUT_SWA, config=FAST).send(r.address, make_export())
    assert e.value.code == REJECTED and "no free KV memory" in e.value.message
    assert [x.code for x in sink.errors] == [REJECTED]


async def test_connection_dropped_mid_payload() -> None:
    sink = Sink("req-1")
    exp = make_export(num_prompt=200)
    data = payload_bytes(exp)
    async with receiver(sink) as r:
        await raw_offer(r.address, make_header(exp, LAYOUT_SWA).encode(), None)  # no payload at all
        await asyncio.wait_for(sink.failed.wait(), 10)
        sink.failed.clear()
        host, port = r.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        ch = Channel(sock, r.address)
        await client_handshake(ch, TOKEN, "half")
        await ch.send(Offer("tcp", make_header(exp, LAYOUT_SWA).encode()))
        await ch.expect(Ready)
        await asyncio.get_running_loop().sock_sendall(sock, data[: len(data) // 2])
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
        )  # RST on close
        sock.close()
        await asyncio.wait_for(sink.failed.wait(), 10)
    assert sink.delivered == {}
    assert [e.code for e in sink.errors] == [INCOMPLETE, INCOMPLETE]
    assert f"of {len(data)} payload bytes" in sink.errors[1].message


KILLED_SENDER = r"""
import asyncio, socket, sys
from transfer.auth import client_handshake
from transfer.messages import Offer, Ready
from transfer.wire import Channel

async def main(port, header_file, payload_file):
    header, payload = open(header_file, "rb").read(), open(payload_file, "rb").read()
    sock = socket.create_connection(("127.0.0.1", port))
    ch = Channel(sock, "r")
    await client_handshake(ch, sys.argv[4].encode(), "doomed")
    await ch.send(Offer("tcp", header))
    await ch.expect(Ready)
    await asyncio.get_running_loop().sock_sendall(sock, payload[: len(payload) // 3])
    print("sent", flush=True)
    await asyncio.sleep(60)

asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
"""


async def test_sender_process_killed_mid_payload(tmp_path: Path) -> None:
    sink = Sink("req-1")
    exp = make_export(num_prompt=200)
    (tmp_path / "h").write_bytes(make_header(exp, LAYOUT_SWA).encode())
    (tmp_path / "p").write_bytes(payload_bytes(exp))
    async with receiver(sink) as r:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", KILLED_SENDER, str(r.port), str(tmp_path / "h"), str(tmp_path / "p"), TOKEN.decode(),
            cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"sent"
        proc.kill()
        await proc.wait()
        await asyncio.wait_for(sink.failed.wait(), 10)
    assert sink.delivered == {} and [e.code for e in sink.errors] == [INCOMPLETE]


async def test_sender_times_out_without_ack() -> None:
    sink = Sink("req-1")
    hang = asyncio.Event()

    async def never(header: HandoffHeader, export: SequenceExport) -> None:
        await hang.wait()

    async with KVReceiver(
        TOKEN, LAYOUT_SWA, sink.on_handoff, never, on_error=sink.on_error, config=FAST
    ) as r:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(HandoffError) as e:
            await KVSender(TOKEN, LAYOUT_SWA, config=FAST).send(r.address, make_export(), timeout_s=1.0)
        assert e.value.code == TIMEOUT
        assert asyncio.get_running_loop().time() - t0 < 5
    # the receiver shut down with the handoff still open: reported, never delivered
    assert [x.code for x in sink.errors] == [TIMEOUT]


async def test_sender_times_out_on_a_silent_listener() -> None:
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        with pytest.raises(HandoffError) as e:
            await KVSender(TOKEN, LAYOUT_SWA, config=FAST).send(
                f"127.0.0.1:{lst.getsockname()[1]}", make_export(), timeout_s=0.5
            )
    assert e.value.code == TIMEOUT


async def test_nothing_listening() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(HandoffError) as e:
        await KVSender(TOKEN, LAYOUT_SWA, config=FAST).send(f"127.0.0.1:{port}", make_export())
    assert e.value.code == "transport"


async def test_stalled_sender_fails_after_the_idle_timeout() -> None:
    sink = Sink("req-1")
    exp = make_export()
    cfg = dataclasses.replace(FAST, idle_timeout_s=0.5)
    async with receiver(sink, config=cfg) as r:
        host, port = r.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        ch = Channel(sock, r.address)
        await client_handshake(ch, TOKEN, "stalls")
        await ch.send(Offer("tcp", make_header(exp, LAYOUT_SWA).encode()))
        await ch.expect(Ready)
        await asyncio.get_running_loop().sock_sendall(
            sock, payload_bytes(exp)[:1000]
        )  # then nothing, connection open
        reply = await asyncio.wait_for(ch.recv(), 10)
        ch.close()
    assert isinstance(reply, Nack) and reply.code == INCOMPLETE and "no payload bytes" in reply.reason
    assert sink.delivered == {} and [e.code for e in sink.errors] == [INCOMPLETE]


# ---- peers that go away (found by tests/pd/api/test_fuzz_requests.py: a P/D pair whose client hung up)


async def test_a_peer_resetting_before_it_authenticates_is_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """A PE that drops a send (its request was aborted) resets the connection, here before it
    authenticates: the receiver logged that as its own failure, a traceback at ERROR. It is the peer's
    doing: one warning line, and the receiver serves on."""
    caplog.set_level(logging.DEBUG, logger="transfer.receiver")
    sink = Sink("req-1")
    async with receiver(sink) as r:
        sock = socket.create_connection(("127.0.0.1", r.port))
        await Channel(sock, r.address).recv()  # the hello; the receiver now waits for the auth
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
        sock.close()
        for _ in range(500):
            if "reset" in caplog.text or r.num_connections == 0:
                break
            await asyncio.sleep(0.01)
        await KVSender(TOKEN, LAYOUT_SWA, config=FAST).send(r.address, make_export())
    assert "req-1" in sink.delivered
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info], caplog.text


async def test_a_send_cancelled_as_it_fails_leaves_no_unread_error(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PE cancels the send of a request its CE aborted, and the CE's refusal ends the send at the
    same moment: Python 3.11's wait_for can lose such a cancellation, the send's inner task then ends
    with the refusal, and nobody read it: asyncio logged "Task exception was never retrieved" and a
    traceback. Here the inner task ignores its cancellation and fails, as it does in that race."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
    started = asyncio.Event()

    async def fails_after_its_cancellation(*args: Any) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # the lost cancellation
        raise HandoffError(UNEXPECTED, "request 'req-1' is not expected here")

    monkeypatch.setattr(sender, "_send", fails_after_its_cancellation)
    task = asyncio.create_task(sender.send("127.0.0.1:1", make_export(), timeout_s=10.0))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    del task
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text, caplog.text
