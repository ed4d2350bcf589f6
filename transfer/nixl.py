"""NIXL transport: the sender writes the payload one-sided into the receiver's buffers (NIXL's UCX
backend underneath: RDMA verbs, NVLink/cuda_ipc, shared memory or TCP, whichever UCX finds and
UCX_TLS allows); the control connection carries only what NIXL needs to find the buffers.

    S -> R  offer    (no transport fields)
    R       its receive buffers: the reservation's own pages and SWA slot in the CE's KV pool (registered
            once: the payload lands in place and the import copies nothing), or, where it may not land
            there, slices of its landing arena (registered once), or, where they are not (no room, no
            arena), memory registered with its agent for this handoff
    R -> S  ready    {agent: the agent's metadata for that registration (connection info included),
                      mem: "DRAM" | "VRAM", descs: [[address, bytes, device], ...] in payload order (one
                      per buffer; pages in the pool, one per run of consecutive blocks),
                      kept: whether the registration lasts as long as the agent (the pool, the arena),
                      hold_s: pages in the pool only: how long the CE keeps them from reuse after it gave
                      up on a write (the sender gives up its write within that)}
    S       loads the metadata unless it is kept metadata loaded before; cuts its segments where the
            descriptors end and WRITEs each piece from its export arena's registration (or from the
            segments registered for this write), waits for it
    S -> R  written  {payload_bytes}
    R       checksums the buffers where they are (the header's checksum), acks or nacks as for tcp

In place, the pages the PE writes are the reservation's fresh pages: never a page the CE's decode cache
holds (a delta handoff starts after the held pages; a full one over held pages lands in the arena), and
never a page any other sequence has. A reservation released while a write may still land there (an
abort mid-write, an expiry after a failed write) keeps its pages out of every other sequence's reach for
hold_s (engine/handoff/ledger.py's quarantine). A tensor-parallel CE re-shards what it receives: it
lands in the arena.

One NIXL agent per transport, i.e. per process and role (a rank sends or receives, not both), made on
the first handoff. The CE's KV pool (pages and SWA slots) is registered on its first handoff
(--nixl-copy-in: not at all). Memory is registered once per end, in an arena (transfer/arena.py) of
nixl_arena_mb on the device of the first handoff's memory: the sender's export arena, which the PE
gathers its exports into (export_allocator), and the receiver's landing arena, which the CE's
on_handoff takes its receive buffers from (receive_buffers, through KVReceiver.receive_buffers). A
slice is free again once its tensor is collected: after the ack for an export, after the import's
copy into the KV pool for a receive buffer. A payload that does not fit (larger than the arena's free
space) is registered for its handoff, as everything was before the arenas, and deregistered after.

The sender keeps a receiver's kept metadata loaded (MAX_REMOTE_AGENTS of them, the least recently
used idle one dropped first), so a handoff to a known receiver loads nothing; a restarted receiver
has a new agent, and so new metadata. Metadata of a registration for one handoff, and any remote
agent a write to failed, is dropped once no write to that agent is in flight: buffers a receiver has
deregistered are never addressable from here (NIXL would write into them: it knows only what was
loaded) and a long-lived sender does not accumulate their descriptors.

A streamed handoff (--kv-stream): the open's ready carries the same fields for the whole page buffer
(the reservation's pages in the pool, or registered until the parts end, or in the landing arena); the sender writes each part at its page
offset in it and only then sends the `part` message (no fields), which the receiver checks where the
bytes landed; the final offer is an offer as above.

The agents run without NIXL's progress thread (it polls with no delay: a whole core per rank, busy
or idle); a sender's wait polls its write, and a receiver drives its worker from a thread only while it
expects a write (UCX's message-based transports, tcp among them, need the target to make progress).

NOTE: after a failure, a buffer a write may still reach stays registered and referenced for
idle_timeout_s (the sender's bound on its own write) before it is released: a late one-sided write
into freed memory would corrupt whatever lives there next (UCX's shared-memory transports write
straight into the peer's address space). For an arena's slice, being referenced keeps it out of the
arena's free list. The same holds for a sender's source segments. On CUDA a freed landing slice may
still be read by the import's copy queued on the engine's stream: the receiver waits for the work
queued before the last free (Arena.settle) before it names slices in a ready.

The nixl package is imported when the transport is made (`pip install 'pdserve[nixl]'`); without it,
making the transport raises HandoffError(TRANSPORT) naming the extra.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from engine.handoff import Alloc, PoolPages
from transfer.arena import Arena
from transfer.config import NIXL_MISSING, NIXL_MODULES, TransferConfig
from transfer.errors import LAYOUT, PROTOCOL, TIMEOUT, TRANSPORT, HandoffError
from transfer.header import Buffer, HandoffHeader, dense
from transfer.messages import Written
from transfer.transport import KVPool, Transport
from transfer.transports import TRANSPORTS
from transfer.wire import Channel

log = logging.getLogger(__name__)
# A sender's worker asks whether its write is done after POLL_S, then twice as long each time up to
# POLL_MAX_S; a receiver's progress thread drives its worker every PROGRESS_S. Each ask takes the GIL
# from the engine thread of the same process (a PE prefilling the next chunk while a part goes, a CE
# decoding while a handoff lands): at a fixed 100 us a streamed 8k-token prompt prefilled 17% slower.
POLL_S = 50e-6
POLL_MAX_S = 1e-3
PROGRESS_S = 1e-3
READY_FIELDS = {"agent", "mem", "descs", "kept", "hold_s"}
MAX_DESCS = 1 << 20  # a ready's descriptors: a run of pages each at most (a 16k-token handoff in 16-token pages: 1,024)
MAX_REMOTE_AGENTS = 32  # sender: receivers' kept metadata loaded (the least recently used idle agent dropped)


def load_nixl() -> ModuleType:
    """NIXL's Python API (nixl._api): the `nixl` package, or a backend wheel installed without it."""
    for name in NIXL_MODULES:
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError:
            continue
        # NIXL prints its log to stdout with a handler of its own: its lines go through ours instead
        # (--log-format), warnings and up unless NIXL_LOG_LEVEL says otherwise
        nixl_log = logging.getLogger("nixl")
        nixl_log.handlers.clear()
        nixl_log.propagate = True
        if not os.environ.get("NIXL_LOG_LEVEL"):
            nixl_log.setLevel(logging.WARNING)
        return api
    raise HandoffError(TRANSPORT, NIXL_MISSING)


