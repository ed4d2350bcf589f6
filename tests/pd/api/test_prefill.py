"""The PE's /prefill body (pd/api/prefill.py): parsed strictly, each bad field a 400 naming it; the body limit
it takes (ServerConfig.prefill_max_body_bytes) holds whatever a CE forwards."""

from __future__ import annotations

import pytest

from engine.codec import to_wire
from engine.request import SamplingParams
from pd.api.prefill import parse_prefill
from pd.config import ServerConfig
from pd.errors import ApiError
from pd.messages import Prefill, PrefillBody


def test_parse_prefill():
    body = {
        "request_id": "r",
        "prompt_token_ids": [1, 2],
        "params": {"max_tokens": 3, "stop": ["a"]},
        "receiver": "h:1",
    }
    msg = parse_prefill(body, 30.0)
    assert msg.params.stop == ("a",) and msg.lease_s == 30.0 and msg.use_prefix_cache and msg.seed is None
    assert parse_prefill({**body, "lease_s": None, "seed": None}, 30.0) == msg
    assert parse_prefill({**body, "lease_s": 5, "seed": 3, "use_prefix_cache": False}, 30.0) == Prefill(
        "r", (1, 2), SamplingParams(max_tokens=3, stop=("a",)), "h:1", 5.0, False, 3
    )
    assert parse_prefill(to_wire(PrefillBody("r", (1, 2), msg.params, "h:1")), 30.0) == msg
    for key, value, param in (
        ("request_id", 5, "request_id"),
        ("prompt_token_ids", [], "prompt_token_ids"),
        ("prompt_token_ids", [1, "2"], "prompt_token_ids[1]"),
        ("prompt_token_ids", "12", "prompt_token_ids"),  # a string for a list
        ("params", {"max_tokens": 0}, "params.max_tokens"),
        ("params", {"top_k": True}, "params.top_k"),  # a bool for an int
        ("params", {"max_tokens": 3, "n": 2}, "params.n"),  # an unknown field
        ("receiver", None, "receiver"),
        ("seed", "x", "seed"),
        ("lease_s", -1, "lease_s"),
        ("use_prefix_cache", 1, "use_prefix_cache"),
        ("priority", 1, "priority"),  # an unknown field
    ):
        with pytest.raises(ApiError) as e:
            parse_prefill({**body, key: value}, 30.0)
        assert (e.value.status, e.value.param) == (400, param), (key, value, e.value.message)
    for bad, param in (({k: v for k, v in body.items() if k != "receiver"}, "receiver"), ([body], None), (None, None)):
        with pytest.raises(ApiError) as e:
            parse_prefill(bad, 30.0)
        assert (e.value.status, e.value.param) == (400, param)  # a missing field; not an object at all


def test_what_a_decode_engine_forwards_fits_the_prefill_engines_limit():
    """A body the CE took (at --max-body-bytes, a schema full of quotes, a prompt at the context's
    length) grew past the PE's own --max-body-bytes as a /prefill body: 502 for a valid request
    (issue 29). The PE's /prefill now takes ServerConfig.prefill_max_body_bytes, which holds it."""
    import dataclasses as dc

    import orjson

    from pd.api.protocol import parse_chat_request

    cfg = ServerConfig(max_body_bytes=65536)
    cfg = dc.replace(cfg, engine=dc.replace(cfg.engine, max_model_len=2048))
    quotes = '"' * 20_000
    body = {"messages": [{"role": "user", "content": "Hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "q", "schema": {"type": "object", "description": quotes}}}}
    raw = orjson.dumps(body)
    assert len(raw) <= cfg.max_body_bytes
    params = parse_chat_request(orjson.loads(raw)).sampling.params(16, None, 0)
    prefill = PrefillBody("r" * 64, tuple([151_935] * 2047), params, "pe-host.example:8900", seed=2**63 - 1)
    forwarded = len(orjson.dumps(to_wire(prefill)))
    assert cfg.max_body_bytes < forwarded <= cfg.prefill_max_body_bytes
