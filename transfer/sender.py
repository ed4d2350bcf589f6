"""KVSender: the PE rank's end of the handoff.

Connections are kept: one authenticated connection carries one handoff after another (wire.py), so
after the first handoff to a receiver a send pays no TCP connect and no handshake. A connection in use
is not shared (concurrent sends to one receiver open more); a failed handoff closes its connection.

send() returns an Ack only once the receiver has verified the payload and its engine has taken the
sequence; until then the PE must keep the sequence's KV (and, for ipc, the exported tensors: the
receiver reads them in place). Every other outcome raises HandoffError: refused (auth, layout,
unexpected), failed (checksum, incomplete, rejected) or timed out. After a timeout the receiver may
still have taken the sequence (its ack was lost): the coordinator's abort of the request frees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.handoff import Alloc, KVLayout, SequenceExport, TokenLogprob
from pdkernels.checksum import MASK64, fold
from transfer.auth import client_handshake
from transfer.checksum import payload_checksum
from transfer.config import TransferConfig
from transfer.errors import (
    INCOMPLETE,
    LAYOUT,
    MESSAGE_CHARS,
    PROTOCOL,
    STALE,
    TIMEOUT,
    TRANSPORT,
    HandoffError,
    printable,
)
from transfer.header import (
    Buffer,
    HandoffHeader,
    check_layout,
    export_checksum,
    make_header,
    payload_segments,
    peer_layout,
)
from transfer.messages import HandoffAck, Ids, Join, KeepAlive, Offer, Open, Part, Ready, Streams, Sum
from transfer.transport import Transport, make_transport
from transfer.wire import Channel


@dataclass(frozen=True)
class Ack:
    """The receiver's acknowledgement, with where the time of the whole send went: the sender's
    phases (checksum_s .. ack_wait_s, in order, add up to about elapsed_s) and the receiver's."""

    request_id: str
    transport: str
    payload_bytes: int
    elapsed_s: float  # the whole send, checksum included
    checksum_s: float  # the header: the sender's checksum (or reading the export's recorded sums), unless it follows
    recv_s: float  # the receiver's payload phase
    verify_s: float  # the receiver's checksum (0 when hashed on the way in)
    connect_s: float = 0.0  # TCP connect and the auth handshake
    offer_s: float = 0.0  # the transport's offer fields (ipc: handles), the offer; a checksum that follows
    ready_wait_s: float = 0.0  # offer sent to ready received (the receiver's checks and buffers)
    push_s: float = 0.0  # the transport's push (tcp: the payload; ipc: nothing)
    ack_wait_s: float = 0.0  # push done to ack received (ipc: the receiver's copy and checks)
    reused: bool = False  # went over a kept connection (no connect, no handshake)
    receiver_phases: dict[str, float] = field(default_factory=dict)  # the receiver's steps, by name
    # a streamed handoff (KVSender.stream): its pages sent in parts before the final offer, and
    # how long the final offer took to its ack (the rest: elapsed_s covers from the open)
    num_streamed_pages: int = 0
    final_s: float = 0.0

    @property
    def phases(self) -> dict[str, float]:
        """The sender's phases by name, in order."""
        names = ("checksum_s", "connect_s", "offer_s", "ready_wait_s", "push_s", "ack_wait_s")
        return {n.removesuffix("_s"): getattr(self, n) for n in names}


@dataclass(frozen=True)
class PagesPart:
    """Pages [first_page, first_page + len(pages)) of a sequence whose prompt is still being prefilled,
    for KVSender.stream. pages_sum: their checksum sum when the gather computed it (CUDA, as
    SequenceExport.pages_sum); written: a CUDA event recorded after the gather (None on the CPU)."""

    first_page: int
    pages: torch.Tensor
    pages_sum: torch.Tensor | None = None
    written: Any = None


class StreamParts:
    """What a streamed handoff sends (KVSender.stream), in order: PagesParts, then the SequenceExport
    that ends it. put() on the sender's event loop (from another thread: loop.call_soon_threadsafe)."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[PagesPart | SequenceExport] = asyncio.Queue()
        self.ended = asyncio.Event()  # the export is in: the prefill is over

    def put(self, item: PagesPart | SequenceExport) -> None:
        self.items.put_nowait(item)
        if isinstance(item, SequenceExport):
            self.ended.set()


def part_checksum(part: PagesPart) -> int:
    """payload_checksum of the part's pages alone (from the gather's sum when there is one)."""
    nbytes = part.pages.numel() * part.pages.element_size()
    if part.pages_sum is not None:
        return fold([(nbytes, int(part.pages_sum) & MASK64)])
    return payload_checksum([part.pages])


async def _ack_within(inner: asyncio.Future[Ack], timeout: float, late: str) -> Ack:
    """inner's ack, or HandoffError(TIMEOUT, late) once timeout seconds pass (inner is cancelled)."""
    try:
        return await asyncio.wait_for(inner, timeout)
    except asyncio.TimeoutError:
        raise HandoffError(TIMEOUT, late) from None