def _mem_type(segments: list[torch.Tensor]) -> tuple[str, int]:
    """NIXL's memory type and device id of segments, which must all be on one device."""
    devices = {t.device for t in segments}
    if len(devices) != 1:
        raise HandoffError(TRANSPORT, f"nixl: payload segments on several devices {sorted(map(str, devices))}")
    (device,) = devices
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    if device.type == "cpu":
        return "DRAM", 0
    raise HandoffError(TRANSPORT, f"nixl cannot move {device.type} memory")


def _descs(segments: list[torch.Tensor], device: int) -> list[tuple[int, int, int]]:
    for t in segments:
        if not t.is_contiguous():
            raise HandoffError(TRANSPORT, "nixl: payload segments must be contiguous")
    return [(t.data_ptr(), t.numel() * t.element_size(), device) for t in segments]


def _buffer_descs(buffers: list[Buffer], device: int) -> list[tuple[int, int, int]]:
    """Descriptors of receive buffers in payload order: a tensor is one, pages in a pool one per run."""
    out = []
    for b in buffers:
        out += _descs(b.runs(), device) if isinstance(b, PoolPages) else _descs([b], device)
    return [d for d in out if d[1]]


def _tensors(buffers: list[Buffer]) -> list[torch.Tensor]:
    """The memory buffers lie in (a pool's runs for pages in place), for NIXL's device checks."""
    return [t for b in buffers for t in (b.runs() if isinstance(b, PoolPages) else [b])]


def _cut(descs: list[tuple[int, int, int]], start: int, n: int) -> list[tuple[int, int, int]]:
    """Bytes [start, start + n) of the concatenation of descs, as descriptors; raises HandoffError(PROTOCOL)
    where they reach past the end."""
    out, pos = [], 0
    for addr, size, device in descs:
        lo, hi = max(start, pos), min(start + n, pos + size)
        if lo < hi:
            out.append((addr + lo - pos, hi - lo, device))
        pos += size
    if sum(d[1] for d in out) != n:
        raise HandoffError(PROTOCOL, f"nixl: bytes [{start}, {start + n}) beyond {pos} bytes of receive buffers")
    return out


