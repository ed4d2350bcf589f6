"""CUDA IPC transport: PE and CE on the same host; the receiver copies device to device, no host hop.

Sender: an export arena (transfer/arena.py), one device buffer of ipc_arena_bytes, allocated on the
first ipc export and exported once (torch's CUDA IPC: reduce_tensor, the fields re-encoded as plain
msgpack values, the device named by its UUID since two processes may number GPUs differently). The PE gathers an export
straight into slices of it (allocate(), engine.export_sequence's alloc), so the offer names the arena
(id, handle) and the segments' offsets; a slice is free again once the tensor living in it is
collected (weakref.finalize), i.e. once the PE drops the export after the ack or a failure.

An export outside the arena (larger than its free space, or made without it) goes as before: a
handle per tensor, which the receiver opens and drops within the handoff.

In place (the default; --ipc-copy-in turns it off): the PE exports its KV pool once too, its exports
name their pages in it (engine.export_sequence(pages_in_place=True): no gather; the pages' checksum
sum is hashed where they lie), and the offer carries the block ids; the CE's copy reads those pages
and writes them straight into its reservation's own pages (KVPool.target, as nixl lands), so a
handoff moves its bytes once, device to device. The PE holds the pages unchanged until the ack (a
handed-off sequence stays parked until finish_handoff) and the CE's copy waits for the PE's event as
for the arena. The small SWA state still goes through the arena.

Receiver: keeps the arenas it has opened (MAX_OPEN_ARENAS, by (host, arena id), least recently used
dropped first), so a handoff opens nothing; copies each segment into its buffer on a side stream
with the fused copy+hash kernel (checksum_gpu.copy_segments: one launch per segment, the sums copied
to pinned host memory before the completion event) and returns the checksum from pull, so the
receiver has no separate verify pass.

The arena comes with an interprocess CUDA event, exported once with it. The sender records it on
the producer's stream when it offers (the export's gather queued, maybe not done) and offers at once,
its checksum following the offer (handoff.py); the receiver's copy stream waits for that event on the
device before the copy runs. Without the event (a backend that cannot export one) the sender waits
for its export's writes before it offers, and the checksum is in the header. NOTE: the receiver keeps no
torch-rebuilt mapping of a per-tensor handle past its handoff: torch's IPC ref counting would keep the
sender's blocks in limbo and the sender's memory would grow (the arenas it keeps are few and fixed).

As with NCCL, the CUDA calls sit behind a small backend, so the flow runs in CPU tests with a fake.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.handoff import DTYPES, Alloc, PoolPages, dtype_name
from pdkernels.checksum import fold
from pdkernels.checksum_gpu import Paged, Segment, torch_copy
from transfer.arena import Arena
from transfer.config import TransferConfig
from transfer.errors import TIMEOUT, TRANSPORT, HandoffError
from transfer.header import Buffer, HandoffHeader, segment_bytes
from transfer.transport import KVPool, Transport
from transfer.transports import TRANSPORTS
from transfer.wire import Channel

log = logging.getLogger(__name__)
POLL_S = 50e-6  # how often a worker thread asks whether the copy is done (a copy takes ~1 ms per GiB)
MAX_OPEN_ARENAS = 8  # receiver: senders' arenas and KV pools kept mapped (a PE offers both)


def host_id() -> str:
    """This machine's boot id (two containers on one host share it), else its hostname."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


class Done(Protocol):
    def done(self) -> bool: ...


class Copy(Protocol):
    def done(self) -> bool: ...

    def segment_sums(self) -> list[int] | None:
        """Once done: each destination's S (checksum.py) if it was hashed on the way, else None."""


