"""TCP transport: the payload streams on the control connection itself, right after ready, or striped
over it and its data connections (--kv-tcp-streams N > 1: N sockets, each authenticated, wire.py).

Striping cuts the payload (its segments end to end) into N contiguous runs, one per socket, moved at
once by N threads; each run is cut into pieces of at most chunk_bytes (stripe()):

    payload   | pages ...................................................... | state |
    N = 3     | socket 0 (control) ...| socket 1 ............| socket 2 .............. |
              ^ 0                     ^ ~total/3 rounded up   ^ ~2*total/3 rounded up  ^ total

A run starts at a checksum chunk of its segment (CHUNK_BYTES, rounded up), so each thread hashes its
own pieces; the runs depend only on the segments' sizes and N, so both ends cut alike whatever their
chunk_bytes. N = 1 is one run on the control connection: the bytes of a single stream, in order.

Host tensors are sent from and received into their own memory (no copy in Python). CUDA tensors go
through two pinned staging buffers of chunk_bytes per socket, ping-ponged so that the device copy of
one chunk overlaps the socket I/O of the other:

    send:  D2H(chunk i+1) -> buf[(i+1)%2]   ||  sendall(buf[i%2])      (event-gated, no device sync)
    recv:  recv_into(buf[i%2])              ||  H2D(buf[(i-1)%2]) -> chunk i-1

A host receiver hashes each chunk in a second thread while the next one arrives (the chunk is still in
cache), so the checksum is ready about when the last byte is; a CUDA receiver leaves hashing to the
receiver, on the GPU.
"""

from __future__ import annotations

import math
import socket
import threading
from bisect import bisect_right
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, TypeVar

import torch

from pdkernels.checksum import CHUNK_BYTES, MASK64, as_words, fold
from transfer.checksum import segment_sum
from transfer.config import MAX_TCP_STREAMS, TransferConfig
from transfer.errors import INCOMPLETE, TRANSPORT, HandoffError
from transfer.header import Buffer, HandoffHeader, dense
from transfer.transport import Transport
from transfer.transports import TRANSPORTS
from transfer.wire import Channel, blocking_recv_into, blocking_send

# Hashing of received chunks, off the receiving threads (its own pool: a receiving thread waits on it).
_HASH_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-hash")
T = TypeVar("T")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ValueError("payload tensors must be contiguous")
    return t.reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class Piece:
    """Bytes of one segment that one send/recv call moves."""

    segment: int  # the segment's index in the payload
    offset: int  # bytes into the segment: a checksum chunk boundary
    data: torch.Tensor  # uint8 view of the segment's bytes [offset, offset + len)