class _Later:
    """fn(*args) in a worker thread, started on the first start() (a retry on another connection gets
    the same future). Why later: a worker thread started before the offer goes takes the GIL from the
    loop whenever it makes a syscall, and the offer waits (a 16k-token ipc handoff's checksum read
    cost its offer ~0.15 ms on a loaded host)."""

    def __init__(self, executor: Any, fn: Callable[..., int], *args: Any) -> None:
        self._job = executor, fn, args
        self._fut: asyncio.Future[int] | None = None

    def start(self) -> asyncio.Future[int]:
        if self._fut is None:
            executor, fn, args = self._job
            self._fut = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
            self._fut.add_done_callback(_retrieved)
        return self._fut


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Reads a finished future's exception, so that one nobody awaited (a checksum whose send failed
    first, a send's inner task whose caller was cancelled) is not reported as never retrieved."""
    if not fut.cancelled():
        fut.exception()


MAX_IDLE_PER_PEER = 8  # kept connections per receiver address
KEEPALIVE_BEATS = 4  # a streamed handoff waiting for its next part sends a keepalive this often per keepalive_s


@dataclass
class _Conn:
    """An authenticated connection to a receiver, and what that receiver said of itself."""

    ch: Channel
    layout: KVLayout
    model: str
    idle_since: float = 0.0


class _Stale(Exception):
    """A kept connection the receiver had closed (it restarted, or idled it out): not the handoff's
    failure; the send goes again on a fresh connection."""


def split_address(addr: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port)."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a receiver address is host:port, got {addr!r}")
    return host.strip("[]"), int(port)


