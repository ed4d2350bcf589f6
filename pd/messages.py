"""Typed messages between the P/D processes: frozen dataclasses, encoded through the one strict codec
(engine/codec.py), never pickled.

A rank message is msgpack of `{"v": PROTOCOL_VERSION, "type": <TYPE>, **to_wire(msg)}` and decodes with
from_wire(its class, the rest): an unknown or missing field, a wrong type (a bool for an int, a string
for a list) or a value out of range is a MessageError, never a silently dropped key. A peer refuses
another version outright rather than guessing at a layout it does not know.

    HTTP process ── AddRequest / AbortRequests / Shutdown ──────────────► rank
    HTTP process ◄── RankReady / StepOutputs / RequestRejected / RankStats / RankFatal ── rank

P/D roles add (pd/rank/decode_role.py, pd/rank/prefill_role.py):

    CE coordinator ── Reserve ──► CE rank ── Reserved ──► (then StepOutputs as for AddRequest)
    PE server      ── Prefill ──► PE rank ── PrefillResult ──► (one per Prefill)

and between hosts, CE coordinator -> PE server, POST /prefill (JSON of to_wire; pd/disagg/prefill_client.py):

    PrefillBody ──► PE server ── PrefillReply (200) or OpenAI's error object

Version 2: nested values are the codec's maps (a TokenLogprob is {token_id, logprob, top}, it was a
positional list), and every field is checked on decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from engine.codec import WireError, from_wire, to_wire
from engine.errors import InvalidRequestError
from engine.request import RequestOutput, SamplingParams, check_seed

PROTOCOL_VERSION = 2


class MessageError(ValueError):
    """Bytes that are not a message of this protocol version. `field`: the offending field's path, if
    one is to blame ("params.top_k")."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def _held(num_held_tokens: int, num_prompt_tokens: int) -> None:
    if not 0 <= num_held_tokens <= num_prompt_tokens:
        raise InvalidRequestError(
            f"receiver_held_tokens must be in [0, {num_prompt_tokens}], got {num_held_tokens}", "receiver_held_tokens"
        )


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise InvalidRequestError(f"{name} must be a positive number, got {value!r}", name)


@dataclass(frozen=True)
class AddRequest:
    TYPE: ClassVar[str] = "add"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    use_prefix_cache: bool = True


@dataclass(frozen=True)
class Reserve:
    """CE: hold KV memory for a sequence of num_tokens that a handoff will bring (granted in arrival
    order when memory frees: Reserved), and count num_commit_tokens (prompt + max_tokens) against the
    pool so the sequence can decode to its end without preempting anyone. Dropped after ttl_s if no
    handoff has arrived by then (the request ends with an error)."""

    TYPE: ClassVar[str] = "reserve"
    request_id: str
    num_tokens: int
    num_commit_tokens: int
    ttl_s: float
    token_ids: tuple[int, ...] = ()  # the prompt: what the rank's decode cache may hold pages of already

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise InvalidRequestError(f"num_tokens must be >= 1, got {self.num_tokens}", "num_tokens")
        if self.num_commit_tokens < self.num_tokens:
            raise InvalidRequestError(
                f"num_commit_tokens {self.num_commit_tokens} < num_tokens {self.num_tokens}", "num_commit_tokens"
            )
        _positive("ttl_s", self.ttl_s)


@dataclass(frozen=True)
class Reserved:
    """CE rank: the reservation is held; the receiver now takes this request's handoff."""

    TYPE: ClassVar[str] = "reserved"
    request_id: str
    num_held_tokens: int = 0  # leading tokens whose pages the rank holds (decode cache): not to be sent


@dataclass(frozen=True)
class Prefill:
    """PE: prefill, sample the first token, hand the sequence to the KV receiver at `receiver`
    ("host:port") within lease_s, then free it. seed None: the engine draws one (it travels along)."""

    TYPE: ClassVar[str] = "prefill"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    receiver: str
    lease_s: float
    use_prefix_cache: bool = True
    seed: int | None = None
    receiver_held_tokens: int = 0  # the receiver holds these leading tokens' pages: send from there on

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids must not be empty", "prompt_token_ids")
        _positive("lease_s", self.lease_s)
        check_seed(self.seed)
        _held(self.receiver_held_tokens, len(self.prompt_token_ids))


@dataclass(frozen=True)
class PrefillResult:
    """PE rank: how a Prefill ended. is_handed_off: the CE acknowledged the handoff. Otherwise either
    `output` is set (the first token already finished the request: nothing to hand off) or `code`
    says what failed (a transfer.errors code, "aborted", "rejected")."""

    TYPE: ClassVar[str] = "prefill_result"
    request_id: str
    is_handed_off: bool
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prefill_s: float = 0.0  # Prefill received -> first token sampled (queue on the PE included)
    transfer_s: float = 0.0  # export + send until the CE's ack
    payload_bytes: int = 0
    transport: str = ""
    skipped_tokens: int = 0  # leading tokens not sent: the receiver held their pages
    transfer_after_prefill_s: float = 0.0  # first token sampled -> the CE's ack (what the handoff adds to TTFT)
    streamed_pages: int = 0  # pages sent in parts while the prompt was prefilled (--kv-stream)
    early_pages: int = 0  # of them, pages whose bytes had gone when the prefill ended
    code: str | None = None
    message: str = ""
    output: RequestOutput | None = None


