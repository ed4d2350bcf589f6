"""The request space of the OpenAI endpoints as hypothesis strategies, for tests/pd/api/test_fuzz_requests.py.

A body is drawn valid first (every field in its accepted range, edges included: top_p 1 and 5e-324,
temperature 0 and 1e-300, min_tokens up to max_tokens, logit_bias +-100, n 16, seeds and top_k at the
int64 edge, grammars that allow little, tools with odd schemas, special tokens' text in the messages),
then about half the bodies get one or two things spoiled: a field's value (wrong type, out of range,
huge, empty, arbitrary JSON), a field dropped, or a value nested in one made arbitrary JSON. So many
bodies reach the engine with a combination of features, and the rest probe the checks. max_tokens stays
small: the fuzz looks for crashes, not long generations.

The vocabulary is SmolLM2's (the fuzz servers' tokenizer): VOCAB_SIZE ids, ids past it are out of range.
"""

from __future__ import annotations

import copy
import functools
import json
import random
from typing import Any

from hypothesis import strategies as st

VOCAB_SIZE = 49152
MAX_TOKENS = 6  # the most tokens a drawn request asks for
SPECIAL_TEXT = (
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
    "<tool_response>", "{{ messages }}", "{% raise %}", '{"name": "f", "arguments": {}}', "\\u0000", "\x00",
    "\ud7ff", "\U0001f600", "\u202e", "\r\n", "[TOOL_CALLS]", "<|python_tag|>",
)  # fmt: skip
EDGE_INTS = (0, -1, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63))
EDGE_FLOATS = (0.0, -0.0, 5e-324, 1e-300, 1e-6, 0.5, 1.0, 2.0, 100.0, 100.5, 1e308, -1e308)

# ---- arbitrary JSON: what a spoiled field gets ---------------------------------------------------

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGE_INTS),
    st.integers(-1000, 1000),
    st.sampled_from(EDGE_FLOATS),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(SPECIAL_TEXT),
)
JUNK = st.recursive(
    SCALARS,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=6,
)


def nested(depth: int, leaf: Any = 1) -> Any:
    """Arrays and objects nested `depth` deep (the server refuses more than 32 levels)."""
    v = leaf
    for i in range(depth):
        v = [v] if i % 2 else {"a": v}
    return v


TEXT = st.one_of(
    st.text(max_size=20),
    st.sampled_from(SPECIAL_TEXT),
    st.lists(st.sampled_from(SPECIAL_TEXT) | st.text(max_size=4), min_size=1, max_size=4).map("".join),
)
NAMES = st.one_of(
    st.sampled_from(["f", "get_weather", "a.b", "x-y", "f f", "\u00e9t\u00e9", "'\"", "</tool_call>"]),
    st.text(min_size=1, max_size=8),
)

# ---- JSON schemas (response_format, structured_outputs.json, tool parameters) -------------------

ODD_SCHEMAS = (
    {},
    {"type": "foo"},
    {"type": []},
    {"type": ["string", "null"]},
    {"type": "string", "minLength": 5, "maxLength": 1},
    {"type": "integer", "minimum": 5, "maximum": 1},
    {"type": "string", "pattern": "("},
    {"type": "string", "pattern": "^[a-z]{3}$"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "no-such-format"},
    {"type": "string", "minLength": 2**63},
    {"type": "array", "minItems": 3, "maxItems": 1},
    {"type": "array", "maxItems": -1},
    {"type": "array", "items": False},
    {"enum": []},
    {"enum": [1, "a", None, [1], {"b": 2}]},
    {"const": "only"},
    {"not": {}},
    {"anyOf": []},
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"$ref": "#/nowhere"},
    {"$ref": "#"},
    {"$ref": "http://example.com/schema.json"},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "required": ["missing"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "a"]},
    {"type": "object", "patternProperties": {"(": {}}},
    {"type": "number", "multipleOf": 0},
    {"type": "integer", "minimum": 1e308},
    {"if": {"type": "string"}, "then": {"maxLength": 1}},
)


