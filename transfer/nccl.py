"""NCCL transport: GPU to GPU between hosts through cupy.cuda.nccl; the header still goes over TCP.

One two-rank communicator per (sender, receiver) pair, created on the first handoff between them:
the sender (rank 0) draws an NCCL unique id and sends it with its offer, under a fresh communicator
key; after ready both sides call ncclCommInitRank (it blocks until both have), then send/recv.
Later handoffs name the key only. A receiver that does not know the key (it restarted) answers
STALE and the sender bootstraps again.

    S: offer {comm, uid?} ──► R: ready ──► S: init(uid, 0); send(pages, state) ─┐
                                           R: init(uid, 1); recv(pages, state) ─┴─► R: verify, ack

NOTE: NCCL point-to-point ops on one communicator must be issued in the same order on both ends, so
a sender runs one handoff at a time per receiver (session()), and a receiver one per communicator.

Everything that touches NCCL or CUDA sits behind NcclBackend, so the bootstrap, framing and ordering
run in CPU tests with a fake backend; cupy is imported only when the real backend is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from transfer.config import TransferConfig
from transfer.errors import STALE, TIMEOUT, TRANSPORT, HandoffError
from transfer.header import Buffer, HandoffHeader, dense
from transfer.transport import Transport
from transfer.transports import TRANSPORTS
from transfer.wire import Channel

MAX_COMMS = 64  # receiver: communicators kept; the least recently used beyond this are aborted
POLL_S = 0.0005


class Work(Protocol):
    def done(self) -> bool: ...


class NcclBackend(Protocol):
    """The seam between the transport's protocol logic and NCCL itself."""

    def version(self) -> str: ...

    def unique_id(self) -> bytes: ...

    def init(self, uid: bytes, rank: int, device: torch.device) -> Any:
        """A 2-rank communicator on device; blocks until the other rank has joined."""

    def send(self, comm: Any, tensors: list[torch.Tensor], peer: int) -> Work:
        """Queues the tensors' bytes to peer, after the work already queued on the current stream."""

    def recv(self, comm: Any, tensors: list[torch.Tensor], peer: int) -> Work: ...

    def abort(self, comm: Any) -> None: ...

    def can_carry(self, t: torch.Tensor) -> bool:
        """Whether a tensor can be sent or received from where it is (real NCCL: CUDA memory)."""


@dataclass
class _CupyComm:
    comm: Any
    stream: Any  # torch.cuda.Stream the communicator's ops run on
    device: torch.device


class _EventWork:
    def __init__(self, comm: _CupyComm) -> None:
        self.comm = comm
        self.event = torch.cuda.Event()
        self.event.record(comm.stream)

    def done(self) -> bool:
        self.comm.comm.check_async_error()  # raises if NCCL failed (peer gone, network error)
        return bool(self.event.query())


class CupyNccl:
    """The real backend: cupy.cuda.nccl (the `cuda` extra)."""

    def __init__(self) -> None:
        try:
            from cupy.cuda import nccl
        except ImportError as e:
            raise HandoffError(
                TRANSPORT, f"the nccl transport needs cupy with NCCL (pip install 'pdserve[cuda]'): {e}"
            ) from None
        self.nccl = nccl
        self._uid_type = type(nccl.get_unique_id())  # tuple of chars in older cupy, bytes in newer

    def version(self) -> str:
        v = self.nccl.get_version()
        return (
            f"{v // 10000}.{v // 100 % 100}.{v % 100}"
            if v >= 10000
            else f"{v // 1000}.{v // 100 % 10}.{v % 100}"
        )

    def unique_id(self) -> bytes:
        uid = self.nccl.get_unique_id()
        return bytes(uid) if isinstance(uid, bytes) else bytes(c & 0xFF for c in uid)

    def init(self, uid: bytes, rank: int, device: torch.device) -> _CupyComm:
        import cupy

        native = uid if self._uid_type is bytes else tuple(b - 256 if b > 127 else b for b in uid)
        with cupy.cuda.Device(device.index or 0):
            comm = self.nccl.NcclCommunicator(2, native, rank)
        return _CupyComm(comm, torch.cuda.Stream(device), device)

    def _launch(self, c: _CupyComm, tensors: list[torch.Tensor], peer: int, op: str) -> Work:
        import cupy

        c.stream.wait_stream(torch.cuda.current_stream(c.device))  # NOTE: the tensors' producer
        with cupy.cuda.Device(c.device.index or 0):
            self.nccl.groupStart()
            for t in tensors:
                n = t.numel() * t.element_size()
                if n:
                    getattr(c.comm, op)(t.data_ptr(), n, self.nccl.NCCL_UINT8, peer, c.stream.cuda_stream)
            self.nccl.groupEnd()
        for t in tensors:
            t.record_stream(c.stream)
        return _EventWork(c)

    def send(self, comm: Any, tensors: list[torch.Tensor], peer: int) -> Work:
        return self._launch(comm, tensors, peer, "send")

    def recv(self, comm: Any, tensors: list[torch.Tensor], peer: int) -> Work:
        return self._launch(comm, tensors, peer, "recv")

    def abort(self, comm: Any) -> None:
        with contextlib.suppress(Exception):
            comm.comm.abort()

    def can_carry(self, t: torch.Tensor) -> bool:
        return t.is_cuda


