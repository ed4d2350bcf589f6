"""TransferConfig: how a PE sends and a CE receives handoffs (one per process, shared by both ends).

Every setting is one field with its default, type and help (metadata "help": pd/flags.py makes the
`python -m pd.server` flags from them; a P/D rank receives it inside its RoleConfig through the codec).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from pdkernels.checksum import CHUNK_BYTES
from transfer.transports import TRANSPORTS, names_where

# the transports, from their one table (transfer/transports.py; nixl: the optional extra pdserve[nixl])
TRANSPORT_NAMES = tuple(TRANSPORTS)
STREAM_CHOICES = ("auto", "on", "off")
STREAM_TRANSPORTS = names_where(lambda c: c.streams)  # those that carry a streamed handoff's parts
GiB = 1 << 30
MiB = 1 << 20
NIXL_ARENA_MB = {"cpu": 256, "cuda": 2048}  # nixl_arena_mb's default, by the memory the arena is in
MAX_TCP_STREAMS = 64  # per control connection; a receiver refuses more
# what --transport nixl needs; the wheels' import names (the `nixl` package picks one of them)
NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
NIXL_MISSING = "the nixl transport (--transport nixl) needs NIXL: pip install 'pdserve[nixl]' (the nixl-cu12 wheel, UCX included)"


def nixl_installed() -> bool:
    """Whether a NIXL wheel is installed (looked up, not imported)."""
    return any(importlib.util.find_spec(m) is not None for m in NIXL_MODULES)


@dataclass(frozen=True)
class TransferConfig:
    transport: str = field(
        default="tcp", metadata={"help": "prefill: the KV transport it sends with", "choices": TRANSPORT_NAMES}
    )
    accept_transports: tuple[str, ...] = field(
        default=TRANSPORT_NAMES, metadata={"help": "decode: the transports its receivers take", "choices": TRANSPORT_NAMES}
    )
    send_timeout_s: float = field(
        default=120.0, metadata={"help": "a whole send, connect to ack; keep the prefill engine's lease longer than this"}
    )
    connect_timeout_s: float = field(default=5.0, metadata={"help": "prefill: connecting to a decode engine's receiver"})
    handshake_timeout_s: float = field(
        default=10.0, metadata={"help": "decode: auth_ok to the first offer; a silent peer is dropped after this"}
    )
    auth_timeout_s: float = field(
        default=5.0, metadata={"help": "decode: a KV peer must authenticate within this, or is dropped"}
    )
    # At most max_connections // 2 of them (at least 1) may be unauthenticated: a new connection past
    # that share closes the oldest unauthenticated one, so slow peers without the token neither hold
    # the slots the PEs' kept connections need nor keep a PE's new connection out for auth_timeout_s.
    max_connections: int = field(
        default=64,
        metadata={
            "help": "decode: KV connections a receiver holds at once (authenticated or not);"
            " more are closed at once",
            "flag": "kv-max-connections",  # --http-max-connections is the HTTP port's
        },
    )
    idle_timeout_s: float = field(
        default=30.0, metadata={"help": "this long without progress of a payload fails the handoff"}
    )
    # an authenticated connection carries one handoff after another: the receiver closes one idle for
    # keepalive_s, a sender reuses one only while it has been idle less than half of that
    keepalive_s: float = field(
        default=60.0, metadata={"help": "decode: closes a connection idle this long (a prefill engine reuses one up to half)"}
    )
    chunk_bytes: int = field(
        default=8 << 20,
        metadata={"help": "tcp: bytes per send/recv call and per pinned staging buffer (x2); a multiple of 1 MiB"},
    )
    # tcp: a kept connection to a receiver brings tcp_streams - 1 more authenticated connections (its
    # data connections, transfer/tcp.py) that a payload is striped over; 1: the payload on the
    # control connection alone, as the protocol has always carried it
    tcp_streams: int = field(
        default=1,
        metadata={
            "help": "prefill, tcp: sockets a payload is striped over (each one authenticated);"
            f" 1 to {MAX_TCP_STREAMS}",
            "flag": "kv-tcp-streams",
        },
    )
    # prefill: a long prompt's handoff overlaps its prefill (wire.py: open, parts, final offer): the pages
    # each chunk completes go while the next chunks compute; only the last page(s) and the SWA state
    # are left after the prefill. auto: on where the transport carries parts (Capabilities.streams:
    # STREAM_TRANSPORTS), off elsewhere
    stream: str = field(
        default="auto",
        metadata={
            "help": "prefill: send each prefill chunk's completed KV pages while the prompt is still being"
            f" prefilled; auto: on for {' and '.join(STREAM_TRANSPORTS)} (the transports that carry it),"
            " off for the others",
            "choices": STREAM_CHOICES,
            "flag": "kv-stream",
        },
    )
    max_workers: int = field(
        default=8, metadata={"help": "threads for blocking payload I/O, checksums and NCCL/IPC waits"}
    )
    # ipc sender: a device buffer exported once that exports are gathered into (0: none; every
    # handoff then exports its tensors' own handles). Allocated on the first ipc export.
    ipc_arena_gb: float = field(
        default=4.0, metadata={"help": "prefill, ipc: a GPU buffer exported once that exports are gathered into; 0: off"}
    )
    ipc_time_copies: bool = field(
        default=False,
        metadata={"help": "decode, ipc: time each copy on its stream (the ack's ipc_copy_gpu phase; costs host time)"},
    )
    # ipc: the PE's exports name their pages in its KV pool (exported once) and the CE copies them into
    # its reservation's pages: one device-to-device copy. copy_in: the PE gathers each export into the
    # arena, the CE copies it into a buffer of its own and the import into its pool (three copies)
    ipc_copy_in: bool = field(
        default=False,
        metadata={
            "help": "ipc: gather each export into the prefill engine's arena and land it in a decode buffer"
            " before the KV pool (default: the decode engine copies the prefill engine's pool pages"
            " straight into the reservation's pages)"
        },
    )
    # nixl: a buffer on each side registered with the NIXL agent once, on the device of the first
    # handoff's memory: the PE's exports are gathered into it, the CE's receive buffers taken from it.
    # A payload that does not fit registers its own memory for its handoff.
    nixl_arena_mb: int | None = field(
        default=None,
        metadata={
            "help": "nixl: MiB of a buffer on each end (the prefill engine's exports, the decode engine's"
            f" receive buffers) registered with NIXL once; default {NIXL_ARENA_MB['cpu']} in host memory,"
            f" {NIXL_ARENA_MB['cuda']} on a GPU; 0: off (every handoff registers its own memory)"
        },
    )

    nixl_copy_in: bool = field(
        default=False,
        metadata={
            "help": "decode, nixl: land each handoff in the receive buffer and copy it into the KV pool"
            " (default: the prefill engine writes straight into the reservation's pages, registered once)"
        },
    )

    def __post_init__(self) -> None:
        names = (self.transport, *self.accept_transports)
        if any(n not in TRANSPORT_NAMES for n in names):
            raise ValueError(f"transports must be among {TRANSPORT_NAMES}, got {names}")
        if self.transport == "nixl" and not nixl_installed():
            raise ValueError(NIXL_MISSING)
        if (
            min(
                self.send_timeout_s,
                self.connect_timeout_s,
                self.handshake_timeout_s,
                self.auth_timeout_s,
                self.idle_timeout_s,
                self.keepalive_s,
            )
            <= 0
        ):
            raise ValueError("timeouts must be > 0")
        if self.chunk_bytes < CHUNK_BYTES or self.chunk_bytes % CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be a positive multiple of {CHUNK_BYTES} (the checksum chunk)")
        if self.ipc_arena_gb < 0:
            raise ValueError(f"ipc_arena_gb must be >= 0, got {self.ipc_arena_gb}")
        if self.nixl_arena_mb is not None and self.nixl_arena_mb < 0:
            raise ValueError(f"nixl_arena_mb must be >= 0, got {self.nixl_arena_mb}")
        if self.max_workers < 1:
            raise ValueError("max_workers must be >= 1")
        if not 1 <= self.tcp_streams <= MAX_TCP_STREAMS:
            raise ValueError(f"tcp_streams must be in [1, {MAX_TCP_STREAMS}], got {self.tcp_streams}")
        if self.tcp_streams > 1 and self.transport != "tcp":
            raise ValueError(f"tcp_streams {self.tcp_streams} stripes tcp payloads; transport is {self.transport!r}")
        if self.stream not in STREAM_CHOICES:
            raise ValueError(f"stream must be one of {STREAM_CHOICES}, got {self.stream!r}")
        if self.stream == "on" and self.transport not in STREAM_TRANSPORTS:
            raise ValueError(
                f"--kv-stream on streams handoffs over {', '.join(STREAM_TRANSPORTS)}; transport is"
                f" {self.transport!r} (--kv-stream off or auto)"
            )
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")

    @property
    def streams_handoffs(self) -> bool:
        """Whether a prefill engine streams its handoffs (stream, resolved for the transport)."""
        return self.stream == "on" or (self.stream == "auto" and self.transport in STREAM_TRANSPORTS)

    @property
    def ipc_arena_bytes(self) -> int:
        return int(self.ipc_arena_gb * GiB)

    def nixl_arena_bytes(self, device_type: str) -> int:
        """The nixl arena's size in memory of device_type ("cpu" | "cuda"); 0: no arena."""
        mb = self.nixl_arena_mb if self.nixl_arena_mb is not None else NIXL_ARENA_MB.get(device_type, 0)
        return mb * MiB