def _schemas(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": children}, optional={"maxItems": st.integers(0, 3)}
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("object"),
                "properties": st.dictionaries(st.sampled_from("abc"), children, max_size=3),
            },
            optional={
                "required": st.lists(st.sampled_from("abcd"), max_size=3),
                "additionalProperties": st.booleans(),
            },
        ),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(children, min_size=1, max_size=3)),
    )


LEAF_SCHEMAS = st.one_of(
    st.sampled_from(
        [{"type": t} for t in ("string", "integer", "number", "boolean", "null")]
        + [
            {"type": "string", "maxLength": 4},
            {"enum": ["yes", "no"]},
            {"type": "integer", "minimum": 0, "maximum": 9},
        ]
    ),
    st.sampled_from(ODD_SCHEMAS),
)
RECURSIVE_SCHEMAS = st.recursive(LEAF_SCHEMAS, _schemas, max_leaves=6)
SCHEMAS = st.one_of(
    RECURSIVE_SCHEMAS,
    RECURSIVE_SCHEMAS,
    st.sampled_from(ODD_SCHEMAS),
    st.integers(18, 34).map(lambda d: nested(d, {"type": "string"})),  # around the depth limit
)

# ---- the other constraints --------------------------------------------------------------------

REGEXES = st.one_of(
    st.sampled_from(
        [
            r"[a-z]{1,5}", r"(yes|no)", r"\d+", r"a*", r".*", r"x", r"(?i)abc", r"[^\x00-\x7f]+", r"\p{L}+",
            r"(a|b)*c{2,}", r"<tool_call>\{\"name\": \"f\", \"arguments\": \{\}\}</tool_call>",
            r"<tool_call>\n\{\"name\": \"(f|g)\", \"arguments\": \{\"a\": [0-9]\}\}\n</tool_call>",
            r"<think>[a-z ]{0,8}</think>[a-z]{1,3}", r"\{\"a\": \[\[\[\[1\]\]\]\]\}",
            # refused, or allowing next to nothing
            r"", r"(", r"[", r"a{2,1}", r"a{100000}", r"(?<=a)b", r"\b", r"^$", r"[^\s\S]", r"\1", r"(?P<x>a)(?P=x)",
        ]
    ),
    st.text(alphabet="ab()[]{}*+?|\\.^$0-9,", max_size=10),
)  # fmt: skip
GRAMMARS = st.one_of(
    st.sampled_from(
        [
            'start: "yes" | "no"', "start: /[a-z]+/", 'root ::= "a"+', 'root ::= [0-9]{1,3} " apples"',
            "start: start", "start: a\na: start", 'start: "a"{1000000}', "%import common.WORD\nstart: WORD",
            "start: ", 'root ::= "', "root ::= root", "start: /(/", 'start: %json {"type": "integer"}',
            'start: <[1]>', 'start: "x" | <[49151]>',
        ]
    ),
    st.text(max_size=16),
)  # fmt: skip
# Text the tokenizer cannot spell token for token (a special token's text such as "<|im_end|>", a character
# whose bytes the vocabulary lacks: \x04, lead bytes 0xF1 0xF2) and a grammar that dead-ends after its first
# token: the request's fault, a 400 (tests/pd/api/test_server_errors.py has one case of each).
CHOICES = st.lists(
    st.one_of(st.sampled_from(["yes", "no", "a", "\n", "</tool_call>", "<think>"]), TEXT),
    max_size=4,
) | st.just(["<|im_end|>"])
GRAMMARS = GRAMMARS | st.just('start: "a" x\nx: /[^\\x00-\\U0010FFFF]/')  # fails after its "a"


