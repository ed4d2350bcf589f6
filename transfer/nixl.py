"""NIXL transport: the sender writes the payload one-sided into the receiver's buffers (NIXL's UCX
backend underneath: RDMA verbs, NVLink/cuda_ipc, shared memory or TCP, whichever UCX finds and
UCX_TLS allows); the control connection carries only what NIXL needs to find the buffers.

    S -> R  offer    (no transport fields)
    R       registers its receive buffers with its agent
    R -> S  ready    {agent: the agent's metadata for those buffers (connection info included),
                      mem: "DRAM" | "VRAM", descs: [[address, bytes, device], ...] in payload order}
    S       registers its segments, loads the metadata, WRITEs segment i into descs[i], waits for it
    S -> R  written  {payload_bytes}
    R       checksums the buffers where they are (the header's checksum), acks or nacks as for tcp

A streamed handoff (--kv-stream): the open's ready carries the same fields for the whole page buffer
(registered until the parts end); the sender writes each part at its page offset in it and only then
sends the `part` message (no fields), which the receiver checks where the bytes landed; the final
offer is an offer as above.

One NIXL agent per transport, i.e. per process and role (a rank sends or receives, not both), made on
the first handoff. Memory is registered per handoff: the receive buffers are the ones the CE's
on_handoff gives (transfer.handoff.allocate_payload), the sender's the export's own tensors, both new
for every handoff. A sender keeps a receiver's agent loaded while a write to it is in flight and
drops it after the last one, so buffers the receiver has deregistered are never addressable from here
and a long-lived sender does not accumulate their descriptors.

The agents run without NIXL's progress thread (it polls with no delay: a whole core per rank, busy
or idle); a sender's wait polls its write, and a receiver drives its worker from a thread only while it
expects a write (UCX's message-based transports, tcp among them, need the target to make progress).

NOTE: after a failure, a buffer a write may still reach stays registered and referenced for
idle_timeout_s (the sender's bound on its own write) before it is released: a late one-sided write
into freed memory would corrupt whatever lives there next (UCX's shared-memory transports write
straight into the peer's address space). The same holds for a sender's source segments.

The nixl package is imported when the transport is made (`pip install 'pdserve[nixl]'`); without it,
making the transport raises HandoffError(TRANSPORT) naming the extra.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from transfer.config import NIXL_MISSING, NIXL_MODULES, TransferConfig
from transfer.errors import PROTOCOL, TIMEOUT, TRANSPORT, HandoffError
from transfer.handoff import HandoffHeader
from transfer.messages import Written
from transfer.transport import Transport
from transfer.wire import Channel

log = logging.getLogger(__name__)
POLL_S = 100e-6  # how often a worker thread asks whether the write is done


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
        self._held: dict[int, tuple[Any, list[torch.Tensor]]] = {}  # registrations kept after a failure

    def register(self, segments: list[torch.Tensor], mem: str, device: int) -> Any:
        return self.agent.register_memory([(*d, "") for d in _descs(segments, device)], mem)

    def deregister(self, reg: Any) -> None:
        try:
            self.agent.deregister_memory(reg)
        except Exception as e:  # the agent's own bookkeeping; nothing a peer can do about it
            log.warning("nixl: deregistering memory failed: %r", e)

    def hold(self, reg: Any, segments: list[torch.Tensor], delay_s: float) -> None:
        """Keeps reg registered and segments alive for delay_s (a write may still reach them)."""
        key = id(reg)
        with self._lock:
            self._held[key] = (reg, segments)

        def release() -> None:
            with self._lock:
                held = self._held.pop(key, None)
            if held is not None:
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

    def connect(self, metadata: bytes) -> str:
        """Loads a receiver's metadata (its agent and the buffers it registered); counts a write to it."""
        with self._lock:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[name] = self._peers.get(name, 0) + 1
            return name

    def disconnect(self, name: str) -> None:
        """A write to name has ended; the last one in flight drops the remote agent and what it named."""
        with self._lock:
            self._peers[name] -= 1
            if self._peers[name] == 0:
                del self._peers[name]
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as e:
                    log.warning("nixl: dropping remote agent %s failed: %r", name, e)

    def progress_while(self) -> threading.Event:
        """Drives the agent's UCX worker from a thread until the returned event is set: the side a write
        lands on must make progress for transports that carry it in messages (UCX's tcp), and the agent
        runs no progress thread of its own (NIXL's spins a core whether or not anything moves)."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(POLL_S):
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
            self.deregister(reg)


class NixlTransport(Transport):
    name = "nixl"
    carries_parts = True
    writes_parts = True  # a streamed handoff's parts: written into the buffer its open registered

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._api = load_nixl()
        self._agent: _Agent | None = None
        self._agent_lock = threading.Lock()
        self._landing: dict[int, tuple[Any, list[torch.Tensor]]] = {}  # receiver: by id of the segments
        self._streams: dict[int, tuple[Any, torch.Tensor, threading.Event]] = {}  # receiver: by id of the pages

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

    # ---- sender --------------------------------------------------------------------------------

    async def offer(self, ch: Channel, segments: list[torch.Tensor]) -> dict[str, Any]:
        _descs(segments, _mem_type(segments)[1])  # refused before the receiver reserves anything
        return {}

    async def push(self, ch: Channel, segments: list[torch.Tensor], ready: dict[str, Any]) -> None:
        metadata, remote_mem, remote = _read_ready(ready, len(segments))
        for (_, n, _), t in zip(remote, segments):
            if n != t.numel() * t.element_size():
                raise HandoffError(PROTOCOL, f"nixl: a receive buffer of {n} bytes for a {t.numel() * t.element_size()}-byte segment")
        await self._push(ch, segments, metadata, (remote_mem, remote))
        await ch.send(Written(sum(n for _, n, _ in remote)))

    async def write_part(self, ch: Channel, pages: torch.Tensor, offset: int, opened: dict[str, Any]) -> None:
        metadata, remote_mem, ((addr, size, device),) = _read_ready(opened, 1)
        page_bytes = pages[0].numel() * pages.element_size()
        start, n = offset * page_bytes, pages.numel() * pages.element_size()
        if start + n > size:
            raise HandoffError(PROTOCOL, f"nixl: pages [{offset}, {offset + pages.shape[0]}) beyond a {size}-byte stream buffer")
        await self._push(ch, [pages], metadata, (remote_mem, [(addr + start, n, device)]))

    async def _push(
        self, ch: Channel, segments: list[torch.Tensor], metadata: bytes, remote: tuple[str, list[tuple[int, int, int]]]
    ) -> None:
        """Writes segments into the receiver's buffers remote (memory type, descriptors) and waits for it."""
        mem, device = _mem_type(segments)
        produced = None
        if mem == "VRAM":
            produced = torch.cuda.Event()  # NOTE: recorded on the export's producer stream
            produced.record(torch.cuda.current_stream(segments[0].device))
        await ch.run_blocking(self.executor, self._write, segments, (mem, device), metadata, remote, produced)

    def _write(
        self,
        segments: list[torch.Tensor],
        local: tuple[str, int],
        metadata: bytes,
        remote: tuple[str, list[tuple[int, int, int]]],
        produced: Any,
    ) -> None:
        """Registers segments (local: their memory type and device), writes them into the receiver's
        buffers (remote: their memory type and descriptors) and waits for the write (worker thread).
        Raises HandoffError(TRANSPORT | TIMEOUT)."""
        agent = self.agent()
        mem, device = local
        if produced is not None:
            produced.synchronize()
        deadline = time.monotonic() + self.config.idle_timeout_s
        try:
            reg = agent.register(segments, mem, device)
        except Exception as e:
            raise HandoffError(TRANSPORT, f"nixl: registering the payload failed: {e!r}") from None
        in_flight = False  # a write NIXL could not release may still read the segments
        try:
            try:
                peer = agent.connect(metadata)
            except Exception as e:
                raise HandoffError(
                    TRANSPORT, f"nixl: the receiver's agent metadata did not load: {e!r}"
                ) from None
            a, src, handle = agent.agent, _descs(segments, device), None
            try:
                handle = _nixl_call(peer, lambda: a.initialize_xfer(
                    "WRITE", a.get_xfer_descs(src, mem), a.get_xfer_descs(remote[1], remote[0]), peer
                ))  # fmt: skip
                self._wait(agent, handle, peer, deadline)
            finally:
                if handle is not None:
                    in_flight = not agent.release(handle, peer)
                agent.disconnect(peer)
        finally:
            if in_flight:
                agent.hold(reg, segments, self.config.idle_timeout_s)
            else:
                agent.deregister(reg)

    def _wait(self, agent: _Agent, handle: Any, peer: str, deadline: float) -> None:
        """Posts the write and polls it to its end; raises HandoffError(TRANSPORT | TIMEOUT)."""
        a = agent.agent
        state = _nixl_call(peer, a.transfer, handle)
        while state == "PROC":
            if time.monotonic() > deadline:
                raise HandoffError(
                    TIMEOUT,
                    f"nixl: the write to {peer} did not complete within {self.config.idle_timeout_s:g} s",
                )
            time.sleep(POLL_S)
            state = _nixl_call(peer, a.check_xfer_state, handle)
        if state != "DONE":
            raise HandoffError(TRANSPORT, f"nixl: the write to {peer} failed ({state})")

    # ---- receiver ------------------------------------------------------------------------------

    async def accept(
        self, ch: Channel, header: HandoffHeader, extra: dict[str, Any], segments: list[torch.Tensor]
    ) -> dict[str, Any]:
        if extra:
            raise HandoffError(PROTOCOL, f"nixl: unexpected offer fields {sorted(map(str, extra))[:8]}")
        mem, device = _mem_type(segments)
        descs = _descs(segments, device)
        reg, metadata = await asyncio.get_running_loop().run_in_executor(
            self.executor, self._register_landing, segments, mem, device
        )
        self._landing[id(segments)] = (reg, segments)
        return {"agent": metadata, "mem": mem, "descs": [list(d) for d in descs]}

    def _register_landing(self, segments: list[torch.Tensor], mem: str, device: int) -> tuple[Any, bytes]:
        agent = self.agent()
        try:
            reg = agent.register(segments, mem, device)
        except Exception as e:
            raise HandoffError(TRANSPORT, f"nixl: registering the receive buffers failed: {e!r}") from None
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
        segments: list[torch.Tensor],
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
            if done:
                agent.deregister(reg)
            else:  # NOTE: the sender's write may still land in these buffers
                agent.hold(reg, segments, self.config.idle_timeout_s)
        return None  # the receiver hashes the buffers where they are

    async def open_stream(self, ch: Channel, header: HandoffHeader, pages: torch.Tensor) -> dict[str, Any]:
        """Registers a streamed handoff's whole page buffer; the parts are written into it and the
        worker driven until end_stream."""
        mem, device = _mem_type([pages])
        descs = _descs([pages], device)
        reg, metadata = await asyncio.get_running_loop().run_in_executor(
            self.executor, self._register_landing, [pages], mem, device
        )
        self._streams[id(pages)] = (reg, pages, self.agent().progress_while())
        return {"agent": metadata, "mem": mem, "descs": [list(d) for d in descs]}

    def end_stream(self, pages: torch.Tensor, *, clean: bool) -> None:
        stream = self._streams.pop(id(pages), None)
        if stream is None:
            return
        reg, _, progress = stream
        progress.set()
        if clean:
            self.agent().deregister(reg)
        else:  # NOTE: a part's write may still land in pages
            self.agent().hold(reg, [pages], self.config.idle_timeout_s)

    def abandon(self, segments: list[torch.Tensor]) -> None:
        """Deregisters buffers accept registered whose pull never ran (the handoff failed before ready
        went out: the sender never learnt where they are)."""
        landing = self._landing.pop(id(segments), None)
        if landing is not None and self._agent is not None:  # NOTE: ready may have gone out after all
            self._agent.hold(landing[0], segments, self.config.idle_timeout_s)

    def close(self) -> None:
        for reg, _ in self._landing.values():
            if self._agent is not None:
                self._agent.deregister(reg)
        self._landing.clear()
        for reg, _, progress in self._streams.values():
            progress.set()
            if self._agent is not None:
                self._agent.deregister(reg)
        self._streams.clear()
        if self._agent is not None:
            self._agent.close()