def nccl_version() -> str | None:
    """NCCL's version through cupy, or None where cupy or NCCL is missing (what a run can use)."""
    try:
        return CupyNccl().version()
    except Exception:  # HandoffError without cupy; cupy's own errors without NCCL
        return None


class NcclTransport(Transport):
    name = "nccl"
    capabilities = TRANSPORTS[name].capabilities

    def __init__(self, config: TransferConfig, backend: NcclBackend | None = None) -> None:
        super().__init__(config)
        self._backend = backend
        # sender: receiver address -> (key, communicator or None until bootstrapped, uid)
        self._out: dict[str, tuple[str, Any, bytes | None]] = {}
        self._out_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # receiver: communicator key -> communicator (LRU), and a lock per key
        self._in: OrderedDict[str, Any] = OrderedDict()
        self._in_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.num_inits = 0

    @property
    def backend(self) -> NcclBackend:
        if self._backend is None:
            self._backend = CupyNccl()
        return self._backend

    # ---- sender --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def session(self, peer: str) -> AsyncIterator[None]:
        async with self._out_locks[peer]:
            yield

    async def offer(self, ch: Channel, segments: list[Buffer]) -> dict[str, Any]:
        self._require_device(dense(segments, self.name), "sender")
        known = self._out.get(ch.peer)
        if known is not None and known[1] is not None:
            return {"comm": known[0]}
        key, uid = secrets.token_hex(8), self.backend.unique_id()
        self._out[ch.peer] = (key, None, uid)
        return {"comm": key, "uid": uid}

    async def push(self, ch: Channel, buffers: list[Buffer], ready: dict[str, Any]) -> None:
        segments = dense(buffers, self.name)
        key, comm, uid = self._out[ch.peer]
        if comm is None:
            assert uid is not None
            comm = await self._init(uid, 0, segments[0].device)
            self._out[ch.peer] = (key, comm, None)
        try:
            await self._wait(self.backend.send(comm, segments, 1), "send")
        except HandoffError:
            self._out.pop(ch.peer, None)  # a failed communicator is not reused
            self.backend.abort(comm)
            raise

    def forget(self, peer: str) -> None:
        known = self._out.pop(peer, None)
        if known is not None and known[1] is not None:
            self.backend.abort(known[1])

    # ---- receiver ------------------------------------------------------------------------------

    async def accept(
        self, ch: Channel, header: HandoffHeader, extra: dict[str, Any], buffers: list[Buffer]
    ) -> dict[str, Any]:
        segments = dense(buffers, "nccl")
        self._require_device(segments, "receiver")
        key, uid = extra.get("comm"), extra.get("uid")
        if not isinstance(key, str) or (uid is not None and not isinstance(uid, bytes)):
            raise HandoffError(TRANSPORT, "malformed nccl offer")
        if uid is None and key not in self._in:
            raise HandoffError(STALE, f"unknown NCCL communicator {key}: bootstrap again")
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
        segments = dense(buffers, "nccl")
        key, uid = extra["comm"], extra.get("uid")
        async with self._in_locks[key]:
            if uid is not None:
                old = self._in.pop(key, None)
                if old is not None:
                    self.backend.abort(old)
                self._in[key] = await self._init(uid, 1, segments[0].device)
                while len(self._in) > MAX_COMMS:
                    self.backend.abort(self._in.popitem(last=False)[1])
            self._in.move_to_end(key)
            comm = self._in[key]
            try:
                await self._wait(self.backend.recv(comm, segments, 0), "recv")
            except HandoffError:
                self._in.pop(key, None)
                self.backend.abort(comm)
                raise
        return None

    # ---- both ----------------------------------------------------------------------------------

    def _require_device(self, segments: list[torch.Tensor], side: str) -> None:
        if not all(self.backend.can_carry(t) for t in segments):
            raise HandoffError(
                TRANSPORT, f"the nccl transport needs the {side}'s payload tensors on a CUDA device"
            )

    async def _init(self, uid: bytes, rank: int, device: torch.device) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.executor, self.backend.init, uid, rank, device)
        try:
            comm = await asyncio.wait_for(asyncio.shield(fut), self.config.idle_timeout_s)
        except asyncio.TimeoutError:
            fut.add_done_callback(self._abort_late)  # a blocked init cannot be interrupted
            raise HandoffError(TIMEOUT, f"NCCL communicator setup (rank {rank}) timed out") from None
        except HandoffError:
            raise
        except Exception as e:
            raise HandoffError(TRANSPORT, f"NCCL communicator setup failed: {e}") from None
        self.num_inits += 1
        return comm

    def _abort_late(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.backend.abort(fut.result())

    async def _wait(self, work: Work, what: str) -> None:
        deadline = time.monotonic() + self.config.idle_timeout_s
        try:
            while not work.done():
                if time.monotonic() > deadline:
                    raise HandoffError(
                        TIMEOUT, f"NCCL {what} did not finish in {self.config.idle_timeout_s:.0f} s"
                    )
                await asyncio.sleep(POLL_S)
        except HandoffError:
            raise
        except Exception as e:
            raise HandoffError(TRANSPORT, f"NCCL {what} failed: {e}") from None

    def close(self) -> None:
        for _, comm, _ in self._out.values():
            if comm is not None:
                self.backend.abort(comm)
        for comm in self._in.values():
            self.backend.abort(comm)
        self._out.clear()
        self._in.clear()
