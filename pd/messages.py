"""Typed messages between the HTTP process and the engine ranks, encoded with msgpack (never pickle).

Every message is a map `{"v": PROTOCOL_VERSION, "type": <TYPE>, ...fields}`. A peer refuses another
version outright rather than guessing at a layout it does not know.

    HTTP process ── AddRequest / AbortRequests / Shutdown ──────────────► rank
    HTTP process ◄── RankReady / StepOutputs / RequestRejected / RankStats / RankFatal ── rank
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
        known = {f.name for f in fields(SamplingParams)}
        params: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in b["params"].items() if k in known
        }
        return cls(
            b["request_id"], tuple(b["prompt_token_ids"]), SamplingParams(**params), b["use_prefix_cache"]
        )


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


def _output_to_wire(o: RequestOutput) -> dict[str, Any]:
    d = {f.name: getattr(o, f.name) for f in fields(o)}
    d["logprobs"] = [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in o.logprobs]
    return d


def _output_from_wire(d: dict[str, Any]) -> RequestOutput:
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
            "outputs": [_output_to_wire(o) for o in self.outputs],
            "stats": self.stats,
            "queue_times_s": self.queue_times_s,
        }

    @classmethod
    def from_body(cls, b: dict[str, Any]) -> StepOutputs:
        return cls(tuple(_output_from_wire(d) for d in b["outputs"]), b["stats"], b["queue_times_s"])


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
    AddRequest | AbortRequests | Shutdown | RankReady | StepOutputs | RequestRejected | RankStats | RankFatal
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
