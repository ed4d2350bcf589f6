"""The control connection: length-prefixed msgpack messages on a TCP socket, plus the two helpers
that move bulk bytes on the same socket from a worker thread.

Frame: 4-byte big-endian length, then a msgpack map: {"t": TYPE, **to_wire(msg)} for one of the typed
control messages of transfer/messages.py (Channel.send / Channel.expect). Before authentication a
frame may be at most MAX_PREAUTH_BYTES, so an unauthenticated peer cannot make us buffer much.

Message flow (S: KVSender, R: KVReceiver). A connection is authenticated once, then carries one
handoff after another; a nack or any failure closes it (both sides), as does R after
TransferConfig.keepalive_s without an offer, or S when it is done with the peer:

    R -> S  hello    Hello {v, nonce}                             (auth.py)
    S -> R  auth     Auth {v, sender, nonce, mac}
    R -> S  auth_ok  AuthOk {mac, model, layout}   | nack {code: auth}; R logs and closes
  only with --kv-tcp-streams N > 1 (the connection then stripes tcp payloads over N sockets): S opens
  N-1 more connections, each authenticated as above, and binds them to this one by a random key:
    S -> R  join     Join {key, index}     (first message on each data connection; nothing follows)
    S -> R  streams  Streams {key, count}  (first message here after auth_ok, once the joins are sent)
  per handoff:
    S -> R  offer    Offer {transport, header, extra} (S first checks R's model/layout itself)
    S -> R  ids      Ids {ids}  (only when the header announces a long prompt's ids: handoff.py)
    S -> R  sum      Sum {request_id, checksum}  (only when the header says its checksum follows)
    R -> S  ready    Ready {fields}                 | nack {code, reason}
    S => R  payload  (tcp: raw bytes on this socket and its data connections; nccl: a NCCL send;
                      ipc: handles in the offer; nixl: a one-sided write into the buffers that ready names)
    S -> R  written  Written {payload_bytes}  (only nixl: its write has completed)
    R -> S  ack      HandoffAck {request_id, payload_bytes, recv_s, verify_s, phases} | nack {code, reason}
  a streamed handoff (--kv-stream, tcp; the sender's prefill is still running) instead:
    S -> R  open     Open {transport, header}  (the header as far as known: transfer.handoff.stream_plan)
    S -> R  ids      (as after an offer)
    R -> S  ready    Ready {}  (buffers for the whole payload)  | nack {code, reason}
    S -> R  part     Part {first_page, num_pages, checksum, extra}, then that part's payload bytes:
                     as often as chunks of the prefill complete pages, in page order
    S -> R  keepalive  KeepAlive {}  (between parts, every keepalive_s / 4 without one: R waits up to
                     keepalive_s for each message of a stream)
    S -> R  offer    the final one: the handoff's header, for the pages after the parts; then ids, ready,
                     the rest of the payload (those pages and the SWA state) and ack, as above

Protocol version 2: every message decodes strictly; ready carries the transport's fields as a map.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import suppress
from typing import Any, TypeVar

import msgpack

from engine.handoff import WireError, from_wire, to_wire
from transfer.errors import CODES, INCOMPLETE, MESSAGE_CHARS, PROTOCOL, VERSION, HandoffError, printable
from transfer.messages import TYPES, ControlMessage, Nack

PROTOCOL_VERSION = 2
MAX_PREAUTH_BYTES = 4096
MAX_CONTROL_BYTES = 64 << 20
_LEN = struct.Struct(">I")
T = TypeVar("T")
M = TypeVar("M", bound=ControlMessage)


_EXECUTOR: ThreadPoolExecutor | None = None


def io_executor(max_workers: int = 8) -> ThreadPoolExecutor:
    """The process's threads for blocking payload work (socket I/O, checksums, CUDA/NCCL waits).
    Made on first use; the first caller's max_workers sizes it."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-io")
    return _EXECUTOR


