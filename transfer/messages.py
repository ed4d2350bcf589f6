"""The handoff's control messages (the flow is drawn in wire.py): one frozen dataclass each.

On the wire a message is the msgpack map `{"t": TYPE, **to_wire(msg)}`, sent by Channel.send and
read by Channel.expect(cls), which decode with the one strict codec (engine/codec.py): an unknown or
missing field or a wrong type is a HandoffError(PROTOCOL), never a key read with a default.

What a transport adds travels as plain maps that the transport itself checks (Offer.extra: nccl's
communicator key and bootstrap id, ipc's host and CUDA IPC handles or arena offsets, tcp's number of
sockets when it stripes; Ready.fields: nixl's agent metadata and the buffers' descriptors): their shapes
belong to the transport, not to this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Hello:
    """R -> S, first: the receiver's protocol version and its challenge."""

    TYPE: ClassVar[str] = "hello"
    v: int
    nonce: bytes


@dataclass(frozen=True)
class Auth:
    """S -> R: the sender's id, its own challenge and its answer to the receiver's (auth.py)."""

    TYPE: ClassVar[str] = "auth"
    v: int
    sender: str
    nonce: bytes
    mac: bytes


@dataclass(frozen=True)
class AuthOk:
    """R -> S: the receiver's answer to the sender's challenge, and the engine it serves (its model
    fingerprint and KVLayout.fields(), which transfer.handoff.peer_layout reads)."""

    TYPE: ClassVar[str] = "auth_ok"
    mac: bytes
    model: str
    layout: dict[str, Any]


@dataclass(frozen=True)
class Streams:
    """S -> R, first after auth_ok on a control connection that stripes tcp payloads
    (--kv-tcp-streams N > 1): its N-1 data connections, each already sent its Join with this key."""

    TYPE: ClassVar[str] = "streams"
    key: bytes
    count: int


@dataclass(frozen=True)
class Join:
    """S -> R, first after auth_ok on a data connection: the key of the control connection it
    carries payload bytes for, and its place (0-based) among that one's data connections."""

    TYPE: ClassVar[str] = "join"
    key: bytes
    index: int


@dataclass(frozen=True)
class Offer:
    """S -> R, per handoff: the encoded HandoffHeader, the transport and its fields."""

    TYPE: ClassVar[str] = "offer"
    transport: str
    header: bytes
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Open:
    """S -> R: a streamed handoff begins while its prompt is still being prefilled (--kv-stream).
    header: the encoded HandoffHeader as far as it is known then (stream_plan(): the first token a
    placeholder, no logprobs, the checksum following), which the receiver checks and sizes its
    buffers by; `part`s of its pages follow, then the offer of the rest, whose header is the handoff's."""

    TYPE: ClassVar[str] = "open"
    transport: str
    header: bytes


@dataclass(frozen=True)
class Part:
    """S -> R, after an open's ready: the pages [first_page, first_page + num_pages) of the sequence
    follow as payload bytes (checksum: payload_checksum of those pages alone; extra: the transport's
    offer fields for them)."""

    TYPE: ClassVar[str] = "part"
    first_page: int
    num_pages: int
    checksum: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class KeepAlive:
    """S -> R, during a streamed handoff while no part is due (the sender's next chunk still computes):
    the sender is alive, so the receiver's wait for the next message starts again."""

    TYPE: ClassVar[str] = "keepalive"


@dataclass(frozen=True)
class Ids:
    """S -> R, right after an offer whose header announces a long prompt's ids: them, packed."""

    TYPE: ClassVar[str] = "ids"
    ids: bytes


@dataclass(frozen=True)
class Sum:
    """S -> R, after the offer (and its ids) of a header whose checksum follows: the payload's
    checksum, sent once the export's gather has computed it."""

    TYPE: ClassVar[str] = "sum"
    request_id: str
    checksum: int


@dataclass(frozen=True)
class Ready:
    """R -> S: the receive buffers are ready; the payload may go (fields: the transport's)."""

    TYPE: ClassVar[str] = "ready"
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Written:
    """S -> R, after ready, from a transport that writes into the receiver's buffers itself (nixl):
    the write has completed on the sender's side; payload_bytes, what it wrote."""

    TYPE: ClassVar[str] = "written"
    payload_bytes: int


@dataclass(frozen=True)
class HandoffAck:
    """R -> S: the payload was verified and the engine took the sequence; where the receiver's time
    went (phases: its steps by name, in seconds)."""

    TYPE: ClassVar[str] = "ack"
    request_id: str
    payload_bytes: int
    recv_s: float
    verify_s: float
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Nack:
    """Either way: the handoff (or the connection) failed; code is a transfer.errors code. The sender
    of a nack closes the connection."""

    TYPE: ClassVar[str] = "nack"
    code: str
    reason: str


ControlMessage = (
    Hello
    | Auth
    | AuthOk
    | Streams
    | Join
    | Offer
    | Open
    | Part
    | KeepAlive
    | Ids
    | Sum
    | Ready
    | Written
    | HandoffAck
    | Nack
)
TYPES: dict[str, type[ControlMessage]] = {
    c.TYPE: c
    for c in (Hello, Auth, AuthOk, Streams, Join, Offer, Open, Part, KeepAlive, Ids, Sum, Ready, Written, HandoffAck, Nack)
}
