"""The transport interface: what moves a payload once the control connection has agreed on it.

The header and every control message go over the TCP control connection (wire.py) whatever the
transport; a transport moves only the payload bytes, and may add fields to the offer (sender) and the
ready (receiver) messages (Offer.extra, Ready.fields: transfer/messages.py), e.g. CUDA IPC handles or
an NCCL bootstrap id; it checks them itself.

    sender:   extra = offer(ch, segments)  -> [offer sent, ready received] -> push(ch, segments, ready)
    receiver: reply = accept(ch, header, extra, segments) -> [ready sent] -> pull(ch, header, extra, segments)

A transport may also say where the tensors it moves should live: export_allocator (the sender's
export gathered into memory it has exported or registered once: ipc, nixl) and receive_buffers (the
receiver's buffers, taken from memory registered once: nixl).

Transports are made by name (make_transport) from the table in transfer/transports.py, which names
each one, says where its class lives and what it can do (Capabilities, re-exported here); a module is
imported only when its transport is asked for, and none needs CUDA to import.
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Protocol

import torch

from engine.handoff import Alloc, PoolPages
from transfer.config import TransferConfig
from transfer.header import Buffer, HandoffHeader
from transfer.transports import TRANSPORTS, Capabilities
from transfer.wire import Channel, io_executor

__all__ = ["Capabilities", "KVPool", "Transport", "make_transport", "transport_class"]


class KVPool(Protocol):
    """A CE's KV pool, for a transport that writes a handoff's pages straight into the reservation's
    own pages (nixl): the memory it registers once, and where a handoff may land."""

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The pool's memory (pages, SWA state): what a one-sided transport registers, once."""

    def target(self, header: HandoffHeader, hold_s: float) -> list[Buffer] | None:
        """header's payload buffers in the reservation's own memory (pages as PoolPages in tensors[0],
        the state a slot of the state pool), or None where it may not land in place. From then on a
        write may land there until the receive ends, and for hold_s after it failed."""