class IpcBackend(Protocol):
    def can_carry(self, t: torch.Tensor) -> bool: ...

    def export(self, t: torch.Tensor) -> dict[str, Any]:
        """A handle to t that another process on this host can open (msgpack-able values only)."""

    def open(self, handle: dict[str, Any]) -> torch.Tensor: ...

    def copy(self, dst: list[Segment], src: list[Segment], after: Any = None) -> Copy:
        """Queues dst[i] <- src[i] (flat uint8 tensors, or Paged pages of a pool, of equal byte sizes),
        hashing dst on the way where it can; after: an event (open_event's) the copy waits for on the
        device first."""

    def produced(self, device: torch.device) -> Done:
        """Says when the work queued so far on device's current stream (the export's writes) is done."""

    def export_event(self, device: torch.device) -> tuple[Any, dict[str, Any]]:
        """An event another process on this host can wait for, and its handle (msgpack-able)."""

    def record(self, event: Any, device: torch.device) -> None:
        """Records event after the work queued so far on device's current stream."""

    def open_event(self, handle: dict[str, Any]) -> Any:
        """The event of another process's export_event handle."""


def _wait(done: Done, deadline_s: float) -> bool:
    """Waits for done in a worker thread (an asyncio sleep on the loop lasts a millisecond at least, as
    long as the copy of a long sequence itself); False once time.monotonic() passes deadline_s. A CUDA
    event is waited for by CUDA itself (GIL released): it returns as the copy ends, where polling
    overshot by a sleep step (~0.1 ms); the caller bounds that wait with its own timeout."""
    synchronize = getattr(done, "synchronize", None)
    if synchronize is not None:
        synchronize()
        return True
    while not done.done():
        if time.monotonic() > deadline_s:
            return False
        time.sleep(POLL_S)
    return True


class _EventCopy:
    def __init__(self, event: Any, sums: Any = None, host: torch.Tensor | None = None, start: Any = None) -> None:
        self.event = event
        self.sums = sums  # the copy's SegmentSums (pdkernels/checksum_gpu.py), if it hashed
        self.host = host  # their buffer's copy in pinned host memory, written before the event
        self.start = start  # a timing event recorded before the copy's launches, if any

    def done(self) -> bool:
        return bool(self.event.query())

    def synchronize(self) -> None:
        self.event.synchronize()

    def segment_sums(self) -> list[int] | None:
        return None if self.sums is None or self.host is None else self.sums.fold(self.host)

    def gpu_s(self) -> float | None:
        """Once done: the copy's time on the device (its stream's events), if it was timed."""
        return None if self.start is None else self.start.elapsed_time(self.event) / 1e3


class TorchCudaIpc:
    """The real backend: torch's CUDA IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle underneath)."""

    def can_carry(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def export(self, t: torch.Tensor) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(t)
        (
            _,
            size,
            stride,
            offset,
            _,
            dtype,
            device,
            handle,
            storage_bytes,
            storage_offset,
            _,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = args
        return {
            "size": list(size),
            "stride": list(stride),
            "offset": int(offset),
            "dtype": dtype_name(dtype),
            "device": _device_uuid(int(device)),
            "handle": bytes(handle),
            "storage_bytes": int(storage_bytes),
            "storage_offset": int(storage_offset),
            "ref_handle": bytes(ref_handle),
            "ref_offset": int(ref_offset),
            "event_handle": None if event_handle is None else bytes(event_handle),
            "event_sync": bool(event_sync),
        }

    def open(self, h: dict[str, Any]) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        local = _local_device(h["device"])
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), h["offset"], torch.storage.TypedStorage, _IPC_DTYPES[h["dtype"]],
            local, h["handle"], h["storage_bytes"], h["storage_offset"], False, h["ref_handle"], h["ref_offset"],
            h["event_handle"], h["event_sync"],
        )  # fmt: skip

    def __init__(self, time_copies: bool = False) -> None:
        """time_copies: time each copy on its stream (TransferConfig.ipc_time_copies)."""
        self.time_copies = time_copies
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy(self, dst: list[Segment], src: list[Segment], after: Any = None) -> Copy:
        # NOTE: on the handoff's critical path: few torch calls (each costs microseconds of host time,
        # and the launch's Python is a sizeable part of a long sequence's copy: bench/figures/code-choices.md). One
        # sums buffer for every segment, copied to pinned memory before the completion event: once the
        # event is done the sums are read from host memory, with no further sync.
        from pdkernels.checksum_gpu import copy_segments

        device = dst[0].device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams.setdefault(device, torch.cuda.Stream(device))
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)  # the buffers' allocation
        if after is not None:
            stream.wait_event(after)  # the sender's export, written on its own stream
        torch.cuda.set_stream(stream)
        try:
            start = None
            if self.time_copies:
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
            sums = copy_segments(dst, src) if all(s.device == device for s in src) else None
            host = None
            if sums is None:
                for d, s in zip(dst, src):
                    torch_copy(d, s)
            else:
                host = torch.empty(sums.sums.shape, dtype=torch.int64, pin_memory=True)
                host.copy_(sums.sums, non_blocking=True)
            event = torch.cuda.Event(enable_timing=self.time_copies)
            event.record(stream)
        finally:
            torch.cuda.set_stream(current)
        return _EventCopy(event, sums, host, start)

    def idle(self) -> None:
        """Waits for every copy queued on the copy streams (before a mapping they may read is closed)."""
        for stream in self._streams.values():
            stream.synchronize()

    def produced(self, device: torch.device) -> Done:
        stream = torch.cuda.current_stream(device)
        if stream.query():  # nothing left to wait for: no event needed
            return _Ready()
        event = torch.cuda.Event()
        event.record(stream)
        return _EventCopy(event)


    def export_event(self, device: torch.device) -> tuple[Any, dict[str, Any]]:
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(device))
        return event, {"device": _device_uuid(device.index or 0), "handle": bytes(event.ipc_handle())}

    def record(self, event: Any, device: torch.device) -> None:
        event.record(torch.cuda.current_stream(device))

    def open_event(self, handle: dict[str, Any]) -> Any:
        return torch.cuda.Event.from_ipc_handle(torch.device("cuda", _local_device(handle["device"])), handle["handle"])