def structured_outputs() -> st.SearchStrategy[dict[str, Any]]:
    """One constraint, in one of its spellings: response_format, structured_outputs, guided_*."""
    schema = st.one_of(SCHEMAS, SCHEMAS.map(json.dumps))
    so = st.one_of(
        st.builds(lambda s: {"json": s}, schema),
        st.builds(lambda s: {"regex": s}, REGEXES),
        st.builds(lambda s: {"grammar": s}, GRAMMARS),
        st.builds(lambda s: {"choice": s}, CHOICES),
        st.just({"json_object": True}),
    )
    return st.one_of(
        st.builds(
            lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}},
            SCHEMAS,
        ),
        st.sampled_from([{"response_format": {"type": t}} for t in ("json_object", "text")]),
        st.builds(lambda s: {"structured_outputs": s}, so),
        st.builds(lambda s: {"guided_regex": s}, REGEXES),
        st.builds(lambda s: {"guided_json": s}, schema),
        st.builds(lambda s: {"guided_choice": s}, CHOICES),
        st.builds(lambda s: {"guided_grammar": s}, GRAMMARS),
    )


# ---- sampling fields, shared by chat and completions ------------------------------------------

TOKEN_IDS = st.one_of(st.integers(0, VOCAB_SIZE - 1), st.sampled_from([0, 1, 2, VOCAB_SIZE - 1]))
BIASES = st.one_of(st.sampled_from([-100, 100, 0]), st.floats(-100, 100))
STOPS = st.one_of(TEXT, st.lists(st.one_of(TEXT, st.just("")), max_size=16))


