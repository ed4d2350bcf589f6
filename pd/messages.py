"""Typed messages between the HTTP process and the engine ranks, encoded with msgpack (never pickle).

Every message is a map `{"v": PROTOCOL_VERSION, "type": <TYPE>, ...fields}`. A peer refuses another
version outright rather than guessing at a layout it does not know.

    HTTP process ── AddRequest / AbortRequests / Shutdown ──────────────► rank
    HTTP process ◄── RankReady / StepOutputs / RequestRejected / RankStats / RankFatal ── rank

P/D roles add (pd/ce_rank.py, pd/pe_rank.py):

    CE coordinator ── Reserve ──► CE rank ── Reserved ──► (then StepOutputs as for AddRequest)
    PE server      ── Prefill ──► PE rank ── PrefillResult ──► (one per Prefill)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import msgpack

from engine.request import RequestOutput, SamplingParams, TokenLogprob

PROTOCOL_VERSION = 1


class MessageError(ValueError):
    """Bytes that are not a message of this protocol version."""


@dataclass(frozen=True)
class AddRequest:
    TYPE: ClassVar[str] = "add"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    use_prefix_cache: bool = True

    def to_body(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "params": asdict(self.params),
            "use_prefix_cache": self.use_prefix_cache,
        }

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> AddRequest:
        return cls(
            b["request_id"],
            tuple(b["prompt_token_ids"]),
            _params_from_wire(b["params"]),
            b["use_prefix_cache"],
        )


def _params_from_wire(d: dict[str, Any]) -> SamplingParams:
    known = {f.name for f in fields(SamplingParams)}
    kw: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known}
    return SamplingParams(**kw)


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

    def to_body(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> Reserve:
        return cls(b["request_id"], int(b["num_tokens"]), int(b["num_commit_tokens"]), float(b["ttl_s"]))


@dataclass(frozen=True)
class Reserved:
    """CE rank: the reservation is held; the receiver now takes this request's handoff."""

    TYPE: ClassVar[str] = "reserved"
    request_id: str

    def to_body(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> Reserved:
        return cls(b["request_id"])


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

    def to_body(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "params": asdict(self.params),
            "receiver": self.receiver,
            "lease_s": self.lease_s,
            "use_prefix_cache": self.use_prefix_cache,
            "seed": self.seed,
        }

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> Prefill:
        return cls(
            b["request_id"],
            tuple(b["prompt_token_ids"]),
            _params_from_wire(b["params"]),
            b["receiver"],
            float(b["lease_s"]),
            bool(b["use_prefix_cache"]),
            b["seed"],
        )


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
    code: str | None = None
    message: str = ""
    output: RequestOutput | None = None

    def to_body(self) -> dict[str, Any]:
        b = {f.name: getattr(self, f.name) for f in fields(self)}
        b["output"] = output_to_wire(self.output) if self.output is not None else None
        return b

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> PrefillResult:
        kw = {f.name: b[f.name] for f in fields(cls)}
        kw["output"] = output_from_wire(b["output"]) if b["output"] is not None else None
        return cls(**kw)


@dataclass(frozen=True)
class AbortRequests:
    TYPE: ClassVar[str] = "abort"
    request_ids: tuple[str, ...]

    def to_body(self) -> dict[str, Any]:
        return {"request_ids": list(self.request_ids)}

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> AbortRequests:
        return cls(tuple(b["request_ids"]))


@dataclass(frozen=True)
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"

    def to_body(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> Shutdown:
        return cls()


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

    def to_body(self) -> dict[str, Any]:
        b = asdict(self)
        b["eos_token_ids"] = list(self.eos_token_ids)
        return b

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> RankReady:
        return cls(
            b["rank"],
            b["pid"],
            b["model_name"],
            b["max_model_len"],
            tuple(b["eos_token_ids"]),
            b["device"],
            b["stats"],
        )


def output_to_wire(o: RequestOutput) -> dict[str, Any]:
    d = {f.name: getattr(o, f.name) for f in fields(o)}
    d["logprobs"] = [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in o.logprobs]
    return d


def output_from_wire(d: dict[str, Any]) -> RequestOutput:
    known = {f.name for f in fields(RequestOutput)}
    kw = {k: v for k, v in d.items() if k in known}
    kw["logprobs"] = [TokenLogprob(t, lp, tuple((i, x) for i, x in top)) for t, lp, top in d["logprobs"]]
    return RequestOutput(**kw)


@dataclass(frozen=True)
class StepOutputs:
    """What one engine step produced, for every request that has news, plus fresh engine stats."""

    TYPE: ClassVar[str] = "outputs"
    outputs: tuple[RequestOutput, ...]
    stats: dict[str, Any] | None = None
    queue_times_s: dict[str, float] = field(default_factory=dict)  # request id -> wait before its first step

    def to_body(self) -> dict[str, Any]:
        return {
            "outputs": [output_to_wire(o) for o in self.outputs],
            "stats": self.stats,
            "queue_times_s": self.queue_times_s,
        }

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> StepOutputs:
        return cls(tuple(output_from_wire(d) for d in b["outputs"]), b["stats"], b["queue_times_s"])


@dataclass(frozen=True)
class RequestRejected:
    """The engine refused an AddRequest (InvalidRequestError); `param` names the request field."""

    TYPE: ClassVar[str] = "rejected"
    request_id: str
    message: str
    param: str | None = None

    def to_body(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> RequestRejected:
        return cls(b["request_id"], b["message"], b["param"])


@dataclass(frozen=True)
class RankStats:
    """Engine stats sent while idle: doubles as a heartbeat."""

    TYPE: ClassVar[str] = "stats"
    stats: dict[str, Any]

    def to_body(self) -> dict[str, Any]:
        return {"stats": self.stats}

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> RankStats:
        return cls(b["stats"])


@dataclass(frozen=True)
class RankFatal:
    """The engine failed; the rank process exits right after sending this."""

    TYPE: ClassVar[str] = "fatal"
    message: str

    def to_body(self) -> dict[str, Any]:
        return {"message": self.message}

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> RankFatal:
        return cls(b["message"])


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
_TYPES: dict[str, Any] = {
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
    body = msg.to_body()
    body["v"] = PROTOCOL_VERSION
    body["type"] = msg.TYPE
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes) -> Message:
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise MessageError(f"undecodable message: {e}") from e
    if not isinstance(body, dict):
        raise MessageError("a message must be a map")
    if body.get("v") != PROTOCOL_VERSION:
        raise MessageError(f"protocol version {body.get('v')!r}, expected {PROTOCOL_VERSION}")
    cls = _TYPES.get(body.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise MessageError(f"unknown message type {body.get('type')!r}")
    try:
        return cls.from_body(body)
    except (KeyError, TypeError, ValueError) as e:
        raise MessageError(f"malformed {cls.TYPE} message: {e}") from e
