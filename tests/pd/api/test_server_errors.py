"""Bad input gets OpenAI's error object with the right status, and the server keeps serving: every case
is followed by a normal request that succeeds."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from pd.tools.server_process import get_json
from tests.server_fixtures import module_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 65536
HI = [{"role": "user", "content": "Hi"}]


server = module_server(
    "--model",
    MODEL,
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-body-bytes",
    str(MAX_BODY_BYTES),
    "--kv-cache-gb",
    "0.1",
)


def request(server, path: str, body: Any = None, method: str = "POST") -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        server.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, json.loads(raw) if r.headers.get_content_type() == "application/json" else raw
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_error(
    status: int, body: Any, want_status: int, param: str | None = None, code: str | None = None
) -> None:
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body


def assert_serving(server) -> None:
    status, body = request(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 1})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant", body
    assert get_json(server.url + "/health")[0] == 200


LONG = " ".join(["word"] * (MAX_MODEL_LEN + 50))

CASES = [
    # (id, path, body, status, param, code)
    ("malformed-json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400, None, "invalid_json"),
    ("empty-body", "/v1/chat/completions", b"", 400, None, None),
    ("not-an-object", "/v1/chat/completions", [1, 2, 3], 400, None, None),
    (
        "messages-wrong-type",
        "/v1/chat/completions",
        {"model": MODEL, "messages": "hi"},
        400,
        "messages",
        None,
    ),
    ("empty-messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    (
        "bad-role",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": ["user"], "content": "a"}]},  # any string is a role
        400,
        "messages[0].role",
        None,
    ),
    (
        "max-tokens-string",
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "max_tokens": "5"},
        400,
        "max_tokens",
        None,
    ),
    (
        "max-tokens-zero",
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "max_tokens": 0},
        400,
        "max_tokens",
        None,
    ),
    (
        "max-completion-tokens-neg",
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "max_completion_tokens": -3},
        400,
        "max_completion_tokens",
        None,
    ),
    ("n-zero", "/v1/chat/completions", {"model": MODEL, "messages": HI, "n": 0}, 400, "n", None),
    (
        "temperature-type",
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "temperature": "hot"},
        400,
        "temperature",
        None,
    ),
    ("top-p-range", "/v1/chat/completions", {"model": MODEL, "messages": HI, "top_p": 2}, 400, "top_p", None),
    (
        "stop-type",
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "stop": {"a": 1}},
        400,
        "stop",
        None,
    ),
    (
        "stream-type",
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "stream": "yes"},
        400,
        "stream",
        None,
    ),
    (
        "top-logprobs-range",
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "logprobs": True, "top_logprobs": 99},
        400,
        "top_logprobs",
        None,
    ),
    (
        "tool-choice-unknown",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": HI,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice",
        None,
    ),
    (
        "unknown-model",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": HI},
        404,
        "model",
        "model_not_found",
    ),
    (
        "chat-too-long",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "chat-too-long-stream",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "stream": True},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "chat-plus-max-tokens-too-long",
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "max_tokens": MAX_MODEL_LEN},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "completion-too-long",
        "/v1/completions",
        {"model": MODEL, "prompt": [1] * (MAX_MODEL_LEN + 1)},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "completion-bad-prompt",
        "/v1/completions",
        {"model": MODEL, "prompt": {"text": "a"}},
        400,
        "prompt",
        None,
    ),
    ("completion-empty-prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    (
        "completion-token-out-of-vocab",
        "/v1/completions",
        {"model": MODEL, "prompt": [10**8]},
        400,
        "prompt",
        None,
    ),
    (
        "completion-token-out-of-vocab-stream",
        "/v1/completions",
        {"model": MODEL, "prompt": [10**8], "stream": True},
        400,
        "prompt",
        None,
    ),
    (
        "completion-unknown-model",
        "/v1/completions",
        {"model": "nope", "prompt": "a"},
        404,
        "model",
        "model_not_found",
    ),
    (
        "completion-max-tokens-zero",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "max_tokens": 0},
        400,
        "max_tokens",
        None,
    ),
    ("completion-n-zero", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 0}, 400, "n", None),
    (
        "oversize-body",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]},
        413,
        None,
        "request_too_large",
    ),
    ("unknown-route", "/v1/embeddings", {"input": "a"}, 404, None, None),
    # values that took (or could take) a rank down (issue 14): refused before anything computes with them
    (
        "nan-temperature",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
        400,
        None,
        "invalid_json",
    ),
    ("seed-over-int64", "/v1/chat/completions", {"model": MODEL, "messages": HI, "seed": 2**63}, 400, "seed", None),
    ("repetition-penalty-overflows-the-logits", "/v1/chat/completions", {"model": MODEL, "messages": HI, "repetition_penalty": 1e-10}, 400, "repetition_penalty", None),
    ("stop-token-negative", "/v1/chat/completions", {"model": MODEL, "messages": HI, "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    ("stop-token-not-a-list", "/v1/completions", {"model": MODEL, "prompt": "a", "stop_token_ids": 5}, 400, "stop_token_ids", None),
    ("stop-token-out-of-vocab", "/v1/chat/completions", {"model": MODEL, "messages": HI, "stop_token_ids": [10**8]}, 400, "stop_token_ids", None),
    (
        "completion-echo-token-over-int64",
        "/v1/completions",
        {"model": MODEL, "prompt": [2**64 - 1], "echo": True},
        400,
        "prompt",
        None,
    ),
]


@pytest.mark.parametrize("path,body,status,param,code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_then_serving(server, path, body, status, param, code):
    got_status, got = request(server, path, body)
    assert_error(got_status, got, status, param, code)
    assert_serving(server)


def test_tiny_temperature_is_greedy_not_a_crash(server):
    """temperature 1e-300 passed the checks and divided the logits to inf: multinomial raised and the
    rank died (every later request a 503). Below 1e-5 it is greedy now, as in vLLM."""
    base = {"model": MODEL, "messages": HI, "max_tokens": 4, "ignore_eos": True}
    status, want = request(server, "/v1/chat/completions", {**base, "temperature": 0})
    assert status == 200, want
    for temperature in (1e-300, 1e-40):
        status, got = request(server, "/v1/chat/completions", {**base, "temperature": temperature, "top_k": 5})
        assert status == 200, got
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert_serving(server)


# Grammars whose library errors quote them, "CUDA error" included: such text once decided that the rank was
# broken and ended it (issue 29). One allows no first token (a 400 at admission), one fails after its first.
NO_FIRST_TOKEN = {"regex": "[^\\x00-\\U0010FFFF]CUDA error"}
FAILS_AFTER_ONE = {"grammar": 'start: "a" x\nx: /[^\\x00-\\U0010FFFF]CUDA error/'}


def test_a_grammar_quoting_a_cuda_error_leaves_the_rank_up(server):
    pids = server.rank_pids()
    base = {"model": MODEL, "messages": HI, "max_tokens": 8}
    assert_error(*request(server, "/v1/chat/completions", {**base, "structured_outputs": NO_FIRST_TOKEN}), 400, "structured_outputs")
    status, got = request(server, "/v1/chat/completions", {**base, "structured_outputs": FAILS_AFTER_ONE})
    assert status >= 400 and "error" in got, got  # the request fails alone
    assert server.rank_pids() == pids
    assert_serving(server)


# Structured outputs the model cannot follow to their end (found by the request fuzzer): text that is a
# special token's (llguidance's mask offers the special token for the forced text, then its matcher refuses
# it), characters whose bytes SmolLM2's vocabulary lacks (\x04, a lead byte 0xF2: the tokenizer drops them,
# the mask offers the next byte's token, the matcher refuses it), a grammar that dead-ends after its first
# token. Each is the request's own fault: a 400 (it was a 500).
CANNOT_FOLLOW = {
    "special-token-choice": {"structured_outputs": {"choice": ["<|endoftext|>"]}},
    "special-token-const": {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"const": "<|im_end|>"}}}},
    "special-token-mid-regex": {"structured_outputs": {"regex": "ab<\\|im_end\\|>"}},
    "unspellable-character": {"structured_outputs": {"choice": ["\U000866a1"]}},
    "unspellable-control": {"structured_outputs": {"choice": ["a\x04"]}},
    "dead-end-after-one": {"structured_outputs": {"grammar": 'start: "a" x\nx: /[^\\x00-\\U0010FFFF]/'}},
}  # fmt: skip


@pytest.mark.parametrize("extra", CANNOT_FOLLOW.values(), ids=CANNOT_FOLLOW.keys())
def test_a_structured_output_the_model_cannot_follow_is_a_400(server, extra):
    pids = server.rank_pids()
    body = {"model": MODEL, "messages": HI, "max_tokens": 8, **extra}
    status, got = request(server, "/v1/chat/completions", body)
    assert server.rank_pids() == pids
    assert_serving(server)
    assert_error(status, got, 400)


def test_a_grammar_that_dead_ends_mid_stream_ends_it_with_an_in_band_400(server):
    # the stream has begun (its first token is out) when the grammar has nowhere to go: the error comes
    # in-band, in OpenAI's shape, as the last event (no [DONE]: the output is not whole); the rank stays up
    pids = server.rank_pids()
    body = {"model": MODEL, "messages": HI, "max_tokens": 8, "stream": True, **CANNOT_FOLLOW["dead-end-after-one"]}
    status, raw = request(server, "/v1/chat/completions", body)
    assert status == 200, raw
    events = [line[len(b"data: ") :] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    *chunks, last = [json.loads(e) for e in events]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "a", chunks
    assert set(last) == {"error"} and last["error"]["type"] == "invalid_request_error", last
    assert last["error"]["message"].startswith("the output's grammar failed"), last
    assert server.rank_pids() == pids
    assert_serving(server)


def test_wrong_method_and_unknown_model_card(server):
    assert_error(*request(server, "/v1/chat/completions", method="GET"), 405)
    assert_error(*request(server, "/v1/models/nope", method="GET"), 404, "model", "model_not_found")
    assert_serving(server)


def test_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=HI)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert r.choices[0].message.role == "assistant"


def test_metrics_count_errors(server):
    status, text = request(server, "/metrics", method="GET")
    assert status == 200
    assert 'pdserve_http_errors_total{status="400"}' in text.decode()
