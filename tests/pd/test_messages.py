"""The ranks' and the P/D roles' wire messages (pd/messages.py): round trips; decoded strictly (another
version, an unknown type, unknown, missing, mistyped and out-of-range fields refused); ranges checked on
construction too."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from engine.codec import to_wire
from engine.request import RequestOutput, SamplingParams, TokenLogprob
from pd.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    MessageError,
    Prefill,
    PrefillResult,
    RankFatal,
    RankReady,
    RankStats,
    RequestRejected,
    Reserve,
    Reserved,
    Shutdown,
    StepOutputs,
    decode,
    encode,
)


def test_messages_round_trip():
    msgs = [
        AddRequest(
            "r1",
            (1, 2, 3),
            SamplingParams(max_tokens=5, temperature=0.0, stop=("a", "b"), seed=7, logprobs=2),
            False,
        ),
        AbortRequests(("r1", "r2")),
        Shutdown(),
        RankReady(0, 123, "m", 2048, (2, 3), "cpu", {"kv_usage": 0.0}),
        RequestRejected("r1", "too long", "max_tokens"),
        RankStats({"num_running": 1}),
        RankFatal("boom"),
    ]
    for m in msgs:
        assert decode(encode(m)) == m
    out = RequestOutput(
        "r1", [5], "hi", [TokenLogprob(5, -0.1, ((5, -0.1), (6, -2.0)))], True, "stop", 3, 1, 1
    )
    got = decode(encode(StepOutputs((out,), {"kv_usage": 0.5}, {"r1": 0.01})))
    assert isinstance(got, StepOutputs) and got.outputs == (out,) and got.stats == {"kv_usage": 0.5}
    assert got.queue_times_s == {"r1": 0.01}


def test_messages_refuse_other_versions_and_garbage():
    data = msgpack.unpackb(encode(Shutdown()))
    assert data == {"v": PROTOCOL_VERSION, "type": "shutdown"}
    with pytest.raises(MessageError):
        decode(msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "shutdown"}))
    with pytest.raises(MessageError):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "type": "nope"}))
    with pytest.raises(MessageError):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "type": "add"}))
    with pytest.raises(MessageError) as e:
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "type": "shutdown", "now": True}))
    assert e.value.field == "now"  # an unknown field is refused, not dropped
    with pytest.raises(MessageError):
        decode(b"\xc1")


def test_pd_messages_round_trip():
    params = SamplingParams(max_tokens=5, temperature=0.7, seed=3, stop=("x",), logprobs=1)
    out = RequestOutput(
        "r", [1, 2], "ab", [TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.0)))], True, "stop", 4, 2, 2
    )
    for msg in (
        Reserve("r", 10, 30, 5.0),
        Reserved("r"),
        Prefill("r", (1, 2, 3), params, "127.0.0.1:8900", 30.0, False, 7),
        Prefill("r", (1,), SamplingParams(), "[::1]:8900", 1.0),
        PrefillResult("r", True, 3, 2, 0.1, 0.2, 1000, "tcp"),
        PrefillResult("r", False, code="timeout", message="late"),
        PrefillResult("r", False, 3, 0, 0.1, output=out),
    ):
        assert decode(encode(msg)) == msg


def _raw(kind: str, **fields: Any) -> bytes:
    """A rank message as a peer of another make could send it (no dataclass, no checks)."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": kind, **fields}, use_bin_type=True)


RESERVE = dict(request_id="r", num_tokens=10, num_commit_tokens=30, ttl_s=5.0)


PREFILL = dict(to_wire(Prefill("r", (1, 2), SamplingParams(), "h:1", 30.0)))


@pytest.mark.parametrize(
    "kind, fields, where",
    [
        ("reserve", {**RESERVE, "ttl": 5.0}, "ttl"),  # an unknown field
        ("reserve", {**RESERVE, "num_tokens": True}, "num_tokens"),  # a bool for an int
        ("reserve", {**RESERVE, "num_tokens": "10"}, "num_tokens"),
        ("reserve", {k: v for k, v in RESERVE.items() if k != "ttl_s"}, "ttl_s"),  # a missing field
        ("reserve", {**RESERVE, "num_tokens": 0}, "num_tokens"),  # out of range
        ("reserve", {**RESERVE, "num_commit_tokens": 9}, "num_commit_tokens"),
        ("reserve", {**RESERVE, "ttl_s": 0}, "ttl_s"),
        ("prefill", {**PREFILL, "prompt_token_ids": "12"}, "prompt_token_ids"),  # a string for a list
        ("prefill", {**PREFILL, "prompt_token_ids": [1, True]}, "prompt_token_ids[1]"),
        ("prefill", {**PREFILL, "params": {"top_k": 1.5}}, "params.top_k"),
        ("prefill", {**PREFILL, "params": {"stop": "x"}}, "params.stop"),
        ("prefill", {**PREFILL, "params": {"max_tokens": 0}}, "params.max_tokens"),
        ("prefill", {**PREFILL, "params": {"temprature": 0.0}}, "params.temprature"),
        ("prefill", {**PREFILL, "lease_s": -1.0}, "lease_s"),
        ("abort", {"request_ids": "r"}, "request_ids"),
        ("add", {"request_id": "r", "prompt_token_ids": [1], "params": {}, "use_prefix_cache": 1}, "use_prefix_cache"),
        ("ready", {"rank": 0, "pid": 1, "model_name": "m", "max_model_len": 8, "device": "cpu"}, "eos_token_ids"),
        ("outputs", {"outputs": [{"request_id": "r", "new_token_ids": [1], "extra": 1}]}, "outputs[0].extra"),
        ("prefill_result", {"request_id": "r", "is_handed_off": "yes"}, "is_handed_off"),
    ],
)
def test_rank_messages_are_decoded_strictly(kind: str, fields: dict[str, Any], where: str) -> None:
    with pytest.raises(MessageError) as e:
        decode(_raw(kind, **fields))
    assert e.value.field == where and kind in str(e.value)


def test_message_ranges_are_checked_on_construction_too():
    for bad in (lambda: Reserve("r", 0, 10, 1.0), lambda: Reserve("r", 1, 1, float("nan"))):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        Prefill("r", (), SamplingParams(), "h:1", 1.0)