def sampling_fields(max_tokens: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Valid sampling fields, each present or not, and what max_tokens draws."""
    return st.fixed_dictionaries(
        {},
        optional={
            "temperature": st.one_of(st.sampled_from([0, 0.0, 1e-300, 1e-6, 1, 2]), st.floats(0, 2)),
            "top_p": st.one_of(st.sampled_from([1, 5e-324, 1e-9]), st.floats(0, 1, exclude_min=True)),
            "top_k": st.one_of(
                st.sampled_from([-1, 0, 1, VOCAB_SIZE - 1, VOCAB_SIZE, 2**31, 2**63 - 1, 2**64 - 1]),
                st.integers(-1, 60),
            ),
            "min_p": st.one_of(st.sampled_from([0, 1, 1e-300]), st.floats(0, 1)),
            "seed": st.one_of(st.sampled_from([0, 2**63 - 1]), st.integers(0, 2**63 - 1)),
            "stop": STOPS,
            "stop_token_ids": st.lists(TOKEN_IDS, max_size=8),
            "ignore_eos": st.booleans(),
            "n": st.one_of(st.integers(1, 3), st.just(16)),
            "presence_penalty": st.one_of(st.sampled_from([-2, 2]), st.floats(-2, 2)),
            "frequency_penalty": st.one_of(st.sampled_from([-2, 2]), st.floats(-2, 2)),
            "repetition_penalty": st.one_of(st.sampled_from([0.01, 1, 2]), st.floats(0.01, 2)),
            "logit_bias": st.dictionaries(
                TOKEN_IDS, st.tuples(st.sampled_from(["", "", "", "00"]), BIASES), max_size=6
            ).map(lambda d: {f"{zeros}{t}": bias for t, (zeros, bias) in d.items()}),
            "min_tokens": st.integers(0, MAX_TOKENS),  # at most max_tokens: valid_*_body keeps it so
            "prefix_cache": st.booleans(),
            "user": TEXT,
        },
    ).flatmap(lambda d: st.builds(lambda extra: {**d, **extra}, max_tokens))


def max_tokens(key: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda v: {key: v}, st.integers(1, MAX_TOKENS))


# A chat always has a small max_tokens (its default, the rest of the context, takes minutes at n 16 on
# two busy cores: tests/pd/test_server_e2e.py covers it); a completion may go without (16 tokens).
CHAT_MAX_TOKENS = st.one_of(max_tokens("max_tokens"), max_tokens("max_completion_tokens"))
COMPLETION_MAX_TOKENS = st.one_of(max_tokens("max_tokens"), st.just({}))


def stream_fields() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.just({}),
        st.just({"stream": False}),
        st.builds(
            lambda usage: {"stream": True, **({} if usage is None else {"stream_options": usage})},
            st.none()
            | st.builds(lambda b: {"include_usage": b}, st.booleans())
            # vLLM's usage in every chunk (alone it asks for nothing)
            | st.builds(lambda b: {"include_usage": b, "continuous_usage_stats": True}, st.booleans()),
        ),
    )


# ---- chat ---------------------------------------------------------------------------------------

CONTENT = st.one_of(
    TEXT,
    st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT), min_size=1, max_size=3),
)


def _tool_call(i: int, name: str, args: Any) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


ARGUMENTS = st.one_of(
    st.dictionaries(st.sampled_from("abc"), JUNK, max_size=3).map(json.dumps),
    st.dictionaries(st.sampled_from("abc"), JUNK, max_size=3),
    st.sampled_from(["", "{", "not json", "[]", "null", json.dumps(nested(31)), "[" * 40 + "]" * 40]),
)
ASSISTANT_CALLS = st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=2).map(
    lambda calls: {
        "role": "assistant",
        "content": None,
        "tool_calls": [_tool_call(i, name, args) for i, (name, args) in enumerate(calls)],
    }
)
MESSAGE = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, CONTENT),
    st.builds(lambda c: {"role": "user", "content": c}, CONTENT),
    st.builds(
        lambda r, c: {"role": r, "content": c}, st.sampled_from(["system", "developer", "assistant"]), CONTENT
    ),
    ASSISTANT_CALLS,
    st.builds(lambda c: {"role": "tool", "tool_call_id": "call_0", "content": c}, CONTENT),
    st.builds(lambda c, n: {"role": "user", "content": c, "name": n}, CONTENT, NAMES),
)
MESSAGES = st.lists(MESSAGE, min_size=1, max_size=4)

TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": NAMES},
        optional={"description": TEXT, "parameters": SCHEMAS, "strict": st.booleans()},
    )},
)  # fmt: skip


@st.composite
def tools_and_choice(draw: st.DrawFn) -> dict[str, Any]:
    tools = draw(st.lists(TOOL, max_size=3))
    if not tools:
        return {} if draw(st.booleans()) else {"tool_choice": "none"}
    names = [t["function"]["name"] for t in tools]
    choice = draw(
        st.one_of(
            st.none(),
            st.sampled_from(["auto", "none", "required"]),
            st.sampled_from(names).map(lambda n: {"type": "function", "function": {"name": n}}),
        )
    )
    return {"tools": tools} if choice is None else {"tools": tools, "tool_choice": choice}


def _min_tokens_fit(body: dict[str, Any]) -> None:
    """min_tokens past max_tokens is a 400 (vLLM's too): the valid body keeps them in order."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if body.get("min_tokens", 0) > limit:
        body["min_tokens"] = limit


@st.composite
def valid_chat_body(draw: st.DrawFn, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": draw(MESSAGES)}
    if draw(st.booleans()):
        body["model"] = model
    body.update(draw(sampling_fields(CHAT_MAX_TOKENS)))
    _min_tokens_fit(body)
    body.update(draw(stream_fields()))
    if draw(st.integers(0, 3)) == 0:
        body["echo"] = True  # vLLM's: the last message's content first, when it is the assistant's
    if draw(st.booleans()):
        body.update(draw(tools_and_choice()))
    if draw(st.integers(0, 2)) == 0:
        body.update(draw(structured_outputs()))
    if draw(st.booleans()):
        body["logprobs"] = True
        top = draw(st.none() | st.integers(0, 20))
        if top is not None:
            body["top_logprobs"] = top
    if not body.get("stream") and draw(st.integers(0, 3)) == 0:
        body["prompt_logprobs"] = draw(st.integers(0, 20))
    optional = st.fixed_dictionaries(
        {},
        optional={
            "chat_template_kwargs": st.dictionaries(
                st.sampled_from(["enable_thinking", "x", "custom_instructions"]), JUNK, max_size=2
            ),
            "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "max"]),
            "include_reasoning": st.booleans(),
            "parallel_tool_calls": st.booleans(),
            "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
        },
    )
    body.update(draw(optional))
    return body


# Spoiled values per field: wrong types, out of range, edges the checks must catch.
BAD_COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["", "nope", None, 1, ["m"]]),
    "max_tokens": st.sampled_from([0, -1, 2**31, 2**63, 2**64 - 1, 2**64, 1.5, "5", True, 1e308]),
    "temperature": st.sampled_from([-0.1, 2.0001, 1e308, "hot", True, [1]]),
    "top_p": st.sampled_from([0, -1, 1.0001, "1", False]),
    "top_k": st.sampled_from([-2, 2**64, 1.5, "3", -(2**63)]),
    "min_p": st.sampled_from([-0.1, 1.1, "0"]),
    "seed": st.sampled_from([-1, 2**63, 2**64 - 1, 1.5, "7"]),
    "stop": st.sampled_from([[""] * 3, ["a"] * 17, [1], {"a": 1}, 5, [None], [["a"]]]),
    "stop_token_ids": st.sampled_from(
        [[-1], [VOCAB_SIZE], [2**31], [2**31 - 1], [2**63], ["1"], [1.0], list(range(65)), 3, {"1": 1}]
    ),
    "n": st.sampled_from([0, -1, 17, 2**63, 1.0, "2", True]),
    "prompt_logprobs": st.sampled_from([-1, -2, 21, 2**63, 1.5, "3", True, [1]]),
    "presence_penalty": st.sampled_from([-2.01, 2.01, 1e308, "0"]),
    "frequency_penalty": st.sampled_from([-2.01, 2.01, -1e308, [0]]),
    "repetition_penalty": st.sampled_from([0, -1, 1e-10, 2.01, 1e308, "1"]),
    "logit_bias": st.sampled_from(
        [
            {"-1": 1},
            {str(VOCAB_SIZE): 1},
            {str(2**31): 1},
            {str(2**64): 1},
            {"abc": 1},
            {"1.5": 1},
            {" 1": 1},
            {"\u0661": 1},
            {"1": 101},
            {"1": -100.001},
            {"1": "x"},
            {"1": None},
            {"1": 1, "01": 2},
            {"": 1},
            {str(i): 1 for i in range(301)},
            [1, 2],
            "1",
        ]
    ),  # fmt: skip
    "min_tokens": st.sampled_from([-1, MAX_TOKENS + 1, 2**31, 2**63 - 1, 2**64 - 1, 2**64, 1.5, "2"]),
    "ignore_eos": st.sampled_from([1, "true", None]),
    "stream": st.sampled_from([1, "true", [True]]),
    "stream_options": st.sampled_from(
        [{"include_usage": 1}, [], "x", {"include_usage": True}, {"continuous_usage_stats": "yes"}]
    ),
    "prefix_cache": st.sampled_from([0, "no"]),
    "response_format": st.sampled_from(
        [
            "json",
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": {"schema": "{}"}},
            {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}},
            {"type": "xml"},
            {"type": 1},
            {},
            {"type": "json_schema", "json_schema": {"name": "d", "schema": nested(40)}},
        ]
    ),  # fmt: skip
    "structured_outputs": st.sampled_from(
        [
            {},
            {"regex": "a", "choice": ["a"]},
            {"regex": 1},
            {"choice": []},
            {"choice": [""]},
            {"choice": "a"},
            {"json": "{not json"},
            {"json": "[1]"},
            {"json": 5},
            {"json_object": False},
            {"grammar": ""},
            {"unknown": 1},
            [],
            {"regex": "a" * 1_100_000},
        ]
    ),  # fmt: skip
}
BAD_CHAT: dict[str, st.SearchStrategy[Any]] = {
    **BAD_COMMON,
    "max_completion_tokens": BAD_COMMON["max_tokens"],
    "messages": st.sampled_from(
        [
            [],
            "hi",
            [None],
            [{}],
            [{"role": "user"}],
            [{"role": "bot", "content": "a"}],
            [{"role": "user", "content": None}],
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": "user", "content": []}],
            [{"role": "user", "content": "a", "name": 5}],
            [{"role": "assistant", "tool_calls": "x"}],
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": json.dumps(nested(40))}}],
                }
            ],
            [{"role": "tool", "content": "x", "tool_call_id": 5}],
            [{"role": "user", "content": "x" * 5000}],
            [{"role": "user", "content": nested(40)}],
        ]
    ),  # fmt: skip
    "tools": st.sampled_from(
        [
            "f",
            [None],
            [{}],
            [{"type": "function"}],
            [{"type": "code", "function": {"name": "f"}}],
            [{"type": "function", "function": {"name": ""}}],
            [{"type": "function", "function": {"name": 5}}],
            [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
            [{"type": "function", "function": {"name": "f", "description": 5}}],
            [{"type": "function", "function": {"name": "f", "parameters": nested(40)}}],
            [{"type": "function", "function": {"name": "f"}}] * 2,
            [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 50}} for i in range(60)],
        ]
    ),  # fmt: skip
    "tool_choice": st.sampled_from(
        [
            "any",
            "required",
            "auto",
            5,
            {"type": "function"},
            {"type": "function", "function": {"name": "missing"}},
            {"function": {"name": 5}},
            {"type": "function", "function": {"name": "f"}},
            [],
        ]
    ),  # fmt: skip
    "logprobs": st.sampled_from([1, "true", None, False]),
    "top_logprobs": st.sampled_from([-1, 21, 2**63, 1.5, "3", 5]),
    "chat_template_kwargs": st.sampled_from(
        [[], "x", {"tools": []}, {"messages": 1}, {"add_generation_prompt": False}, {"a": nested(40)}]
    ),
    "reasoning_effort": st.sampled_from(["extreme", 1, ""]),
    "include_reasoning": st.sampled_from([1, "no"]),
    "audio": st.just({"voice": "x"}),
    "modalities": st.sampled_from([["text", "audio"], "text", [1]]),
}
BAD_COMPLETION: dict[str, st.SearchStrategy[Any]] = {
    **BAD_COMMON,
    "prompt": st.sampled_from(
        [
            "",
            [],
            [[]],
            [""],
            [1, "a"],
            [[1], "a"],
            {"text": "a"},
            [-1],
            [VOCAB_SIZE],
            [2**31],
            [2**63],
            [2**64 - 1],
            [1.0],
            None,
            5,
            [[1, 2], []],
            ["a"] * 300,
            [True],
        ]
    ),  # fmt: skip
    "echo": st.sampled_from([1, "yes"]),
    "logprobs": st.sampled_from([-1, 21, True, 1.5, "2"]),
    "suffix": st.sampled_from(["x", 1, ""]),
    "best_of": st.sampled_from([0, 2, 17, "1"]),
}