def pack(msg: ControlMessage) -> bytes:
    """One frame: the length, then {"t": TYPE, **to_wire(msg)}."""
    body = msgpack.packb({"t": msg.TYPE, **to_wire(msg)}, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def unpack(body: dict[str, Any], peer: str) -> ControlMessage:
    """The message a frame's map holds; raises HandoffError (PROTOCOL; VERSION for a hello or auth
    of another protocol version, which is refused before its fields are read: they may differ)."""
    kind = body.pop("t")
    cls = TYPES.get(kind)
    if cls is None:
        raise HandoffError(PROTOCOL, f"unknown control message {kind!r} from {peer}")
    if "v" in cls.__dataclass_fields__ and body.get("v") != PROTOCOL_VERSION:
        raise HandoffError(
            VERSION, f"{peer} speaks protocol version {body.get('v')!r}, this side {PROTOCOL_VERSION}"
        )
    try:
        return from_wire(cls, body)
    except WireError as e:
        raise HandoffError(PROTOCOL, f"malformed {kind} from {peer}: {e}") from None


class Channel:
    """A connected TCP socket spoken to in messages (asyncio) and, between messages, in raw bytes
    from a worker thread (run_blocking)."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer
        self.max_frame_bytes = MAX_PREAUTH_BYTES
        self._loop = asyncio.get_running_loop()
        # the data connections joined to this control connection (tcp striping); shut down and
        # closed with it
        self.data: list[Channel] = []

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this channel's socket is used from."""
        return self._loop

    async def send(self, msg: ControlMessage) -> None:
        await self._loop.sock_sendall(self.sock, pack(msg))

    async def recv(self) -> ControlMessage:
        """The next message, whatever its type; raises HandoffError if it is not a well-formed one."""
        return await self._recv(await self._read_exactly(_LEN.size))

    async def recv_or_eof(self) -> ControlMessage | None:
        """The next message, or None if the peer closed the connection between messages."""
        first = await self._loop.sock_recv(self.sock, 1)
        if not first:
            return None
        return await self._recv(first + await self._read_exactly(_LEN.size - 1))

    async def expect(self, cls: type[M]) -> M:
        """The next message, which must be a cls; a nack becomes the HandoffError it carries."""
        return self.expected(await self.recv(), cls)

    async def expect_or_eof(self, cls: type[M]) -> M | None:
        """expect(cls), or None if the peer closed the connection between messages."""
        msg = await self.recv_or_eof()
        return None if msg is None else self.expected(msg, cls)

    def expected(self, msg: ControlMessage, cls: type[M]) -> M:
        """msg if it is a cls; a nack becomes the HandoffError it carries, anything else PROTOCOL."""
        if isinstance(msg, cls):
            return msg
        if isinstance(msg, Nack):  # the peer's text, escaped; a code this side does not know is PROTOCOL
            if msg.code in CODES:
                raise HandoffError(msg.code, printable(msg.reason, MESSAGE_CHARS))
            raise HandoffError(PROTOCOL, printable(f"{msg.code}: {msg.reason}", MESSAGE_CHARS))
        raise HandoffError(PROTOCOL, f"expected {cls.TYPE} from {self.peer}, got {msg.TYPE!r}")

    def is_idle_open(self) -> bool:
        """Whether the peer has neither closed the connection (nor one of its data connections) nor
        sent anything (checked without waiting): a kept connection is reused only then."""
        if not all(d.is_idle_open() for d in self.data):
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # b"": closed; anything else: a message nobody asked for

    async def _recv(self, prefix: bytes) -> ControlMessage:
        (n,) = _LEN.unpack(prefix)
        if n > self.max_frame_bytes:
            raise HandoffError(
                PROTOCOL, f"control message of {n} bytes from {self.peer} (limit {self.max_frame_bytes})"
            )
        body = await self._read_exactly(n)
        try:
            msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:
            raise HandoffError(PROTOCOL, f"undecodable control message from {self.peer}: {e}") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
            raise HandoffError(PROTOCOL, f"control message without a type from {self.peer}")
        return unpack(msg, self.peer)

    async def nack(self, err: HandoffError) -> None:
        """Best effort: the peer may already be gone."""
        with suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(self.send(Nack(err.code, err.message)), 5.0)

    async def _read_exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = await self._loop.sock_recv_into(self.sock, view[got:])
            if k == 0:
                raise HandoffError(INCOMPLETE, f"{self.peer} closed the connection")
            got += k
        return bytes(buf)

    async def run_blocking(self, executor: Executor | None, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker thread that may use self.sock with blocking calls.

        NOTE: while it runs, nothing else touches the socket. If the caller is cancelled (a timeout),
        the socket is shut down so the thread's blocked send/recv returns, and the thread is waited
        for before the cancellation goes on: the socket is never closed under a running thread.
        """
        fut = self._loop.run_in_executor(executor, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.shutdown()
            fut.add_done_callback(_read_exception)  # what the thread raises then (a broken pipe) is moot
            with suppress(BaseException):
                await asyncio.wait([fut], timeout=10.0)
            raise

    def shutdown(self) -> None:
        for d in self.data:
            d.shutdown()
        with suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        for d in self.data:
            d.sock.close()
        self.sock.close()


def _read_exception(fut: asyncio.Future[Any]) -> None:
    """Marks fut's exception as read (asyncio logs "Future exception was never retrieved" otherwise)."""
    if not fut.cancelled():
        fut.exception()


class _Blocking:
    """The socket in plain blocking mode for a worker thread, with kernel send/recv timeouts
    (SO_SNDTIMEO / SO_RCVTIMEO) as the idle limit: sendall and MSG_WAITALL then loop in the kernel
    and C, not in Python. Restores non-blocking mode (what asyncio needs) on exit."""

    def __init__(self, sock: socket.socket, idle_timeout_s: float) -> None:
        self.sock = sock
        sec = int(idle_timeout_s)
        self.timeval = struct.pack("ll", sec, int((idle_timeout_s - sec) * 1e6))

    def __enter__(self) -> socket.socket:
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, self.timeval)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self.timeval)
        return self.sock

    def __exit__(self, *exc: object) -> None:
        with suppress(OSError):
            zero = struct.pack("ll", 0, 0)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, zero)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, zero)
            self.sock.settimeout(0.0)