def _nixl_call(peer: str, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), NIXL's own errors (nixlBackendError, nixlRemoteDisconnectError, ...) as HandoffError."""
    try:
        return fn(*args)
    except Exception as e:
        raise HandoffError(TRANSPORT, f"nixl: the write to {peer} failed: {e!r}") from None


def _read_ready(ready: dict[str, Any], count: int) -> tuple[bytes, str, list[tuple[int, int, int]]]:
    """The receiver's agent metadata, memory type and count buffer descriptors from its ready fields.
    Raises HandoffError(PROTOCOL)."""
    metadata, their_mem, descs = ready.get("agent"), ready.get("mem"), ready.get("descs")
    if not isinstance(metadata, bytes) or not metadata or set(ready) != {"agent", "mem", "descs"}:
        raise HandoffError(PROTOCOL, f"nixl: a ready without agent metadata (fields {sorted(map(str, ready))[:8]})")
    if their_mem not in ("DRAM", "VRAM"):
        raise HandoffError(PROTOCOL, "nixl: a ready with an unknown memory type")
    if not isinstance(descs, list) or len(descs) != count:
        raise HandoffError(PROTOCOL, f"nixl: a ready naming other than {count} buffers")
    remote = []
    for d in descs:
        if not (isinstance(d, list) and len(d) == 3 and all(isinstance(x, int) and x >= 0 for x in d)):
            raise HandoffError(PROTOCOL, "nixl: a malformed buffer descriptor in ready")
        remote.append((d[0], d[1], d[2]))
    return metadata, their_mem, remote