SMALL_KEYS = ("max_tokens", "max_completion_tokens")


def inner_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path (keys and indexes) of every value nested in value's arrays and objects."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    out: list[tuple[Any, ...]] = []
    for key, child in items:
        out.append((*prefix, key))
        out += inner_paths(child, (*prefix, key))
    return out


@st.composite
def spoiled(draw: st.DrawFn, body: dict[str, Any], bad: dict[str, st.SearchStrategy[Any]]) -> dict[str, Any]:
    """body as it is (about half the time), or with one or two things spoiled: a field's value (a known
    bad one, or arbitrary JSON), a field gone, or a value nested in a field (a message, its content, a
    logit_bias entry, a tool's schema, a stop string) made arbitrary JSON."""
    num = draw(st.sampled_from([1, 0, 0, 2, 0, 0]))  # hypothesis draws the first most often
    # uniform picks, seeded by the body and a drawn number (sampled_from favours its first element, and
    # so do st.randoms, whose seed is a draw that is often 0)
    pick = random.Random(json.dumps(body, sort_keys=True) + str(draw(st.integers(0, 2**16))))
    body = copy.deepcopy(body)
    for _ in range(num):
        how = pick.choice(["inner", "inner", "bad", "bad", "junk", "drop"])
        nests = sorted(k for k, v in body.items() if isinstance(v, (dict, list)) and v)
        if how == "inner" and nests:  # a field first, so a long list of messages does not take every draw
            key = pick.choice(nests)
            path = pick.choice(inner_paths(body[key], (key,)))
            *parents, last = path[: pick.randint(2, len(path))]
            functools.reduce(lambda v, k: v[k], parents, body)[last] = draw(st.one_of(SCALARS, JUNK))
            continue
        key = pick.choice(sorted(bad))
        if key in SMALL_KEYS:
            how = "bad"  # never the default, nor a large valid value: slow
        if how == "drop":
            body.pop(key, None)
        else:
            body[key] = draw(bad[key] if how == "bad" else JUNK)
    return body