class Transport(ABC):
    # Its key in TRANSPORTS and what it can do there: each class sets `name = "..."` and
    # `capabilities = TRANSPORTS[name].capabilities`, so both exist once, in that table.
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    # How the protocol runs with it (what it can do is in capabilities):
    # The receiver reads the payload where the sender keeps it (ipc): its pull starts before the
    # ready goes out, since the sender sends nothing after it. (Where the payload lands, in the
    # receiver's pool or not, is capabilities.in_place.)
    reads_in_place: ClassVar[bool] = False
    # capabilities.streams: a part's bytes follow its `part` message at once (push / pull of that part's
    # pages alone, no ready in between), unless the parts are written one-sided before their `part`
    # message goes (writes_parts, nixl): the open's ready says where (open_stream's fields), the sender
    # writes each part there (write_part), and the receiver only checks the bytes where they landed.
    writes_parts: ClassVar[bool] = False

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.executor = io_executor(config.max_workers)

    @property
    def num_data_connections(self) -> int:
        """Authenticated connections a sender opens beside each control connection for this
        transport's payloads (Channel.data; tcp: --kv-tcp-streams - 1)."""
        return 0

    # ---- sender side ---------------------------------------------------------------------------

    def export_allocator(self) -> Alloc | None:
        """Where exports for this transport should be gathered (engine.export_sequence's alloc: a tensor,
        or None for new memory), or None if it has no memory of its own for them."""
        return None

    @contextlib.asynccontextmanager
    async def session(self, peer: str) -> AsyncIterator[None]:
        """Held by the sender from offer to ack (NCCL: one handoff at a time per communicator)."""
        yield

    def reads_pool_pages(self) -> bool:
        """Whether exports for this transport may leave their pages in the engine's KV pool (PoolPages:
        engine.export_sequence(pages_in_place=True), no gather): its receiver reads them there (ipc)."""
        return False

    def carried(self, segments: list[Buffer]) -> list[Buffer]:
        """segments as this transport carries them (what offer and push get): pages in a pool that it
        cannot read there gathered into a tensor of their own."""
        return [t.gather() if isinstance(t, PoolPages) else t for t in segments]

    def offers_unwritten(self, segments: list[Buffer]) -> bool:
        """Whether this offer may go before the export's writes to segments are done (its receiver
        waits for them on the device: ipc's exported event), so the checksum follows the offer."""
        return False

    async def offer(self, ch: Channel, segments: list[Buffer]) -> dict[str, Any]:
        """Transport fields for the offer message. Raises HandoffError(TRANSPORT) if it cannot carry these."""
        return {}

    @abstractmethod
    async def push(self, ch: Channel, segments: list[Buffer], ready: dict[str, Any]) -> None:
        """Moves the payload after the receiver is ready; raises HandoffError."""

    async def write_part(self, ch: Channel, pages: torch.Tensor, offset: int, opened: dict[str, Any]) -> None:
        """writes_parts: writes pages at page offset of the receiver's stream buffer (opened: its open's
        ready fields) and returns once they are there; raises HandoffError."""
        raise NotImplementedError

    def forget(self, peer: str) -> None:
        """Drops per-peer state (an NCCL communicator the receiver no longer knows)."""
        return None

    # ---- receiver side -------------------------------------------------------------------------

    def receive_buffers(
        self, header: HandoffHeader, device: torch.device, pool: KVPool | None = None
    ) -> list[Buffer] | None:
        """Buffers on device for header's payload (allocate_payload's shapes) in memory this transport
        has prepared once, or None (the receiver allocates them: transfer.handoff.allocate_payload).
        pool: the receiving engine's KV pool, for a transport that lands a payload in place there."""
        return None

    async def accept(
        self, ch: Channel, header: HandoffHeader, extra: dict[str, Any], segments: list[Buffer]
    ) -> dict[str, Any]:
        """Checks the offer's transport fields before ready; returns fields for the ready message."""
        return {}

    async def open_stream(self, ch: Channel, header: HandoffHeader, pages: Buffer) -> dict[str, Any]:
        """writes_parts: makes pages (a streamed handoff's whole page buffer) writable by the sender;
        returns the open's ready fields. Held until end_stream."""
        return {}

    def end_stream(self, pages: Buffer, *, clean: bool) -> None:
        """writes_parts: the stream's parts are over (clean: every write the sender began has ended;
        else one may still land in pages)."""
        return None

    def abandon(self, segments: list[Buffer]) -> None:
        """Undoes accept for segments whose pull will not run (the handoff failed in between)."""
        return None

    def channel_closed(self, ch: Channel) -> None:
        """A sender's control connection to this receiver ended (what the transport keeps for that
        sender's handoffs alone may go: ipc's mappings of its memory)."""
        return None

    @abstractmethod
    async def pull(
        self,
        ch: Channel,
        header: HandoffHeader,
        extra: dict[str, Any],
        segments: list[Buffer],
        *,
        phases: dict[str, float] | None = None,
    ) -> int | None:
        """Fills segments with the payload; returns its checksum if computed on the way, else None.
        phases, if given, takes the seconds of the pull's own steps by name (the receiver's ack)."""

    def close(self) -> None:
        """Releases what the transport holds (communicators, staging buffers)."""
        return None


def transport_class(name: str) -> type[Transport]:
    """The class registered under name in TRANSPORTS (its module imported now, if it was not yet)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(TRANSPORTS)}")
    module, cls = TRANSPORTS[name].cls.split(":")
    transport_cls: type[Transport] = getattr(importlib.import_module(module), cls)
    return transport_cls


def make_transport(name: str, config: TransferConfig, **kw: Any) -> Transport:
    """The transport registered under name (a key of TRANSPORTS); kw go to its constructor (a test passes
    a fake NCCL or IPC backend this way)."""
    return transport_class(name)(config, **kw)
