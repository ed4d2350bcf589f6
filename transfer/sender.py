"""KVSender: the PE rank's end of the handoff.

send() returns an Ack only once the receiver has verified the payload and its engine has taken the
sequence; until then the PE must keep the sequence's KV (and, for ipc, the exported tensors: the
receiver reads them in place). Every other outcome raises HandoffError: refused (auth, layout,
unexpected), failed (checksum, incomplete, rejected) or timed out. After a timeout the receiver may
still have taken the sequence (its ack was lost): the coordinator's abort of the request frees it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.engine import SequenceExport
from engine.kv_cache import KVLayout
from engine.request import TokenLogprob
from transfer.auth import client_handshake
from transfer.config import TransferConfig
from transfer.errors import LAYOUT, PROTOCOL, STALE, TIMEOUT, TRANSPORT, HandoffError
from transfer.handoff import HandoffHeader, check_layout, layout_from_fields, make_header, payload_segments
from transfer.ipc import IpcTransport
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
    checksum_s: float  # the header: the sender's checksum (or reading the export's recorded sums)
    recv_s: float  # the receiver's payload phase
    verify_s: float  # the receiver's checksum (0 when hashed on the way in)
    connect_s: float = 0.0  # TCP connect and the auth handshake
    offer_s: float = 0.0  # the transport's offer fields (ipc: handles) and sending the offer
    ready_wait_s: float = 0.0  # offer sent to ready received (the receiver's checks and buffers)
    push_s: float = 0.0  # the transport's push (tcp: the payload; ipc: nothing)
    ack_wait_s: float = 0.0  # push done to ack received (ipc: the receiver's copy and checks)

    @property
    def phases(self) -> dict[str, float]:
        """The sender's phases by name, in order."""
        names = ("checksum_s", "connect_s", "offer_s", "ready_wait_s", "push_s", "ack_wait_s")
        return {n.removesuffix("_s"): getattr(self, n) for n in names}


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
            output_logprobs = getattr(export, "output_logprobs", ())
        try:
            return await asyncio.wait_for(self._send(addr, export, tuple(output_logprobs or ()), t0), timeout)
        except asyncio.TimeoutError:
            raise HandoffError(
                TIMEOUT, f"no ack from {addr} for {export.request_id!r} within {timeout:.1f} s"
            ) from None

    async def _send(
        self, addr: str, export: SequenceExport, logprobs: tuple[TokenLogprob, ...], t0: float
    ) -> Ack:
        loop = asyncio.get_running_loop()
        segments = payload_segments(export, self.layout)
        header = await loop.run_in_executor(
            self.transport.executor, make_header, export, self.layout, self.model, logprobs
        )
        checksum_s = time.perf_counter() - t0
        for attempt in range(2):
            try:
                async with self.transport.session(addr):
                    return await self._handoff(addr, header, segments, t0, checksum_s)
            except HandoffError as e:
                if e.code != STALE or attempt:
                    raise
                self.transport.forget(addr)  # the receiver lost our communicator: bootstrap again
        raise AssertionError("unreachable")

    async def _handoff(
        self, addr: str, header: HandoffHeader, segments: list[torch.Tensor], t0: float, checksum_s: float
    ) -> Ack:
        marks = [time.perf_counter()]  # the end of each phase
        ch = await self._connect(addr)
        try:
            ok = await client_handshake(ch, self.token, self.sender_id)
            theirs = layout_from_fields(ok.get("layout") or {})
            try:
                check_layout(header, theirs, str(ok.get("model", "")))
            except HandoffError as e:
                raise HandoffError(
                    LAYOUT, f"the receiver at {addr} serves another engine: {e.message}"
                ) from None
            marks.append(time.perf_counter())
            extra = await self.transport.offer(ch, segments)
            await ch.send(
                {"t": "offer", "transport": self.transport.name, "header": header.encode(), "extra": extra}
            )
            marks.append(time.perf_counter())
            ready = await ch.expect("ready")
            marks.append(time.perf_counter())
            await self.transport.push(ch, segments, ready)
            marks.append(time.perf_counter())
            ack = await ch.expect("ack")
            marks.append(time.perf_counter())
            if ack.get("request_id") != header.request_id:
                raise HandoffError(PROTOCOL, f"ack for {ack.get('request_id')!r}, sent {header.request_id!r}")
            connect_s, offer_s, ready_wait_s, push_s, ack_wait_s = (b - a for a, b in zip(marks, marks[1:]))
            return Ack(
                request_id=header.request_id,
                transport=self.transport.name,
                payload_bytes=header.payload_bytes,
                elapsed_s=marks[-1] - t0,
                checksum_s=checksum_s,
                recv_s=float(ack.get("recv_s", 0.0)),
                verify_s=float(ack.get("verify_s", 0.0)),
                connect_s=connect_s,
                offer_s=offer_s,
                ready_wait_s=ready_wait_s,
                push_s=push_s,
                ack_wait_s=ack_wait_s,
            )
        finally:
            ch.close()

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
    ) -> Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor | None] | None:
        """Where exports for this sender's transport should be gathered (engine.export_sequence's
        alloc): the ipc transport's exported arena; None for the others (new memory)."""
        if isinstance(self.transport, IpcTransport) and self.config.ipc_arena_bytes > 0:
            return self.transport.allocate
        return None

    def close(self) -> None:
        self.transport.close()