def chat_bodies(model: str) -> st.SearchStrategy[dict[str, Any]]:
    return valid_chat_body(model).flatmap(lambda b: spoiled(b, BAD_CHAT))


# ---- completions ---------------------------------------------------------------------------------

PROMPTS = st.one_of(
    TEXT.filter(bool),
    st.lists(TEXT.filter(bool), min_size=1, max_size=3),
    st.lists(TOKEN_IDS, min_size=1, max_size=12),
    st.lists(st.lists(TOKEN_IDS, min_size=1, max_size=6), min_size=1, max_size=3),
)


@st.composite
def valid_completion_body(draw: st.DrawFn, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": draw(PROMPTS)}
    if draw(st.booleans()):
        body["model"] = model
    body.update(draw(sampling_fields(COMPLETION_MAX_TOKENS)))
    _min_tokens_fit(body)
    body.update(draw(stream_fields()))
    if draw(st.integers(0, 2)) == 0:
        body.update(draw(structured_outputs()))
    what = draw(st.sampled_from(["plain", "echo", "logprobs", "echo and logprobs"]))
    if what.startswith("echo"):
        body["echo"] = True
        if draw(st.integers(0, 3)) == 0:
            body["max_tokens"] = 0  # the prompt alone
            body.pop("min_tokens", None)
    if what.endswith("logprobs"):
        body["logprobs"] = draw(st.integers(0, 20))
    if not body.get("stream") and draw(st.integers(0, 3)) == 0:
        body["prompt_logprobs"] = draw(st.integers(0, 20))
    if draw(st.integers(0, 3)) == 0:
        body["best_of"] = body.get("n", 1)
    return body


def completion_bodies(model: str) -> st.SearchStrategy[dict[str, Any]]:
    return valid_completion_body(model).flatmap(lambda b: spoiled(b, BAD_COMPLETION))


# ---- raw bodies: what is not a JSON object, or barely one ------------------------------------------

RAW_BODIES = st.one_of(
    st.sampled_from(
        [
            b"",
            b"{",
            b"[]",
            b"null",
            b"1",
            b'"x"',
            b"\xff\xfe",
            b'{"messages": [{"role": "user", "content": "\xff"}]}',
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": Infinity}',
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 18446744073709551616}',
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "max_tokens": 3}',
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
            b'{"messages": [{"role": "user", "content": "\\u0000"}], "max_tokens": 2}',
            b'{"prompt": "hi", "max_tokens": 2}\x00',
            b'{"prompt": "hi", "max_tokens": 2} {}',
            b"[" * 100_000 + b"]" * 100_000,
            b'{"a":' * 5000 + b"1" + b"}" * 5000,
        ]
    ),  # fmt: skip
    st.binary(max_size=40),
    JUNK.map(lambda v: json.dumps(v).encode()),
)