def _pair(
    local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """local and remote descriptors cut at the union of their boundaries, so that piece i of one is the
    size of piece i of the other (the receiver's buffers may be scattered pages of its pool); raises
    HandoffError(PROTOCOL) when they do not hold the same bytes."""
    local, remote = [d for d in local if d[1]], [d for d in remote if d[1]]
    if sum(d[1] for d in local) != sum(d[1] for d in remote):
        raise HandoffError(
            PROTOCOL, f"nixl: {sum(d[1] for d in remote)} bytes of receive buffers for {sum(d[1] for d in local)} bytes"
        )
    src, dst = [], []
    i = j = off_i = off_j = 0
    while i < len(local):
        (la, ln, ld), (ra, rn, rd) = local[i], remote[j]
        k = min(ln - off_i, rn - off_j)
        src.append((la + off_i, k, ld))
        dst.append((ra + off_j, k, rd))
        off_i, off_j = off_i + k, off_j + k
        if off_i == ln:
            i, off_i = i + 1, 0
        if off_j == rn:
            j, off_j = j + 1, 0
    return src, dst


class _Agent:
    """One NIXL agent (UCX backend) and the registrations and remote agents it holds. Thread-safe: its
    calls run in worker threads (registration takes milliseconds)."""

    def __init__(self, api: ModuleType) -> None:
        self.api = api
        self.name = f"pdserve/{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        conf = api.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self.agent = api.nixl_agent(self.name, conf)
        if "UCX" not in self.agent.backends:
            raise HandoffError(TRANSPORT, f"nixl: no UCX backend (plugins: {self.agent.plugin_list})")
        self._lock = threading.Lock()
        self._peers: dict[str, int] = {}  # remote agent -> writes to it in flight
        # kept metadata (a receiver's registration for its lifetime) -> the remote agent it loaded, least
        # recently used first; a remote agent that also holds a registration of one handoff, or that a
        # write failed to, is dropped once no write to it is in flight (_dirty)
        self._remotes: OrderedDict[bytes, str] = OrderedDict()
        self._dirty: set[str] = set()
        self._held: dict[int, tuple[Any, Sequence[Buffer]]] = {}  # kept after a failure (reg may be None)

    def register(self, segments: list[torch.Tensor], mem: str, device: int) -> Any:
        return self.agent.register_memory([(*d, "") for d in _descs(segments, device)], mem)

    def deregister(self, reg: Any) -> None:
        try:
            self.agent.deregister_memory(reg)
        except Exception as e:  # the agent's own bookkeeping; nothing a peer can do about it
            log.warning("nixl: deregistering memory failed: %r", e)

    def hold(self, reg: Any, segments: Sequence[Buffer], delay_s: float) -> None:
        """Keeps reg registered (None: segments lie in an arena registered for good) and segments alive
        for delay_s (a write may still reach them): an arena's slices stay out of its free list."""
        key = id(reg) if reg is not None else id(segments)
        with self._lock:
            self._held[key] = (reg, segments)

        def release() -> None:
            with self._lock:
                held = self._held.pop(key, None)
            if held is not None and held[0] is not None:
                self.deregister(held[0])

        timer = threading.Timer(delay_s, release)
        timer.daemon = True
        timer.start()

    def release(self, handle: Any, peer: str) -> bool:
        """Releases a transfer (cancelling it if still in flight, where the backend can); False if it
        could not be, and may still be moving memory."""
        try:
            handle.release()
            return True
        except Exception as e:
            log.warning("nixl: releasing a transfer to %s failed: %r", peer, e)
            return False

    def connect(self, metadata: bytes, kept: bool) -> tuple[str, bool]:
        """The remote agent of a receiver's metadata, loaded unless kept metadata already was; counts a
        write to it. kept: the metadata describes a registration that lasts as long as the receiver's
        agent (its landing arena), so it stays loaded; else the agent is dropped after the write, so
        buffers the receiver deregisters are never addressable from here. Returns (name, loaded)."""
        with self._lock:
            name = self._remotes.get(metadata) if kept else None
            loaded = name is None
            if name is None:
                got = self.agent.add_remote_agent(metadata)
                name = got.decode() if isinstance(got, bytes) else str(got)
                if kept:
                    self._remotes[metadata] = name
                else:
                    self._dirty.add(name)
            else:
                self._remotes.move_to_end(metadata)
            self._peers[name] = self._peers.get(name, 0) + 1
            return name, loaded

    def disconnect(self, name: str, keep: bool) -> None:
        """A write to name has ended; keep: it succeeded (else what was loaded of name is dropped with
        the last write in flight: a receiver that failed is asked for its metadata again). Drops the
        least recently used idle remote agents while more than MAX_REMOTE_AGENTS metadata are kept."""
        with self._lock:
            self._peers[name] -= 1
            if not keep:
                self._dirty.add(name)
            if self._peers[name] == 0:
                del self._peers[name]
                if name in self._dirty:
                    self._drop(name)
            for n in list(dict.fromkeys(self._remotes.values())):  # least recently used first
                if len(self._remotes) <= MAX_REMOTE_AGENTS:
                    break
                if n not in self._peers:
                    self._drop(n)

    def _drop(self, name: str) -> None:
        """Unloads a remote agent and every registration of it loaded here (under _lock)."""
        self._dirty.discard(name)
        for k in [k for k, n in self._remotes.items() if n == name]:
            del self._remotes[k]
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:
            log.warning("nixl: dropping remote agent %s failed: %r", name, e)

    @property
    def num_remote_agents(self) -> int:
        """Remote agents loaded now (kept, or with writes in flight)."""
        with self._lock:
            return len(set(self._remotes.values()) | set(self._peers))

    def progress_while(self) -> threading.Event:
        """Drives the agent's UCX worker from a thread until the returned event is set: the side a write
        lands on must make progress for transports that carry it in messages (UCX's tcp), and the agent
        runs no progress thread of its own (NIXL's spins a core whether or not anything moves)."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(PROGRESS_S):
                try:
                    self.agent.get_new_notifs()  # progresses the backend's worker (thread-safe: STRICT)
                except Exception as e:  # the write's own wait reports what went wrong
                    log.debug("nixl: progress failed: %r", e)
                    return

        threading.Thread(target=run, name="nixl-progress", daemon=True).start()
        return stop

    def close(self) -> None:
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for reg, _ in held:
            if reg is not None:
                self.deregister(reg)


class _Registered:
    """An arena registered with the agent once (until close), and for a receiver the agent metadata
    that names that registration (sent in every ready whose buffers lie in it)."""

    def __init__(self, arena: Arena, reg: Any, metadata: bytes) -> None:
        self.arena = arena
        self.reg = reg
        self.metadata = metadata


class _Pool:
    """A receiver's KV pool registered with the agent once (until close), and the metadata that names it."""

    def __init__(self, tensors: list[torch.Tensor], reg: Any, metadata: bytes) -> None:
        self.tensors = tensors  # referenced: the registration names their memory
        self.reg = reg
        self.metadata = metadata
        self.ranges = [(t.data_ptr(), t.data_ptr() + _nbytes(t)) for t in tensors]

    def covers(self, descs: list[tuple[int, int, int]]) -> bool:
        """Whether every descriptor lies inside the registered memory."""
        return bool(descs) and all(any(lo <= a and a + n <= hi for lo, hi in self.ranges) for a, n, _ in descs)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


EXPORT, LANDING = "export", "landing"  # the sender's arena, the receiver's


class NixlTransport(Transport):
    name = "nixl"
    capabilities = TRANSPORTS[name].capabilities
    writes_parts = True  # a streamed handoff's parts: written into the buffer its open's ready named

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._api = load_nixl()
        self._agent: _Agent | None = None
        self._agent_lock = threading.Lock()
        self._landing: dict[int, tuple[Any, list[Buffer]]] = {}  # receiver: by id of the segments
        self._streams: dict[int, tuple[Any, Buffer, threading.Event]] = {}  # receiver: by id of the pages
        self._pool: _Pool | None = None  # receiver: the engine's KV pool, registered on first use
        self._pool_tried = False
        self._arenas: dict[str, _Registered] = {}  # EXPORT | LANDING, made on first use
        self._arena_tried: set[str] = set()
        self._arena_lock = threading.Lock()
        self._counters_lock = threading.Lock()
        self.counters = {
            "registrations": 0,  # memory registered with the agent: an arena (once), or one handoff's
            "arena_writes": 0,  # sender: writes from its arena's registration
            "registered_writes": 0,  # sender: writes that registered their segments for themselves
            "metadata_loads": 0,  # sender: a receiver's metadata loaded
            "metadata_reuses": 0,  # sender: a write to a receiver's registration loaded before
            "arena_receives": 0,  # receiver: payloads landing in its arena's registration
            "registered_receives": 0,  # receiver: payloads whose buffers were registered for them
            "in_place_receives": 0,  # receiver: payloads written straight into the KV pool's reserved pages
        }

    def agent(self) -> _Agent:
        with self._agent_lock:
            if self._agent is None:
                try:
                    self._agent = _Agent(self._api)
                except HandoffError:
                    raise
                except Exception as e:
                    raise HandoffError(TRANSPORT, f"nixl: cannot start an agent: {e!r}") from None
            return self._agent

    def _count(self, key: str) -> None:
        with self._counters_lock:
            self.counters[key] += 1

    def arena(self, which: str) -> Arena | None:
        """The EXPORT or LANDING arena, if made."""
        got = self._arenas.get(which)
        return got.arena if got is not None else None

    def _arena_on(self, which: str, device: torch.device) -> _Registered | None:
        """The EXPORT or LANDING arena on device, made and registered on the first call; None if it is
        off (nixl_arena_mb 0), could not be made (memory, registration: handoffs then register their
        own memory, as without it) or is on another device."""
        if device.type == "cuda" and device.index is None:  # "cuda": the current device, as tensors say
            device = torch.device("cuda", torch.cuda.current_device())
        with self._arena_lock:
            if which not in self._arena_tried:
                self._arena_tried.add(which)
                nbytes = self.config.nixl_arena_bytes(device.type)
                if nbytes > 0:
                    try:
                        self._arenas[which] = self._register_arena(which, device, nbytes)
                        log.info("nixl %s arena: %d MiB on %s, registered", which, nbytes >> 20, device)
                    except Exception as e:
                        log.warning(
                            "nixl: no %s arena on %s (%r): handoffs register their own memory", which, device, e
                        )
            got = self._arenas.get(which)
        return got if got is not None and got.arena.buf.device == device else None

    def _register_arena(self, which: str, device: torch.device, nbytes: int) -> _Registered:
        # NOTE: the receiver's slices are written by NIXL outside any stream's order: a free is fenced
        # (Arena.settle) against the device work that may still read the slice (the import's copy)
        arena = Arena(torch.empty(nbytes, dtype=torch.uint8, device=device), fence_frees=which == LANDING)
        mem, index = _mem_type([arena.buf])
        agent = self.agent()
        reg = agent.register([arena.buf], mem, index)
        self._count("registrations")
        try:
            metadata = bytes(agent.agent.get_partial_agent_metadata(reg, True, [])) if which == LANDING else b""
        except Exception:
            agent.deregister(reg)
            raise
        return _Registered(arena, reg, metadata)

    # ---- sender --------------------------------------------------------------------------------

    def export_allocator(self) -> Alloc | None:
        return self.allocate if self.config.nixl_arena_mb != 0 else None

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """engine.export_sequence's alloc: an empty tensor in the export arena on device (made and
        registered on the first call), or None (no arena here, or no room in it now: the export
        allocates normally and its write registers it)."""
        got = self._arena_on(EXPORT, torch.device(device))
        return got.arena.alloc(tuple(shape), dtype) if got is not None else None

    async def offer(self, ch: Channel, buffers: list[Buffer]) -> dict[str, Any]:
        segments = dense(buffers, self.name)
        _descs(segments, _mem_type(segments)[1])  # refused before the receiver reserves anything
        return {}

    async def push(self, ch: Channel, buffers: list[Buffer], ready: dict[str, Any]) -> None:
        segments = dense(buffers, self.name)
        metadata, remote_mem, remote, kept, hold_s = _read_ready(ready)
        nbytes = sum(t.numel() * t.element_size() for t in segments)
        await self._push(ch, segments, metadata, (remote_mem, _cut(remote, 0, nbytes)), kept, hold_s)
        await ch.send(Written(nbytes))

    async def write_part(self, ch: Channel, pages: torch.Tensor, offset: int, opened: dict[str, Any]) -> None:
        metadata, remote_mem, remote, kept, hold_s = _read_ready(opened)
        page_bytes = pages[0].numel() * pages.element_size()
        start, n = offset * page_bytes, pages.numel() * pages.element_size()
        await self._push(ch, [pages], metadata, (remote_mem, _cut(remote, start, n)), kept, hold_s)

    async def _push(
        self,
        ch: Channel,
        segments: list[torch.Tensor],
        metadata: bytes,
        remote: tuple[str, list[tuple[int, int, int]]],
        kept: bool,
        hold_s: float | None,
    ) -> None:
        """Writes segments into the receiver's buffers remote (memory type, descriptors) and waits for it,
        at most hold_s where the receiver gives one."""
        mem, device = _mem_type(segments)
        produced = None
        if mem == "VRAM":
            produced = torch.cuda.Event()  # NOTE: recorded on the export's producer stream
            produced.record(torch.cuda.current_stream(segments[0].device))
        await ch.run_blocking(
            self.executor, self._write, segments, (mem, device), metadata, remote, produced, kept, hold_s
        )

    def _write(
        self,
        segments: list[torch.Tensor],
        local: tuple[str, int],
        metadata: bytes,
        remote: tuple[str, list[tuple[int, int, int]]],
        produced: Any,
        kept: bool = False,
        hold_s: float | None = None,
    ) -> None:
        """Writes segments (local: their memory type and device) into the receiver's buffers (remote:
        their memory type and descriptors; kept: they lie in a registration the receiver keeps, whose
        metadata stays loaded here) and waits for the write (worker thread). The segments go from the
        export arena's registration when they lie in it, else are registered for this write. The write is
        given up after idle_timeout_s, or the receiver's hold_s if shorter (how long it keeps the buffers
        from reuse after it gave up itself: pages of its KV pool). Raises HandoffError(TRANSPORT | TIMEOUT)."""
        agent = self.agent()
        mem, device = local
        if produced is not None:
            produced.synchronize()
        bound_s = self.config.idle_timeout_s if hold_s is None else min(hold_s, self.config.idle_timeout_s)
        deadline = time.monotonic() + bound_s  # NOTE: from before registering: the receiver's hold runs already
        export = self._arenas.get(EXPORT)
        reg = None  # registered for this write
        if export is not None and export.arena.holds(segments):
            self._count("arena_writes")
        else:
            try:
                reg = agent.register(segments, mem, device)
            except Exception as e:
                raise HandoffError(TRANSPORT, f"nixl: registering the payload failed: {e!r}") from None
            self._count("registrations")
            self._count("registered_writes")
        in_flight = False  # a write NIXL could not release may still read the segments
        try:
            try:
                peer, loaded = agent.connect(metadata, kept)
            except Exception as e:
                raise HandoffError(
                    TRANSPORT, f"nixl: the receiver's agent metadata did not load: {e!r}"
                ) from None
            self._count("metadata_loads" if loaded else "metadata_reuses")
            a, handle, ok = agent.agent, None, False
            src, dst = _pair(_descs(segments, device), remote[1])  # the receiver's may be scattered pages
            try:
                handle = _nixl_call(peer, lambda: a.initialize_xfer(
                    "WRITE", a.get_xfer_descs(src, mem), a.get_xfer_descs(dst, remote[0]), peer
                ))  # fmt: skip
                self._wait(agent, handle, peer, deadline, bound_s)
                ok = True
            finally:
                if handle is not None:
                    in_flight = not agent.release(handle, peer)
                agent.disconnect(peer, keep=ok)
        finally:
            if in_flight:
                agent.hold(reg, segments, self.config.idle_timeout_s)
            elif reg is not None:
                agent.deregister(reg)

    def _wait(self, agent: _Agent, handle: Any, peer: str, deadline: float, bound_s: float) -> None:
        """Posts the write and polls it to its end (by deadline, bound_s after the ready came); raises
        HandoffError(TRANSPORT | TIMEOUT)."""
        a = agent.agent
        state = _nixl_call(peer, a.transfer, handle)
        delay = POLL_S
        while state == "PROC":
            if time.monotonic() > deadline:
                raise HandoffError(
                    TIMEOUT,
                    f"nixl: the write to {peer} did not complete within {bound_s:g} s",
                )
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)
            state = _nixl_call(peer, a.check_xfer_state, handle)
        if state != "DONE":
            raise HandoffError(TRANSPORT, f"nixl: the write to {peer} failed ({state})")

    # ---- receiver ------------------------------------------------------------------------------

    def receive_buffers(
        self, header: HandoffHeader, device: torch.device, pool: KVPool | None = None
    ) -> list[Buffer] | None:
        """The reservation's own pages and SWA slot in pool (registered with the agent on the first call),
        where the engine lets the payload land in place; else slices of the landing arena on device (made
        and registered on the first call); or None where it has neither or no room now. A slice is free
        again once its tensor is collected: after the import copied it into the KV pool, or
        idle_timeout_s after a failure (the engine keeps a reservation's pages that long itself)."""
        if pool is not None and not self.config.nixl_copy_in and self._pool_of(pool) is not None:
            target = pool.target(header, self.config.idle_timeout_s)
            if target is not None:
                return target
        got = self._arena_on(LANDING, device)
        if got is None:
            return None
        shapes = [header.page_shape] + ([header.state_shape] if header.has_state else [])
        out: list[Buffer] = []
        for shape in shapes:
            t = got.arena.alloc(tuple(shape), header.torch_dtype)
            if t is None:
                return None  # the slices taken so far are freed with `out`
            out.append(t)
        return out

    def _pool_of(self, pool: KVPool) -> _Pool | None:
        """pool's memory registered with the agent (on the first call; None if that failed, or for
        another pool than the first one's)."""
        tensors = [t for t in pool.tensors if t.numel()]
        with self._arena_lock:
            if not self._pool_tried:
                self._pool_tried = True
                try:
                    mem, index = _mem_type(tensors)
                    agent = self.agent()
                    reg = agent.register(tensors, mem, index)
                    self._count("registrations")
                    try:
                        metadata = bytes(agent.agent.get_partial_agent_metadata(reg, True, []))
                    except Exception:
                        agent.deregister(reg)
                        raise
                    self._pool = _Pool(tensors, reg, metadata)
                    log.info("nixl: the KV pool registered (%d MiB): handoffs land in place", sum(_nbytes(t) for t in tensors) >> 20)
                except Exception as e:
                    log.warning("nixl: the KV pool could not be registered (%r): handoffs land in the receive arena", e)
            got = self._pool
        return got if got is not None and got.covers(_buffer_descs(list(tensors), 0)) else None

    async def accept(
        self, ch: Channel, header: HandoffHeader, extra: dict[str, Any], segments: list[Buffer]
    ) -> dict[str, Any]:
        if extra:
            raise HandoffError(PROTOCOL, f"nixl: unexpected offer fields {sorted(map(str, extra))[:8]}")
        return await self._prepare(segments, count=True)

    async def _prepare(self, segments: list[Buffer], *, count: bool) -> dict[str, Any]:
        """segments made writable by the sender (registered once, or now); the ready's fields. count: a
        handoff's payload (a stream's whole page buffer is counted with its final offer)."""
        mem, device = _mem_type(_tensors(segments))
        descs = _buffer_descs(segments, device)
        loop = asyncio.get_running_loop()
        landing = self._arenas.get(LANDING)
        dense = [t for t in segments if isinstance(t, torch.Tensor)]
        if self._pool is not None and self._pool.covers(descs):  # the reservation's pages: registered once
            reg, metadata, kept, kind = None, self._pool.metadata, True, "in_place_receives"
        elif len(dense) < len(segments):
            raise HandoffError(LAYOUT, "nixl: pages in place outside the registered KV pool")
        elif landing is not None and landing.arena.holds(dense):  # registered once: nothing to do
            if landing.arena.fence_frees:  # the slices' last readers on the device are done
                await loop.run_in_executor(self.executor, landing.arena.settle)
            reg, metadata, kept, kind = None, landing.metadata, True, "arena_receives"
        else:
            reg, metadata = await loop.run_in_executor(self.executor, self._register_landing, dense, mem, device)
            kept, kind = False, "registered_receives"
        if count:
            self._count(kind)
        self._landing[id(segments)] = (reg, segments)
        fields = {"agent": metadata, "mem": mem, "descs": [list(d) for d in descs], "kept": kept}
        if kind == "in_place_receives":  # the engine keeps its pages from reuse this long after a failure
            fields["hold_s"] = self.config.idle_timeout_s
        return fields

    def _register_landing(self, segments: list[torch.Tensor], mem: str, device: int) -> tuple[Any, bytes]:
        agent = self.agent()
        try:
            reg = agent.register(segments, mem, device)
        except Exception as e:
            raise HandoffError(TRANSPORT, f"nixl: registering the receive buffers failed: {e!r}") from None
        self._count("registrations")
        try:
            return reg, bytes(agent.agent.get_partial_agent_metadata(reg, True, []))
        except Exception as e:
            agent.deregister(reg)
            raise HandoffError(TRANSPORT, f"nixl: the agent's metadata: {e!r}") from None

    async def pull(
        self,
        ch: Channel,
        header: HandoffHeader,
        extra: dict[str, Any],
        segments: list[Buffer],
        *,
        phases: dict[str, float] | None = None,
    ) -> int | None:
        reg, _ = self._landing.pop(id(segments))
        agent = self.agent()
        done = False
        progress = agent.progress_while()
        try:
            try:
                msg = await asyncio.wait_for(ch.expect(Written), self.config.idle_timeout_s)
            except asyncio.TimeoutError:
                raise HandoffError(
                    TIMEOUT,
                    f"request {header.request_id!r}: no nixl write within {self.config.idle_timeout_s:g} s",
                ) from None
            if msg.payload_bytes != header.payload_bytes:
                raise HandoffError(
                    PROTOCOL,
                    f"request {header.request_id!r}: the sender wrote {msg.payload_bytes} bytes,"
                    f" the header says {header.payload_bytes}",
                )
            done = True
        finally:
            progress.set()
            if not done:  # NOTE: the sender's write may still land in these buffers
                agent.hold(reg, segments, self.config.idle_timeout_s)
            elif reg is not None:
                agent.deregister(reg)
        return None  # the receiver hashes the buffers where they are

    async def open_stream(self, ch: Channel, header: HandoffHeader, pages: Buffer) -> dict[str, Any]:
        """A streamed handoff's whole page buffer, prepared as accept prepares a payload's (in the landing
        arena, or registered for it); the parts are written into it and the worker driven until end_stream."""
        segments: list[Buffer] = [pages]
        fields = await self._prepare(segments, count=False)
        reg, _ = self._landing.pop(id(segments))
        self._streams[id(pages)] = (reg, pages, self.agent().progress_while())
        return fields

    def end_stream(self, pages: Buffer, *, clean: bool) -> None:
        stream = self._streams.pop(id(pages), None)
        if stream is None:
            return
        reg, _, progress = stream
        progress.set()
        if not clean:  # NOTE: a part's write may still land in pages
            self.agent().hold(reg, [pages], self.config.idle_timeout_s)
        elif reg is not None:
            self.agent().deregister(reg)

    def abandon(self, segments: list[Buffer]) -> None:
        """Releases buffers accept prepared whose pull never ran (the handoff failed before ready went
        out, or as it went: the sender may have learnt where they are), idle_timeout_s from now."""
        landing = self._landing.pop(id(segments), None)
        if landing is not None and self._agent is not None:  # NOTE: ready may have gone out after all
            self._agent.hold(landing[0], segments, self.config.idle_timeout_s)

    def close(self) -> None:
        for reg, _ in self._landing.values():
            if self._agent is not None and reg is not None:
                self._agent.deregister(reg)
        self._landing.clear()
        for reg, _, progress in self._streams.values():
            progress.set()
            if self._agent is not None and reg is not None:
                self._agent.deregister(reg)
        self._streams.clear()
        if self._agent is not None:
            for got in self._arenas.values():
                self._agent.deregister(got.reg)
            if self._pool is not None:
                self._agent.deregister(self._pool.reg)
            self._agent.close()
        self._arenas.clear()
        self._pool = None