def stripe(segments: list[torch.Tensor], num_streams: int, chunk_bytes: int) -> list[list[Piece]]:
    """The payload in num_streams contiguous runs of pieces (the module's drawing); a run may be empty."""
    views = [byte_view(t) for t in segments]
    sizes = [v.numel() for v in views]
    starts = list(accumulate(sizes, initial=0))  # where each segment starts in the payload
    total = starts[-1]

    def snap(pos: int) -> int:  # pos rounded up to a checksum chunk of its segment (or its end)
        i = bisect_right(starts, pos) - 1
        if i >= len(sizes):
            return total
        off = pos - starts[i]
        return starts[i] + min(sizes[i], -(-off // CHUNK_BYTES) * CHUNK_BYTES)

    bounds = [0, *(snap(k * total // num_streams) for k in range(1, num_streams)), total]
    runs: list[list[Piece]] = []
    for lo, hi in zip(bounds, bounds[1:]):
        run = []
        for i, v in enumerate(views):
            a, b = max(lo, starts[i]) - starts[i], min(hi, starts[i + 1]) - starts[i]
            run += [Piece(i, off, v[off : min(off + chunk_bytes, b)]) for off in range(a, b, chunk_bytes)]
        runs.append(run)
    return runs


class _Staging:
    """Pairs of pinned host buffers, reused across handoffs (pinning is slow; buffers are few)."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._free: list[list[torch.Tensor]] = []
        self._lock = threading.Lock()

    def take(self) -> list[torch.Tensor]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def give(self, pair: list[torch.Tensor]) -> None:
        with self._lock:
            self._free.append(pair)


class TcpTransport(Transport):
    name = "tcp"
    capabilities = TRANSPORTS[name].capabilities

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._staging = _Staging(config.chunk_bytes)
        # the threads of striped payloads: one per socket of a payload in flight (made on demand)
        self._stream_pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def num_data_connections(self) -> int:
        return self.config.tcp_streams - 1

    # ---- sender --------------------------------------------------------------------------------

    def _num_streams(self, ch: Channel, segments: list[torch.Tensor]) -> int:
        """The sockets this payload goes over: all of ch's, but no more than it has checksum chunks
        (a run gets at least one)."""
        nbytes = sum(t.numel() * t.element_size() for t in segments)
        return max(1, min(len(ch.data) + 1, math.ceil(nbytes / CHUNK_BYTES)))

    async def offer(self, ch: Channel, segments: list[Buffer]) -> dict[str, Any]:
        n = self._num_streams(ch, dense(segments, self.name))
        return {"streams": n} if n > 1 else {}  # NOTE: none for one stream: the protocol's offer as before

    async def push(self, ch: Channel, buffers: list[Buffer], ready: dict[str, Any]) -> None:
        segments = dense(buffers, self.name)
        runs = stripe(segments, self._num_streams(ch, segments), self.config.chunk_bytes)
        socks = [ch.sock] + [d.sock for d in ch.data[: len(runs) - 1]]
        if any(t.is_cuda for t in segments):
            device = next(t.device for t in segments if t.is_cuda)
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(device))  # NOTE: the export's producer stream
            send: Callable[[int], None] = lambda k: self._send_device(socks[k], runs[k], produced)  # noqa: E731
        else:
            send = lambda k: self._send_host(socks[k], runs[k])  # noqa: E731
        await ch.run_blocking(self.executor, self._each_stream, socks, send)

    def _send_host(self, sock: socket.socket, pieces: list[Piece]) -> None:
        for piece in pieces:
            blocking_send(sock, piece.data.numpy().data, self.config.idle_timeout_s)

    def _send_device(self, sock: socket.socket, pieces: list[Piece], produced: Any) -> None:
        if not pieces:
            return
        stream = torch.cuda.Stream(pieces[0].data.device)
        stream.wait_event(produced)
        bufs = self._staging.take()
        events = [torch.cuda.Event(), torch.cuda.Event()]

        def stage(i: int) -> None:
            with torch.cuda.stream(stream):
                bufs[i % 2][: pieces[i].data.numel()].copy_(pieces[i].data, non_blocking=True)
                events[i % 2].record(stream)

        try:
            stage(0)
            for i, piece in enumerate(pieces):
                if i + 1 < len(pieces):
                    stage(i + 1)  # its buffer was last sent from at step i-1, which has returned
                events[i % 2].synchronize()
                blocking_send(sock, bufs[i % 2][: piece.data.numel()].numpy().data, self.config.idle_timeout_s)
        finally:
            for e in events:
                e.synchronize()
            self._staging.give(bufs)

    # ---- receiver ------------------------------------------------------------------------------

    async def accept(
        self, ch: Channel, header: HandoffHeader, extra: dict[str, Any], buffers: list[Buffer]
    ) -> dict[str, Any]:
        dense(buffers, "tcp")  # receives into memory of its own only
        n = extra.get("streams", 1)
        if set(extra) - {"streams"} or type(n) is not int or not 1 <= n <= min(len(ch.data) + 1, MAX_TCP_STREAMS):
            raise HandoffError(
                TRANSPORT, f"tcp offer {sorted(extra)} asks for streams this connection has not"
                f" ({len(ch.data) + 1} sockets)",
            )
        return {}

    async def pull(
        self,
        ch: Channel,
        header: HandoffHeader,
        extra: dict[str, Any],
        buffers: list[Buffer],
        *,
        phases: dict[str, float] | None = None,
    ) -> int | None:
        segments = dense(buffers, "tcp")
        runs = stripe(segments, extra.get("streams", 1), self.config.chunk_bytes)
        socks = [ch.sock] + [d.sock for d in ch.data[: len(runs) - 1]]
        if any(t.is_cuda for t in segments):
            await ch.run_blocking(
                self.executor,
                self._each_stream,
                socks,
                lambda k: self._recv_device(socks[k], runs[k], k, len(runs)),
                socket.SHUT_RD,
            )
            return None
        sums = await ch.run_blocking(
            self.executor,
            self._each_stream,
            socks,
            lambda k: self._recv_host(socks[k], runs[k], len(segments), k, len(runs)),
            socket.SHUT_RD,
        )
        sizes = [t.numel() * t.element_size() for t in segments]
        return fold([(n, sum(per_stream[i] for per_stream in sums) & MASK64) for i, n in enumerate(sizes)])

    def _recv_host(self, sock: socket.socket, pieces: list[Piece], num_segments: int, k: int, n: int) -> list[int]:
        """Receives piece i+1 while another thread hashes piece i; returns the run's sum per segment."""
        sums = [0] * num_segments
        done, total = 0, sum(p.data.numel() for p in pieces)
        pending: Future[None] | None = None

        def hash_piece(p: Piece) -> None:
            sums[p.segment] += segment_sum(as_words(p.data), p.offset // CHUNK_BYTES)

        try:
            for piece in pieces:
                _recv(sock, piece.data, self.config.idle_timeout_s, done, total, k, n)
                done += piece.data.numel()
                if pending is not None:
                    pending.result()
                pending = _HASH_POOL.submit(hash_piece, piece)
            if pending is not None:
                pending.result()
        finally:
            if pending is not None:
                wait([pending])
        return sums

    def _recv_device(self, sock: socket.socket, pieces: list[Piece], k: int, n: int) -> None:
        if not pieces:
            return
        total = sum(p.data.numel() for p in pieces)
        device = pieces[0].data.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the buffers' allocation
        bufs = self._staging.take()
        events = [torch.cuda.Event(), torch.cuda.Event()]
        done = 0
        try:
            for i, piece in enumerate(pieces):
                buf = bufs[i % 2][: piece.data.numel()]
                if i >= 2:
                    events[i % 2].synchronize()  # the H2D copy out of this buffer is done
                _recv(sock, buf, self.config.idle_timeout_s, done, total, k, n)
                done += piece.data.numel()
                with torch.cuda.stream(stream):
                    piece.data.copy_(buf, non_blocking=True)
                    events[i % 2].record(stream)
        finally:
            for e in events:
                e.synchronize()
            self._staging.give(bufs)

    # ---- striping ------------------------------------------------------------------------------

    def _each_stream(
        self, socks: list[socket.socket], fn: Callable[[int], T], how: int = socket.SHUT_RDWR
    ) -> list[T]:
        """[fn(k) for each socket k], all at once (one socket: on this thread). The first failure
        shuts every socket down (how: a receiver keeps writing, for its nack), so the other threads
        return at once rather than after the idle timeout; it is raised once all have returned (no
        thread outlives the payload)."""
        if len(socks) == 1:
            return [fn(0)]
        pool = self._pool()
        futs = [pool.submit(fn, k) for k in range(len(socks))]
        done, _ = wait(futs, return_when=FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if failed:
            for sock in socks:
                with suppress(OSError):
                    sock.shutdown(how)
            wait(futs)
            raise failed[0].exception()  # type: ignore[misc]
        return [f.result() for f in futs]

    def _pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._stream_pool is None:
                self._stream_pool = ThreadPoolExecutor(
                    max_workers=MAX_TCP_STREAMS * self.config.max_workers, thread_name_prefix="kv-stream"
                )
            return self._stream_pool

    def close(self) -> None:
        with self._pool_lock:
            if self._stream_pool is not None:
                self._stream_pool.shutdown(wait=False)
                self._stream_pool = None


def _recv(
    sock: socket.socket, piece: torch.Tensor, idle_timeout_s: float, done: int, total: int, k: int, n: int
) -> None:
    try:
        blocking_recv_into(sock, piece.numpy().data, idle_timeout_s)
    except HandoffError as e:
        where = f"had {done} of {total} payload bytes" + (f" on stream {k} of {n}" if n > 1 else "")
        raise HandoffError(INCOMPLETE, f"{e.message} ({where})") from None
