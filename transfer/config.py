"""TransferConfig: how a PE sends and a CE receives handoffs (one per process, shared by both ends)."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.checksum import CHUNK_BYTES

TRANSPORT_NAMES = ("tcp", "nccl", "ipc")


@dataclass(frozen=True)
class TransferConfig:
    transport: str = "tcp"  # what a sender uses: tcp | nccl | ipc
    accept_transports: tuple[str, ...] = TRANSPORT_NAMES  # what a receiver takes
    send_timeout_s: float = 120.0  # a whole send, connect to ack; keep the PE's lease longer than this
    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 10.0  # receiver: hello to offer; a silent peer is dropped after this
    idle_timeout_s: float = 30.0  # payload: this long without progress fails the handoff
    # an authenticated connection carries one handoff after another: the receiver closes one idle for
    # keepalive_s, a sender reuses one only while it has been idle less than half of that
    keepalive_s: float = 60.0
    chunk_bytes: int = 8 << 20  # TCP: bytes per send/recv call and per pinned staging buffer (x2)
    max_workers: int = 8  # threads for blocking payload I/O, checksums and NCCL/IPC waits
    # ipc sender: a device buffer exported once that exports are gathered into (0: none; every
    # handoff then exports its tensors' own handles). Allocated on the first ipc export.
    ipc_arena_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        names = (self.transport, *self.accept_transports)
        if any(n not in TRANSPORT_NAMES for n in names):
            raise ValueError(f"transports must be among {TRANSPORT_NAMES}, got {names}")
        if (
            min(
                self.send_timeout_s,
                self.connect_timeout_s,
                self.handshake_timeout_s,
                self.idle_timeout_s,
                self.keepalive_s,
            )
            <= 0
        ):
            raise ValueError("timeouts must be > 0")
        if self.chunk_bytes < CHUNK_BYTES or self.chunk_bytes % CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be a positive multiple of {CHUNK_BYTES} (the checksum chunk)")
        if self.ipc_arena_bytes < 0:
            raise ValueError("ipc_arena_bytes must be >= 0")
        if self.max_workers < 1:
            raise ValueError("max_workers must be >= 1")