class KVSender:
    def __init__(
        self,
        token: bytes,
        layout: KVLayout,
        *,
        model: str = "",
        config: TransferConfig | None = None,
        transport: Transport | None = None,
    ) -> None:
        if not token:
            raise ValueError("a KV sender needs the cluster token")
        self.token = token
        self.layout = layout
        self.model = model
        self.config = config or TransferConfig()
        self.transport = transport or make_transport(self.config.transport, self.config)
        self.sender_id = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self._idle: dict[str, list[_Conn]] = {}  # kept connections by receiver address, last used last
        self.counters = {"connects": 0, "reuses": 0, "stale": 0}

    async def send(
        self,
        addr: str,
        export: SequenceExport,
        *,
        output_logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...] | None = None,
        timeout_s: float | None = None,
    ) -> Ack:
        """Hands export to the receiver at addr ("host:port"); returns its Ack or raises HandoffError."""
        t0 = time.perf_counter()
        timeout = self.config.send_timeout_s if timeout_s is None else timeout_s
        if output_logprobs is None:
            output_logprobs = export.output_logprobs
        inner = asyncio.ensure_future(self._send(addr, export, tuple(output_logprobs or ()), t0))
        # NOTE: a send cancelled (its request aborted) as its inner task fails (the receiver refusing
        # that request) can leave the task's error unread: wait_for (Python < 3.12) may lose the
        # cancellation, the task then ends with the error, and nobody awaits it any more
        inner.add_done_callback(_retrieved)
        return await _ack_within(inner, timeout, f"no ack from {addr} for {export.request_id!r} within {timeout:.1f} s")

    async def _send(
        self, addr: str, export: SequenceExport, logprobs: tuple[TokenLogprob, ...], t0: float
    ) -> Ack:
        segments = self.transport.carried(payload_segments(export, self.layout))
        loop = asyncio.get_running_loop()
        checksum: _Later | None = None
        if self.transport.offers_unwritten(segments):  # the offer goes now, the checksum once read
            header = make_header(export, self.layout, self.model, logprobs, checksum_follows=True)
            checksum = _Later(self.transport.executor, export_checksum, export, self.layout)
        elif export.pages_sum is not None and not self.layout.num_swa_layers:
            header = make_header(export, self.layout, self.model, logprobs)  # no hashing left to do
        else:
            header = await loop.run_in_executor(
                self.transport.executor, make_header, export, self.layout, self.model, logprobs
            )
        checksum_s = time.perf_counter() - t0
        stale, bootstrap_again = 0, True
        while True:
            try:
                async with self.transport.session(addr):
                    return await self._handoff(addr, header, segments, t0, checksum_s, checksum)
            except _Stale:
                stale += 1  # each kept connection is tried once, then dropped
                if stale > MAX_IDLE_PER_PEER:
                    raise HandoffError(
                        TRANSPORT, f"the receiver at {addr} keeps closing connections"
                    ) from None
            except HandoffError as e:
                if e.code != STALE or not bootstrap_again:
                    raise
                bootstrap_again = False
                self.transport.forget(addr)  # the receiver lost our communicator: bootstrap again

    async def _handoff(
        self,
        addr: str,
        header: HandoffHeader,
        segments: list[Buffer],
        t0: float,
        checksum_s: float,
        checksum: _Later | None,
    ) -> Ack:
        """One try on one connection; checksum: the payload's, read once the offer has gone, when the
        header says it follows the offer."""
        marks = [time.perf_counter()]  # the end of each phase
        conn, reused = self._kept(addr), True
        if conn is None:
            conn, reused = await self._open(addr), False
        with self._holding(addr, conn):
            _check_receiver(addr, header, conn)
            marks.append(time.perf_counter())
            ch = conn.ch
            extra = await self.transport.offer(ch, segments)
            try:
                await ch.send(Offer(self.transport.name, header.encode(), extra))
                reading = None if checksum is None else checksum.start()  # off the offer's path
                if not header.ids_inline:  # a long prompt's ids follow: packed while the receiver starts
                    await ch.send(Ids(header.ids_bytes()))
                if reading is not None:  # the receiver's copy is under way meanwhile (ipc)
                    await ch.send(Sum(header.request_id, await reading))
                marks.append(time.perf_counter())
                ready = await ch.expect(Ready)
            except (HandoffError, OSError) as e:
                if reused and (isinstance(e, OSError) or e.code == INCOMPLETE):
                    self.counters["stale"] += 1
                    raise _Stale() from None  # it closed the connection without an answer
                raise
            marks.append(time.perf_counter())
            await self.transport.push(ch, segments, ready.fields)
            marks.append(time.perf_counter())
            ack = await ch.expect(HandoffAck)
            marks.append(time.perf_counter())
            if ack.request_id != header.request_id:
                raise HandoffError(
                    PROTOCOL, f"ack for {printable(repr(ack.request_id))}, sent {header.request_id!r}"
                )
        connect_s, offer_s, ready_wait_s, push_s, ack_wait_s = (b - a for a, b in zip(marks, marks[1:]))
        return Ack(
            request_id=header.request_id,
            transport=self.transport.name,
            payload_bytes=header.payload_bytes,
            elapsed_s=marks[-1] - t0,
            checksum_s=checksum_s,
            recv_s=ack.recv_s,
            verify_s=ack.verify_s,
            connect_s=connect_s,
            offer_s=offer_s,
            ready_wait_s=ready_wait_s,
            push_s=push_s,
            ack_wait_s=ack_wait_s,
            reused=reused,
            receiver_phases=ack.phases,
        )

    # ---- a streamed handoff (wire.py: open, parts, then the final offer) -----------------------

    async def stream(
        self,
        addr: str,
        plan: HandoffHeader,
        parts: StreamParts,
        *,
        timeout_s: float | None = None,
        on_part: Callable[[int], None] | None = None,
    ) -> Ack:
        """Hands off a sequence while it is prefilled: opens the handoff with plan (stream_plan()), sends
        each PagesPart taken from parts as it comes (in page order, from plan.first_page on), then the
        SequenceExport that ends them (its first_page: the page after the parts) as an offer of the rest.
        timeout_s (the lease) runs from the export's arrival, the prefill's end, to the ack, parts still
        in flight included; before it the prefill sets the pace and a part that stalls fails after
        idle_timeout_s. on_part(num_pages): told after each part went. Returns the Ack or raises
        HandoffError; cancelling it closes the connection (the receiver drops what it got)."""
        if not self.transport.capabilities.streams:
            raise HandoffError(TRANSPORT, f"transport {self.transport.name!r} does not carry streamed handoffs")
        timeout = self.config.send_timeout_s if timeout_s is None else timeout_s
        inner = asyncio.ensure_future(self._stream(addr, plan, parts, on_part))
        inner.add_done_callback(_retrieved)
        ended = asyncio.ensure_future(parts.ended.wait())
        try:
            await asyncio.wait({inner, ended}, return_when=asyncio.FIRST_COMPLETED)
            late = f"no ack from {addr} for {plan.request_id!r} within {timeout:.1f} s of the prefill's end"
            return await _ack_within(inner, timeout, late)
        finally:
            ended.cancel()
            if not inner.done():
                inner.cancel()

    async def _stream(
        self, addr: str, plan: HandoffHeader, parts: StreamParts, on_part: Callable[[int], None] | None
    ) -> Ack:
        t0 = time.perf_counter()
        conn, opened = await self._open_stream(addr, plan)
        with self._holding(addr, conn):
            ch = conn.ch
            next_page, num_streamed = plan.first_page, 0
            loop = asyncio.get_running_loop()
            while True:
                try:  # NOTE: a chunk may compute longer than the receiver waits for a message: beat
                    item = await asyncio.wait_for(parts.items.get(), self.config.keepalive_s / KEEPALIVE_BEATS)
                except asyncio.TimeoutError:
                    await ch.send(KeepAlive())
                    continue
                if isinstance(item, SequenceExport):
                    break
                n = item.pages.shape[0]
                if item.first_page != next_page:
                    raise HandoffError(PROTOCOL, f"part of page {item.first_page}, page {next_page} is next")
                if item.written is not None:  # NOTE: the copy out reads what the gather wrote
                    torch.cuda.current_stream(item.pages.device).wait_event(item.written)
                checksum = await loop.run_in_executor(self.transport.executor, part_checksum, item)
                if self.transport.writes_parts:  # the bytes land first, the part message says so
                    await self.transport.write_part(ch, item.pages, num_streamed, opened)
                    await ch.send(Part(item.first_page, n, checksum))
                else:
                    extra = await self.transport.offer(ch, [item.pages])
                    await ch.send(Part(item.first_page, n, checksum, extra))
                    await self.transport.push(ch, [item.pages], {})
                next_page += n
                num_streamed += n
                if on_part is not None:
                    on_part(n)
            export = item
            if export.first_page != next_page:
                raise HandoffError(PROTOCOL, f"the final export starts at page {export.first_page}, not {next_page}")
            t_final = time.perf_counter()
            ack = await self._final(conn, export, t0, num_streamed)
        return dataclasses.replace(ack, payload_bytes=plan.payload_bytes, final_s=time.perf_counter() - t_final)

    @contextlib.contextmanager
    def _holding(self, addr: str, conn: _Conn) -> Iterator[None]:
        """One handoff's use of conn: kept for the next handoff if the body completes, closed if it
        raises (an OSError raised as HandoffError(TRANSPORT))."""
        try:
            yield
        except OSError as e:
            conn.ch.close()
            raise HandoffError(TRANSPORT, f"connection to the KV receiver at {addr} failed: {e!r}") from None
        except BaseException:
            conn.ch.close()
            raise
        self._keep(addr, conn)

    async def _open_stream(self, addr: str, plan: HandoffHeader) -> tuple[_Conn, dict[str, Any]]:
        """A connection on which plan's open was taken, and its ready's fields; a kept connection the
        receiver had closed is replaced, as in send()."""
        for _ in range(MAX_IDLE_PER_PEER + 1):
            conn, reused = self._kept(addr), True
            if conn is None:
                conn, reused = await self._open(addr), False
            try:
                _check_receiver(addr, plan, conn)
                await conn.ch.send(Open(self.transport.name, plan.encode()))
                if not plan.ids_inline:
                    await conn.ch.send(Ids(plan.ids_bytes()))
                ready = await conn.ch.expect(Ready)
                return conn, ready.fields
            except (HandoffError, OSError) as e:
                conn.ch.close()
                if reused and (isinstance(e, OSError) or e.code == INCOMPLETE):
                    self.counters["stale"] += 1
                    continue
                if isinstance(e, OSError):
                    raise HandoffError(TRANSPORT, f"connection to the KV receiver at {addr} failed: {e!r}") from None
                raise
            except BaseException:
                conn.ch.close()
                raise
        raise HandoffError(TRANSPORT, f"the receiver at {addr} keeps closing connections")

    async def _final(self, conn: _Conn, export: SequenceExport, t0: float, num_streamed: int) -> Ack:
        """A streamed handoff's final offer (the export: the pages after the parts, the state) to its ack."""
        loop = asyncio.get_running_loop()
        t_sum = time.perf_counter()
        header = await loop.run_in_executor(
            self.transport.executor, make_header, export, self.layout, self.model, tuple(export.output_logprobs)
        )
        segments = self.transport.carried(payload_segments(export, self.layout))
        ch = conn.ch
        marks = [time.perf_counter()]
        extra = await self.transport.offer(ch, segments)
        await ch.send(Offer(self.transport.name, header.encode(), extra))
        if not header.ids_inline:
            await ch.send(Ids(header.ids_bytes()))
        marks.append(time.perf_counter())
        ready = await ch.expect(Ready)
        marks.append(time.perf_counter())
        await self.transport.push(ch, segments, ready.fields)
        marks.append(time.perf_counter())
        ack = await ch.expect(HandoffAck)
        marks.append(time.perf_counter())
        if ack.request_id != header.request_id:
            raise HandoffError(PROTOCOL, f"ack for {printable(repr(ack.request_id))}, sent {header.request_id!r}")
        offer_s, ready_wait_s, push_s, ack_wait_s = (b - a for a, b in zip(marks, marks[1:]))
        return Ack(
            request_id=header.request_id,
            transport=self.transport.name,
            payload_bytes=header.payload_bytes,
            elapsed_s=marks[-1] - t0,
            checksum_s=marks[0] - t_sum,
            recv_s=ack.recv_s,
            verify_s=ack.verify_s,
            offer_s=offer_s,
            ready_wait_s=ready_wait_s,
            push_s=push_s,
            ack_wait_s=ack_wait_s,
            receiver_phases=ack.phases,
            num_streamed_pages=num_streamed,
        )

    def _kept(self, addr: str) -> _Conn | None:
        """The most recently used kept connection to addr that is still good, or None."""
        idle = self._idle.get(addr, [])
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            fresh = now - conn.idle_since < self.config.keepalive_s / 2
            if fresh and conn.ch.loop is loop and conn.ch.is_idle_open():
                self.counters["reuses"] += 1
                return conn
            conn.ch.close()
        return None

    def _keep(self, addr: str, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(addr, [])
        idle.append(conn)
        while len(idle) > MAX_IDLE_PER_PEER:
            idle.pop(0).ch.close()

    async def _open(self, addr: str) -> _Conn:
        """A new connection to addr, authenticated (both ways) and told the receiver's engine, with
        the transport's data connections joined to it (each authenticated alike)."""
        ch = await self._connect(addr)
        try:
            ok = await client_handshake(ch, self.token, self.sender_id)
            conn = _Conn(ch, peer_layout(ok.layout), ok.model)
            count = self.transport.num_data_connections
            if count:
                key = secrets.token_bytes(16)
                joins = [asyncio.ensure_future(self._join(addr, key, i)) for i in range(count)]
                try:
                    await asyncio.gather(*joins)
                finally:  # NOTE: ch.close() closes those that joined, whatever happened to the rest
                    ch.data = [j.result() for j in joins if j.done() and not j.cancelled() and not j.exception()]
                    for j in joins:
                        j.cancel()
                        j.add_done_callback(_retrieved)
                await ch.send(Streams(key, count))
        except BaseException:
            ch.close()
            raise
        self.counters["connects"] += 1
        return conn

    async def _join(self, addr: str, key: bytes, index: int) -> Channel:
        """A data connection: connected, authenticated, joined to the control connection of key."""
        ch = await self._connect(addr)
        try:
            await client_handshake(ch, self.token, self.sender_id)
            await ch.send(Join(key, index))
        except BaseException:
            ch.close()
            raise
        return ch

    async def _connect(self, addr: str) -> Channel:
        host, port = split_address(addr)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, kind, proto, _, sockaddr = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, sockaddr), self.config.connect_timeout_s)
            except BaseException:
                sock.close()
                raise
        except (OSError, asyncio.TimeoutError) as e:
            raise HandoffError(TRANSPORT, f"cannot connect to the KV receiver at {addr}: {e!r}") from None
        return Channel(sock, addr)

    @property
    def export_allocator(
        self,
    ) -> Alloc | None:
        """Where exports for this sender's transport should be gathered (engine.export_sequence's
        alloc): the ipc transport's exported arena, nixl's registered one; None for the others (new
        memory)."""
        return self.transport.export_allocator()

    @property
    def exports_pages_in_place(self) -> bool:
        """Whether exports for this sender's transport should leave their pages in the KV pool
        (engine.export_sequence(pages_in_place=True)): ipc, which reads them there."""
        return self.transport.reads_pool_pages()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.ch.close()
        self._idle.clear()
        self.transport.close()


def _check_receiver(addr: str, header: HandoffHeader, conn: _Conn) -> None:
    """Raises HandoffError(LAYOUT) if the receiver on conn serves another engine than header's."""
    try:
        check_layout(header, conn.layout, conn.model)
    except HandoffError as e:
        theirs = printable(e.message, MESSAGE_CHARS)  # quotes the receiver's model name
        raise HandoffError(LAYOUT, f"the receiver at {addr} serves another engine: {theirs}") from None