def _local_device(uuid: str) -> int:
    """This process's index of the GPU with that UUID (the sender's, named in its handles)."""
    local = next((i for i in range(torch.cuda.device_count()) if _device_uuid(i) == uuid), None)
    if local is None:
        raise HandoffError(TRANSPORT, f"the sender's GPU {uuid} is not visible to this process (use tcp or nccl)")
    return local


class _Ready:
    def done(self) -> bool:
        return True


_IPC_DTYPES = {**DTYPES, "uint8": torch.uint8}  # the payload's dtypes and the arena's


def _device_uuid(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"index:{index}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class ExportArena(Arena):
    """The sender's exported buffer (transfer/arena.py's allocator over it) and the handle a receiver
    opens it by, with its interprocess event."""

    def __init__(
        self, buf: torch.Tensor, handle: dict[str, Any], event: Any = None, event_handle: dict[str, Any] | None = None
    ) -> None:
        super().__init__(buf)
        self.handle = handle
        self.event = event  # recorded at each offer; the receiver's copy waits for it (None: no event)
        self.event_handle = event_handle


class ExportedPool:
    """A sender's KV pool (its pages tensor), exported once: what an offer of pages in place names."""

    def __init__(
        self, pool: torch.Tensor, handle: dict[str, Any], event: Any = None, event_handle: dict[str, Any] | None = None
    ) -> None:
        self.pool = pool
        self.id = uuid.uuid4().hex
        self.nbytes = pool.numel() * pool.element_size()
        self.page_bytes = self.nbytes // pool.shape[0]
        self.handle = handle
        self.event = event  # the transport's one event (the arena's, if it has one)
        self.event_handle = event_handle

    def fields(self, pages: PoolPages) -> dict[str, Any]:
        return {
            "id": self.id, "handle": self.handle, "nbytes": self.nbytes, "page_bytes": self.page_bytes,
            "event": self.event_handle, "pages": list(pages.block_ids),
        }  # fmt: skip


class IpcTransport(Transport):
    name = "ipc"
    capabilities = TRANSPORTS[name].capabilities
    reads_in_place = True

    def __init__(self, config: TransferConfig, backend: IpcBackend | None = None) -> None:
        super().__init__(config)
        self.backend: IpcBackend = backend or TorchCudaIpc(config.ipc_time_copies)
        self._host = host_id()
        self._arena: ExportArena | None = None
        self._arena_lock = threading.Lock()
        self._arena_failed = False
        self._event: tuple[Any, dict[str, Any] | None] | None = None  # (event, handle): made once
        self._pools: dict[int, ExportedPool | None] = {}  # a KV pool's data_ptr -> its export (None: failed)
        self._opened: OrderedDict[tuple[str, str], tuple[torch.Tensor, Any]] = OrderedDict()  # (memory, event)
        self._users: dict[tuple[str, str], set[int]] = {}  # an opened one's key -> the channels (ids) it served
        self.counters = {
            "arena_offers": 0, "event_offers": 0, "handle_offers": 0, "pool_offers": 0, "arena_opens": 0,
            "arena_hits": 0, "pool_opens": 0, "pool_hits": 0, "in_place_receives": 0, "released": 0,
        }  # fmt: skip

    # ---- sender side ---------------------------------------------------------------------------

    @property
    def arena(self) -> ExportArena | None:
        return self._arena

    def export_allocator(self) -> Alloc | None:
        return self.allocate if self.config.ipc_arena_bytes > 0 else None

    def reads_pool_pages(self) -> bool:
        return not self.config.ipc_copy_in

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """engine.export_sequence's alloc: an empty tensor in the export arena on device (made on the
        first call), or None (no arena here, or no room in it now: the export allocates normally)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda": the current device, as tensors say
            device = torch.device("cuda", torch.cuda.current_device())
        arena = self._arena_on(device)
        return arena.alloc(tuple(shape), dtype) if arena is not None else None

    def _event_on(self, device: torch.device) -> tuple[Any, dict[str, Any] | None]:
        """The transport's interprocess event (made once; (None, None) where the backend has none), under
        _arena_lock."""
        if self._event is None:
            try:
                self._event = self.backend.export_event(device)
            except Exception as e:  # the offers wait for each export's writes instead
                log.warning("no ipc event on %s (%r): offers wait for each export", device, e)
                self._event = (None, None)
        return self._event

    def _arena_on(self, device: torch.device) -> ExportArena | None:
        with self._arena_lock:
            if self._arena is None and not self._arena_failed and self.config.ipc_arena_bytes > 0:
                self._arena_failed = True  # until it is made
                try:
                    if self.backend.can_carry(torch.empty(0, device=device)):
                        buf = torch.empty(self.config.ipc_arena_bytes, dtype=torch.uint8, device=device)
                        handle = self.backend.export(buf)
                        self._arena = ExportArena(buf, handle, *self._event_on(device))
                        self._arena_failed = False
                        log.info("ipc export arena: %.2f GiB on %s", buf.numel() / 2**30, device)
                except Exception as e:  # out of memory, or no IPC here: per-tensor handles
                    log.warning("no ipc export arena on %s (%r): exports use per-tensor handles", device, e)
            arena = self._arena
        return arena if arena is not None and arena.buf.device == device else None

    def _pool_export(self, pages: PoolPages) -> ExportedPool | None:
        """pages' pool exported (on its first offer, keyed by its address; None if that failed, or if the
        memory there is now another tensor)."""
        pool = pages.pool
        with self._arena_lock:
            key = pool.data_ptr()
            if key not in self._pools:
                self._pools[key] = None
                try:
                    if self.backend.can_carry(pool) and pool.shape[0] and pool.is_contiguous():
                        exported = ExportedPool(pool, self.backend.export(pool), *self._event_on(pool.device))
                        self._pools[key] = exported
                        log.info("ipc: KV pool exported (%.2f GiB on %s)", exported.nbytes / 2**30, pool.device)
                except Exception as e:
                    log.warning("ipc: cannot export the KV pool (%r): its exports are gathered", e)
            got = self._pools[key]
        return got if got is not None and got.pool is pool else None

    def carried(self, segments: list[Buffer]) -> list[Buffer]:
        if isinstance(segments[0], PoolPages) and self._pool_export(segments[0]) is None:
            return super().carried(segments)
        return segments

    def _arena_offsets(self, segments: list[Buffer]) -> list[int | None] | None:
        """Each segment's offset in the export arena (None for pages offered in their pool), if they all
        lie in one or the other."""
        arena = self._arena
        offsets: list[int | None] = []
        for t in segments:
            if isinstance(t, PoolPages):
                if self._pool_export(t) is None:
                    return None
                offsets.append(None)
                continue
            offset = arena.offset_of(t) if arena is not None else None
            if offset is None:
                return None
            offsets.append(offset)
        return offsets if segments else None

    def _offer_event(self, segments: list[Buffer]) -> Any:
        """The event the receiver's copy of these segments waits for (None: none)."""
        if isinstance(segments[0], PoolPages):
            exported = self._pool_export(segments[0])
            return None if exported is None else exported.event
        return None if self._arena is None else self._arena.event

    def offers_unwritten(self, segments: list[Buffer]) -> bool:
        return self._arena_offsets(segments) is not None and self._offer_event(segments) is not None

    async def offer(self, ch: Channel, segments: list[Buffer]) -> dict[str, Any]:
        if not all(self.backend.can_carry(t.pool if isinstance(t, PoolPages) else t) for t in segments):
            raise HandoffError(TRANSPORT, "the ipc transport needs the payload on a CUDA device")
        offsets = self._arena_offsets(segments)
        if offsets is None:
            if any(isinstance(t, PoolPages) for t in segments):
                raise HandoffError(TRANSPORT, "ipc: pages in a pool that is not exported (carried() gathers them)")
            self.counters["handle_offers"] += 1
            return {"host": self._host, "handles": [self.backend.export(t) for t in segments if isinstance(t, torch.Tensor)]}
        device = segments[0].device
        event = self._offer_event(segments)
        if event is not None:  # the receiver's copy waits for the export on the device
            self.backend.record(event, device)
            self.counters["event_offers"] += 1
        else:
            done = self.backend.produced(device)
            if not done.done() and not await self._wait(done):
                raise HandoffError(TIMEOUT, "the export was not written in time")
        extra: dict[str, Any] = {"host": self._host, "offsets": offsets}
        if isinstance(segments[0], PoolPages):
            exported = self._pool_export(segments[0])
            assert exported is not None
            extra["pool"] = exported.fields(segments[0])
            self.counters["pool_offers"] += 1
        if any(o is not None for o in offsets):
            arena = self._arena
            assert arena is not None
            extra["arena"] = {"id": arena.id, "handle": arena.handle, "nbytes": arena.nbytes, "event": arena.event_handle}
            self.counters["arena_offers"] += 1
        return extra

    async def push(self, ch: Channel, segments: list[Buffer], ready: dict[str, Any]) -> None:
        """Nothing to move: the receiver reads the tensors in place (and acks when it has)."""

    async def _wait(self, done: Done) -> bool:
        """done, waited for in a worker thread, at most idle_timeout_s."""
        timeout = self.config.idle_timeout_s
        fut = asyncio.get_running_loop().run_in_executor(
            self.executor, _wait, done, time.monotonic() + timeout
        )
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return False

    # ---- receiver side -------------------------------------------------------------------------

    def receive_buffers(
        self, header: HandoffHeader, device: torch.device, pool: KVPool | None = None
    ) -> list[Buffer] | None:
        """In place (not --ipc-copy-in): the reservation's own pages and SWA slot in pool, where the engine
        lets the payload land there; else None (the receiver allocates). A failed copy may still write
        there for idle_timeout_s (the engine keeps a reservation's pages that long)."""
        if pool is None or self.config.ipc_copy_in or not pool.tensors or not self.backend.can_carry(pool.tensors[0]):
            return None
        target = pool.target(header, self.config.idle_timeout_s)
        if target is not None:
            self.counters["in_place_receives"] += 1
        return target

    async def accept(
        self, ch: Channel, header: HandoffHeader, extra: dict[str, Any], buffers: list[Buffer]
    ) -> dict[str, Any]:
        if extra.get("host") != self._host:
            raise HandoffError(
                TRANSPORT, "the ipc transport works only between processes of one host (use tcp or nccl)"
            )
        if not _well_formed(extra, [segment_bytes(t) for t in buffers]):
            raise HandoffError(TRANSPORT, "malformed ipc offer")
        if not all(self.backend.can_carry(t.pool if isinstance(t, PoolPages) else t) for t in buffers):
            raise HandoffError(TRANSPORT, "the ipc transport needs the receive buffers on a CUDA device")
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
        marks = [time.perf_counter()]
        sizes = [segment_bytes(t) for t in buffers]
        in_pool = "offsets" in extra and "pool" in extra
        ids = _HostIds(
            extra["pool"]["pages"] if in_pool else [], [b for t in buffers if isinstance(t, PoolPages) for b in t.block_ids]
        )
        dst = [Paged(t.pool, ids.take(len(t.block_ids))) if isinstance(t, PoolPages) else _bytes(t) for t in buffers]
        event = None
        src: list[Segment] = []
        if "offsets" in extra:
            arena = pool = None
            if in_pool:
                pool, event = await self._open_shared(ch, extra["host"], extra["pool"], "pool")
            if "arena" in extra:
                arena, arena_event = await self._open_shared(ch, extra["host"], extra["arena"], "arena")
                event = event if event is not None else arena_event
            for off, n in zip(extra["offsets"], sizes):
                if off is None:
                    assert pool is not None
                    src.append(Paged(pool.view(-1, extra["pool"]["page_bytes"]), ids.sender))
                else:
                    assert arena is not None
                    src.append(arena[off : off + n])
        else:
            src = list(await self._open_handles(extra["handles"], buffers))
        try:
            marks.append(time.perf_counter())
            copy = self.backend.copy(dst, src, event)
            marks.append(time.perf_counter())
            if not copy.done() and not await self._wait(copy):
                raise HandoffError(TIMEOUT, "ipc copy did not finish")
            marks.append(time.perf_counter())
            sums = copy.segment_sums()
            marks.append(time.perf_counter())
        finally:
            del src  # per-tensor handles: unmaps the sender's memory once the copy is done
        if phases is not None:
            names = ("ipc_open", "ipc_launch", "ipc_wait", "ipc_sums")
            phases.update({n: b - a for n, a, b in zip(names, marks, marks[1:])})
            gpu_s = getattr(copy, "gpu_s", lambda: None)()
            if gpu_s is not None:
                phases["ipc_copy_gpu"] = gpu_s
        return None if sums is None else fold(list(zip(sizes, sums)))

    async def _open_handles(self, handles: list[dict[str, Any]], buffers: list[Buffer]) -> list[torch.Tensor]:
        loop = asyncio.get_running_loop()
        try:
            src = await loop.run_in_executor(self.executor, lambda: [self.backend.open(h) for h in handles])
        except HandoffError:
            raise
        except Exception as e:
            raise HandoffError(TRANSPORT, f"cannot open the sender's CUDA IPC handles: {e}") from None
        for s, d in zip(src, buffers):
            if tuple(s.shape) != tuple(d.shape) or s.dtype != d.dtype or not s.is_contiguous():
                raise HandoffError(
                    TRANSPORT, f"ipc tensor {tuple(s.shape)} {s.dtype} != buffer {tuple(d.shape)} {d.dtype}"
                )
        return [_bytes(s) for s in src]

    async def _open_shared(
        self, ch: Channel, host: str, shared: dict[str, Any], kind: str
    ) -> tuple[torch.Tensor, Any]:
        """A sender's arena or KV pool (kind) as flat bytes and its event (None if it has none), opened on
        its first handoff over ch and kept (a few, LRU) while a connection it served is open."""
        key = (host, shared["id"])
        opened = self._opened.get(key)
        if opened is not None:
            self._opened.move_to_end(key)
            self._users.setdefault(key, set()).add(id(ch))
            self.counters[f"{kind}_hits"] += 1
            return opened
        loop = asyncio.get_running_loop()

        def open_both() -> tuple[torch.Tensor, Any]:
            t = self.backend.open(shared["handle"])
            event = None if shared["event"] is None else self.backend.open_event(shared["event"])
            return t, event

        try:
            t, event = await loop.run_in_executor(self.executor, open_both)
        except HandoffError:
            raise
        except Exception as e:
            raise HandoffError(TRANSPORT, f"cannot open the sender's CUDA IPC {kind}: {e}") from None
        if t.numel() * t.element_size() != shared["nbytes"] or not t.is_contiguous():
            raise HandoffError(TRANSPORT, f"the sender's {kind} is not the size its offer says")
        opened = (_bytes(t), event)
        self.counters[f"{kind}_opens"] += 1
        self._opened[key] = opened
        self._users.setdefault(key, set()).add(id(ch))
        while len(self._opened) > MAX_OPEN_ARENAS:
            self._release(next(iter(self._opened)))  # the least recently used
        return opened

    def channel_closed(self, ch: Channel) -> None:
        """The mappings only ch's handoffs used go: a sender that died (or whose connections idled out)
        must not keep its memory allocated through this process (an importer's mapping holds an exported
        allocation on the GPU until it is closed, even after the exporter's exit: a restarted PE could
        not allocate its KV pool). Its next handoff opens them again."""
        for key in [k for k, users in self._users.items() if users == {id(ch)}]:
            self._release(key)
        for users in self._users.values():
            users.discard(id(ch))

    def _release(self, key: tuple[str, str]) -> None:
        """Drops a mapping once no copy can still be reading it (the copies' streams drained)."""
        self._backend_idle()
        self._opened.pop(key, None)
        self._users.pop(key, None)
        self.counters["released"] += 1

    def _backend_idle(self) -> None:
        idle = getattr(self.backend, "idle", None)
        if idle is not None:
            idle()

    def close(self) -> None:
        self._backend_idle()
        self._opened.clear()
        self._users.clear()


