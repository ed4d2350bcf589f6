"""TCP transport: the payload streams on the control connection itself, right after ready.

Host tensors are sent from and received into their own memory (no copy in Python). CUDA tensors go
through two pinned staging buffers of chunk_bytes, ping-ponged so that the device copy of one chunk
overlaps the socket I/O of the other:

    send:  D2H(chunk i+1) -> buf[(i+1)%2]   ||  sendall(buf[i%2])      (event-gated, no device sync)
    recv:  recv_into(buf[i%2])              ||  H2D(buf[(i-1)%2]) -> chunk i-1

A host receiver hashes each chunk in a second thread while the next one arrives (the chunk is still in
cache), so the checksum is ready about when the last byte is; a CUDA receiver leaves hashing to the
receiver, on the GPU.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from pdkernels.checksum import fold
from transfer.checksum import SegmentHasher
from transfer.config import TransferConfig
from transfer.errors import INCOMPLETE, HandoffError
from transfer.handoff import HandoffHeader
from transfer.transport import Transport
from transfer.wire import Channel, blocking_recv_into, blocking_send

# Hashing of received chunks, off the receiving thread (its own pool: a receiving thread waits on it).
_HASH_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-hash")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ValueError("payload tensors must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def _pieces(segments: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
    out = []
    for t in segments:
        b = byte_view(t)
        out += [b[off : off + chunk] for off in range(0, b.numel(), chunk)]
    return out


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

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._staging = _Staging(config.chunk_bytes)

    # ---- sender --------------------------------------------------------------------------------

    async def push(self, ch: Channel, segments: list[torch.Tensor], ready: dict[str, Any]) -> None:
        if any(t.is_cuda for t in segments):
            device = next(t.device for t in segments if t.is_cuda)
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(device))  # NOTE: the export's producer stream
            await ch.run_blocking(self.executor, self._send_device, ch.sock, segments, produced)
        else:
            await ch.run_blocking(self.executor, self._send_host, ch.sock, segments)

    def _send_host(self, sock: socket.socket, segments: list[torch.Tensor]) -> None:
        for piece in _pieces(segments, self.config.chunk_bytes):
            blocking_send(sock, piece.numpy().data, self.config.idle_timeout_s)

    def _send_device(self, sock: socket.socket, segments: list[torch.Tensor], produced: Any) -> None:
        pieces = _pieces(segments, self.config.chunk_bytes)
        if not pieces:
            return
        stream = torch.cuda.Stream(pieces[0].device)
        stream.wait_event(produced)
        bufs = self._staging.take()
        events = [torch.cuda.Event(), torch.cuda.Event()]

        def stage(i: int) -> None:
            with torch.cuda.stream(stream):
                bufs[i % 2][: pieces[i].numel()].copy_(pieces[i], non_blocking=True)
                events[i % 2].record(stream)

        try:
            stage(0)
            for i, piece in enumerate(pieces):
                if i + 1 < len(pieces):
                    stage(i + 1)  # its buffer was last sent from at step i-1, which has returned
                events[i % 2].synchronize()
                blocking_send(sock, bufs[i % 2][: piece.numel()].numpy().data, self.config.idle_timeout_s)
        finally:
            for e in events:
                e.synchronize()
            self._staging.give(bufs)

    # ---- receiver ------------------------------------------------------------------------------

    async def pull(
        self,
        ch: Channel,
        header: HandoffHeader,
        extra: dict[str, Any],
        segments: list[torch.Tensor],
        *,
        phases: dict[str, float] | None = None,
    ) -> int | None:
        if any(t.is_cuda for t in segments):
            await ch.run_blocking(self.executor, self._recv_device, ch.sock, segments)
            return None
        return await ch.run_blocking(self.executor, self._recv_host, ch.sock, segments)

    def _recv_host(self, sock: socket.socket, segments: list[torch.Tensor]) -> int:
        """Receives chunk i+1 while another thread hashes chunk i (in order, one hasher per segment)."""
        hashers = [SegmentHasher(t.numel() * t.element_size()) for t in segments]
        done, total = 0, sum(h.nbytes for h in hashers)
        pending: Future[None] | None = None
        try:
            for t, hasher in zip(segments, hashers):
                b = byte_view(t)
                for off in range(0, b.numel(), self.config.chunk_bytes):
                    piece = b[off : off + self.config.chunk_bytes]
                    _recv(sock, piece, self.config.idle_timeout_s, done, total)
                    done += piece.numel()
                    if pending is not None:
                        pending.result()
                    pending = _HASH_POOL.submit(hasher.update, piece)
            if pending is not None:
                pending.result()
        finally:
            if pending is not None:
                wait([pending])
        return fold([h.result() for h in hashers])

    def _recv_device(self, sock: socket.socket, segments: list[torch.Tensor]) -> None:
        pieces = _pieces(segments, self.config.chunk_bytes)
        total = sum(p.numel() for p in pieces)
        stream = torch.cuda.Stream(pieces[0].device)
        stream.wait_stream(torch.cuda.current_stream(pieces[0].device))  # the buffers' allocation
        bufs = self._staging.take()
        events = [torch.cuda.Event(), torch.cuda.Event()]
        done = 0
        try:
            for i, piece in enumerate(pieces):
                buf = bufs[i % 2][: piece.numel()]
                if i >= 2:
                    events[i % 2].synchronize()  # the H2D copy out of this buffer is done
                _recv(sock, buf, self.config.idle_timeout_s, done, total)
                done += piece.numel()
                with torch.cuda.stream(stream):
                    piece.copy_(buf, non_blocking=True)
                    events[i % 2].record(stream)
        finally:
            for e in events:
                e.synchronize()
            self._staging.give(bufs)


def _recv(sock: socket.socket, piece: torch.Tensor, idle_timeout_s: float, done: int, total: int) -> None:
    try:
        blocking_recv_into(sock, piece.numpy().data, idle_timeout_s)
    except HandoffError as e:
        raise HandoffError(INCOMPLETE, f"{e.message} (had {done} of {total} payload bytes)") from None