def _nixl_call(peer: str, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), NIXL's own errors (nixlBackendError, nixlRemoteDisconnectError, ...) as HandoffError."""
    try:
        return fn(*args)
    except Exception as e:
        raise HandoffError(TRANSPORT, f"nixl: the write to {peer} failed: {e!r}") from None


def _read_ready(ready: dict[str, Any]) -> tuple[bytes, str, list[tuple[int, int, int]], bool, float | None]:
    """The receiver's agent metadata, memory type, buffer descriptors (in payload order: one per buffer,
    or one per run of pages for pages landing in place), whether its registration is kept and how long
    it keeps the buffers from reuse after a failure (hold_s: pages in its pool; None: as long as needed),
    from its ready fields. Raises HandoffError(PROTOCOL)."""
    metadata, their_mem, descs = ready.get("agent"), ready.get("mem"), ready.get("descs")
    kept = ready.get("kept", False)  # absent: a receiver that registers per handoff
    hold_s = ready.get("hold_s")
    if hold_s is not None and (type(hold_s) not in (int, float) or not 0 < hold_s < math.inf):
        raise HandoffError(PROTOCOL, "nixl: a ready whose hold_s is not a positive number")
    if not isinstance(metadata, bytes) or not metadata or not {"agent", "mem", "descs"} <= set(ready) <= READY_FIELDS:
        raise HandoffError(PROTOCOL, f"nixl: a ready without agent metadata (fields {sorted(map(str, ready))[:8]})")
    if not isinstance(kept, bool):
        raise HandoffError(PROTOCOL, "nixl: a ready whose kept is not a bool")
    if their_mem not in ("DRAM", "VRAM"):
        raise HandoffError(PROTOCOL, "nixl: a ready with an unknown memory type")
    if not isinstance(descs, list) or len(descs) > MAX_DESCS:
        raise HandoffError(PROTOCOL, f"nixl: a ready naming more than {MAX_DESCS} buffers, or none listed")
    remote = []
    for d in descs:
        if not (isinstance(d, list) and len(d) == 3 and all(isinstance(x, int) and x >= 0 for x in d)):
            raise HandoffError(PROTOCOL, "nixl: a malformed buffer descriptor in ready")
        remote.append((d[0], d[1], d[2]))
    return metadata, their_mem, remote, kept, None if hold_s is None else float(hold_s)