@dataclass(frozen=True)
class AbortRequests:
    TYPE: ClassVar[str] = "abort"
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class RankReady:
    """The rank built its engine and takes requests."""

    TYPE: ClassVar[str] = "ready"
    rank: int
    pid: int
    model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    device: str
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepOutputs:
    """What one engine step produced, for every request that has news, plus fresh engine stats."""

    TYPE: ClassVar[str] = "outputs"
    outputs: tuple[RequestOutput, ...]
    stats: dict[str, Any] | None = None
    queue_times_s: dict[str, float] = field(default_factory=dict)  # request id -> wait before its first step


@dataclass(frozen=True)
class RequestRejected:
    """The engine refused an AddRequest: the request's fault (InvalidRequestError: a 400, `param` names the
    request field), or is_internal: an unexpected error while admitting it (a 500 with a generic message;
    the rank's log has the error under the request's id)."""

    TYPE: ClassVar[str] = "rejected"
    request_id: str
    message: str
    param: str | None = None
    is_internal: bool = False


@dataclass(frozen=True)
class RankStats:
    """Engine stats sent while idle: doubles as a heartbeat."""

    TYPE: ClassVar[str] = "stats"
    stats: dict[str, Any]


@dataclass(frozen=True)
class RankFatal:
    """The engine failed; the rank process exits right after sending this."""

    TYPE: ClassVar[str] = "fatal"
    message: str


Message = (
    AddRequest
    | AbortRequests
    | Shutdown
    | RankReady
    | StepOutputs
    | RequestRejected
    | RankStats
    | RankFatal
    | Reserve
    | Reserved
    | Prefill
    | PrefillResult
)
_TYPES: dict[str, type[Message]] = {
    c.TYPE: c
    for c in (
        AddRequest,
        AbortRequests,
        Shutdown,
        RankReady,
        StepOutputs,
        RequestRejected,
        RankStats,
        RankFatal,
        Reserve,
        Reserved,
        Prefill,
        PrefillResult,
    )
}


def encode(msg: Message) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": msg.TYPE, **to_wire(msg)}, use_bin_type=True)


def decode(data: bytes) -> Message:
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise MessageError(f"undecodable message: {e}") from e
    if not isinstance(body, dict):
        raise MessageError("a message must be a map")
    version, kind = body.pop("v", None), body.pop("type", None)
    if version != PROTOCOL_VERSION:
        raise MessageError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {kind!r}")
    try:
        return from_wire(cls, body)
    except WireError as e:
        raise MessageError(f"malformed {cls.TYPE} message: {e}", e.field) from e


# ---- POST /prefill (JSON between hosts) -----------------------------------------------------------


@dataclass(frozen=True)
class PrefillBody:
    """What the CE coordinator POSTs to a PE's /prefill: a Prefill but for the lease, which the PE
    server defaults (lease_s None)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    receiver: str
    use_prefix_cache: bool = True
    seed: int | None = None  # None: the PE uses params.seed, or draws one that travels with the KV
    lease_s: float | None = None
    receiver_held_tokens: int = 0  # the CE's reservation holds these leading tokens' pages

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids must be a non-empty list of integers", "prompt_token_ids")
        if self.lease_s is not None:
            _positive("lease_s", self.lease_s)
        check_seed(self.seed)
        _held(self.receiver_held_tokens, len(self.prompt_token_ids))

    def prefill(self, default_lease_s: float) -> Prefill:
        """The PE rank's message for this body."""
        lease_s = default_lease_s if self.lease_s is None else self.lease_s
        return Prefill(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            self.receiver,
            lease_s,
            self.use_prefix_cache,
            self.seed,
            self.receiver_held_tokens,
        )


@dataclass(frozen=True)
class PrefillReply:
    """/prefill's 200: the handoff was acknowledged by the CE (handed_off), or the first token ended
    the request on the PE and `output` says how (nothing was handed off)."""

    handed_off: bool  # NOTE: the JSON key /prefill has always had (not is_handed_off)
    num_prompt_tokens: int
    num_cached_tokens: int
    prefill_s: float
    transfer_s: float
    payload_bytes: int
    transport: str
    output: RequestOutput | None = None
    skipped_tokens: int = 0  # leading tokens whose pages were not sent (the CE held them)
    transfer_after_prefill_s: float = 0.0  # first token sampled on the PE -> the CE's ack
    streamed_pages: int = 0  # pages sent while the prompt was prefilled (--kv-stream)
    early_pages: int = 0  # of them, pages whose bytes had gone when the prefill ended