def _is_timeout(e: OSError) -> bool:
    return isinstance(e, (TimeoutError, BlockingIOError)) or e.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


def blocking_send(sock: socket.socket, data: memoryview, idle_timeout_s: float) -> None:
    """sendall from a worker thread; idle_timeout_s bounds each wait for the peer to take bytes."""
    try:
        with _Blocking(sock, idle_timeout_s) as s:
            s.sendall(data)
    except OSError as e:
        if _is_timeout(e):
            raise HandoffError(INCOMPLETE, f"the peer took no bytes for {idle_timeout_s:.0f} s") from None
        raise HandoffError(INCOMPLETE, f"connection lost while sending the payload: {e}") from None


def blocking_recv_into(sock: socket.socket, data: memoryview, idle_timeout_s: float) -> None:
    """Fills data from the socket (worker thread); EOF or an idle peer before the end is INCOMPLETE."""
    got, n = 0, len(data)
    try:
        with _Blocking(sock, idle_timeout_s) as s:
            while got < n:
                k = s.recv_into(data[got:], n - got, socket.MSG_WAITALL)
                if k == 0:
                    raise HandoffError(INCOMPLETE, "the sender closed the connection mid-payload")
                got += k
    except OSError as e:
        if _is_timeout(e):
            raise HandoffError(INCOMPLETE, f"no payload bytes for {idle_timeout_s:.0f} s") from None
        raise HandoffError(INCOMPLETE, f"connection lost while receiving the payload: {e}") from None