class _HostIds:
    """A pull's block ids, the sender's pages then the receiver's, in one tensor of pinned host memory
    where CUDA is here: the copy moves them on its own stream, with no sync (a copy from pageable memory
    would wait for the decode step the engine has queued), in one host-to-device copy
    (checksum_gpu.copy_segments moves views of one tensor together)."""

    def __init__(self, sender: list[int], receiver: list[int]) -> None:
        both = [*sender, *receiver]
        self.ids = _host_ids(both) if both else torch.empty(0, dtype=torch.int64)
        self.sender = self.ids[: len(sender)]
        self._next = len(sender)

    def take(self, n: int) -> torch.Tensor:
        """The receiver's next n block ids."""
        got = self.ids[self._next : self._next + n]
        self._next += n
        return got


def _host_ids(ids: Any) -> torch.Tensor:
    """Block ids in pinned host memory where CUDA is here (see _HostIds)."""
    return torch.tensor(ids, dtype=torch.int64, pin_memory=torch.cuda.is_available())


def _well_formed(extra: dict[str, Any], sizes: list[int]) -> bool:
    """An offer names an in-bounds offset per segment (None for pages in the sender's pool: then it names
    the pool, its page size and the pages' block ids, in bounds, as many as the segment's size says)
    and the arena where any offset is given, or a handle per segment."""

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def shared_ok(d: Any) -> bool:
        return (
            isinstance(d, dict)
            and isinstance(d.get("id"), str)
            and isinstance(d.get("handle"), dict)
            and is_int(d.get("nbytes"))
            and (d.get("event", 0) is None or isinstance(d.get("event"), dict))
        )

    if "offsets" in extra:
        offsets = extra["offsets"]
        if not isinstance(offsets, list) or len(offsets) != len(sizes):
            return False
        in_pool = [o is None for o in offsets]
        if any(in_pool):
            pool = extra.get("pool")
            if in_pool != [True] + [False] * (len(sizes) - 1) or not isinstance(pool, dict) or not shared_ok(pool):
                return False
            page_bytes, pages, nbytes = pool.get("page_bytes"), pool.get("pages"), pool["nbytes"]
            if not isinstance(page_bytes, int) or not is_int(page_bytes) or page_bytes <= 0 or nbytes % page_bytes:
                return False
            num_blocks = nbytes // page_bytes
            if not isinstance(pages, list) or len(pages) * page_bytes != sizes[0]:
                return False
            if not all(is_int(p) and 0 <= p < num_blocks for p in pages):
                return False
        elif "pool" in extra:
            return False
        if all(in_pool):
            return "arena" not in extra
        arena = extra.get("arena")
        return isinstance(arena, dict) and shared_ok(arena) and all(
            o is None or (is_int(o) and 0 <= o and o + n <= arena["nbytes"]) for o, n in zip(offsets, sizes)
        )
    handles = extra.get("handles")
    return (
        isinstance(handles, list) and len(handles) == len(sizes) and all(isinstance(h, dict) for h in handles)
    )
