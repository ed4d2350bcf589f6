"""The OpenAI request checks (pd/api/protocol.py): chat and completion bodies, their defaults, what reaches
the engine's SamplingParams, vLLM's fields, and every bad input a 400 that names its field."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.request import SamplingParams
from pd.api.protocol import UNSUPPORTED_VLLM_FIELDS, parse_chat_request, parse_completion_request
from pd.errors import ApiError
from pd.http.io import parse_json

USER = [{"role": "user", "content": "hi"}]


ASSISTANT_LAST = [*USER, {"role": "assistant", "content": "The answer is"}]


CRITIC = [{"role": "critic", "content": "x"}]


def _bad(fn, body, param):
    with pytest.raises(ApiError) as e:
        fn(body)
    assert e.value.status == 400, e.value.message
    assert e.value.param == param, (e.value.param, e.value.message)
    err = e.value.to_dict()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


# ---- chat request checks -----------------------------------------------------------------------------------


def test_chat_defaults_and_fields():
    r = parse_chat_request({"model": "m", "messages": USER})
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.n, s.stream, s.use_prefix_cache) == (
        None,
        1.0,
        1.0,
        0,
        1,
        False,
        True,
    )
    r = parse_chat_request(
        {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                *USER,
            ],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "seed": 3,
            "stop": "x",
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "prefix_cache": False,
            "presence_penalty": 0,
            "unknown_field": {"ignored": True},
        }
    )
    s = r.sampling
    assert r.messages[0] == {"role": "system", "content": "a\nb"}
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.n) == (
        7,
        0.0,
        0.5,
        0,
        3,
        ("x",),
        2,
    )
    assert (s.stream, s.include_usage, s.use_prefix_cache, r.logprobs) == (True, True, False, 2)
    p1 = s.params(10, r.logprobs, 1)
    assert isinstance(p1, SamplingParams) and (p1.seed, p1.max_tokens, p1.logprobs, p1.stop) == (
        4,
        10,
        2,
        ("x",),
    )


def test_penalties_logit_bias_min_p_and_min_tokens_reach_the_engine():
    for parse, body in (
        (parse_chat_request, {"messages": USER}),
        (parse_completion_request, {"prompt": "hi"}),
    ):
        r = parse(
            {
                **body,
                "presence_penalty": -0.5,
                "frequency_penalty": 1.5,
                "repetition_penalty": 1.1,
                "logit_bias": {"42": -100, "7": 2.5},
                "min_p": 0.05,
                "min_tokens": 3,
            }
        )
        p = r.sampling.params(8, None, 0)
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (
            -0.5,
            1.5,
            1.1,
            0.05,
            3,
        )
        assert p.logit_bias == ((7, 2.5), (42, -100.0)) and p.has_penalties
        with pytest.raises(InvalidRequestError, match="min_tokens"):  # more than max_tokens: a 400
            r.sampling.params(2, None, 0)


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "user", "content": "x", "reasoning": "y"}]}, "messages[0].reasoning"),
        ({"messages": [{"role": "assistant", "reasoning_content": 5}]}, "messages[0].reasoning_content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
        ({"messages": USER, "model": 3}, "model"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_tokens": "5"}, "max_tokens"),
        ({"messages": USER, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": USER, "max_tokens": 2.5}, "max_tokens"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "n": True}, "n"),
        ({"messages": USER, "temperature": -1}, "temperature"),
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "top_p": 1.5}, "top_p"),
        ({"messages": USER, "top_k": -2}, "top_k"),
        ({"messages": USER, "seed": 2**63}, "seed"),
        ({"messages": USER, "seed": -(2**63) - 1}, "seed"),
        ({"messages": USER, "seed": 1.5}, "seed"),
        ({"messages": USER, "seed": "1"}, "seed"),
        ({"messages": USER, "stop": 3}, "stop"),
        ({"messages": USER, "stop": ["a", 3]}, "stop"),
        ({"messages": USER, "stream": "yes"}, "stream"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": USER, "stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
        ({"messages": USER, "stream": True, "stream_options": {"continuous_usage_stats": 1}}, "continuous_usage_stats"),
        (
            {"messages": USER, "stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
        ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
        (
            {"messages": ASSISTANT_LAST, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        ({"messages": USER, "add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"messages": USER, "add_special_tokens": 1}, "add_special_tokens"),
        ({"messages": USER, "use_beam_search": "yes"}, "use_beam_search"),
        ({"messages": USER, "length_penalty": 0.5}, "length_penalty"),  # beam search's alone
        ({"messages": USER, "use_beam_search": True, "n": 11}, "n"),
        ({"messages": USER, "use_beam_search": True, "top_p": 0.5}, "top_p"),
        ({"messages": USER, "use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"messages": USER, "use_beam_search": True, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": USER, "use_beam_search": True, "early_stopping": True}, "early_stopping"),
        ({"messages": USER, "use_beam_search": True, "length_penalty": 11}, "length_penalty"),
        ({"messages": USER, "skip_special_tokens": False}, "skip_special_tokens"),
        ({"messages": USER, "length_penalty": True}, "length_penalty"),
        ({"messages": USER, "echo": "yes"}, "echo"),
        ({"messages": USER, "prompt_embeds": [1.0]}, "prompt_embeds"),
        ({"messages": USER, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": USER, "logprobs": 1}, "logprobs"),
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": USER, "tools": {}}, "tools"),
        (
            {"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]},
            "tools[0].function.name",
        ),
        ({"messages": USER, "tools": [{"type": "code"}]}, "tools[0]"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        (
            {
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"messages": USER, "prefix_cache": "no"}, "prefix_cache"),
        ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": USER, "frequency_penalty": "1"}, "frequency_penalty"),
        ({"messages": USER, "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": USER, "repetition_penalty": 1e-50}, "repetition_penalty"),
        ({"messages": USER, "min_p": 1.5}, "min_p"),
        ({"messages": USER, "min_tokens": -1}, "min_tokens"),
        ({"messages": USER, "logit_bias": [1, 5]}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"a": 5}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"1": 101}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"1": 1, "01": 2}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"messages": USER, "response_format": {"type": "grammar"}}, "response_format.type"),
        ({"messages": USER, "structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"messages": USER, "structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
        ({"messages": USER, "guided_json": "{not json"}, "guided_json"),
    ],
)
def test_chat_bad_input(body, param):
    _bad(parse_chat_request, body, param)


def test_body_must_be_an_object():
    _bad(parse_chat_request, [1, 2], None)
    _bad(parse_completion_request, "prompt", None)


def test_assistant_tool_calls_and_tool_messages():
    r = parse_chat_request(
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
    )
    assert r.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert r.messages[2] == {"role": "tool", "content": "ok", "tool_call_id": "c"}
    assert r.uses_tools and r.tool_choice == {"type": "function", "function": {"name": "f"}}


def test_generation_prompt_custom_roles_and_seed_range():
    r = parse_chat_request({"messages": USER})
    assert (r.add_generation_prompt, r.continue_final_message, r.add_special_tokens) == (True, False, False)
    r = parse_chat_request({"messages": ASSISTANT_LAST, "continue_final_message": True})
    assert (r.add_generation_prompt, r.continue_final_message) == (False, True)  # no generation prompt
    r = parse_chat_request({"messages": USER, "add_generation_prompt": False, "add_special_tokens": True})
    assert (r.add_generation_prompt, r.continue_final_message, r.add_special_tokens) == (False, False, True)
    r = parse_chat_request({"messages": [*CRITIC, {"role": "developer", "content": ""}]})
    assert [m["role"] for m in r.messages] == ["critic", "system"]  # any role reaches the template
    for seed, engine_seed in ((-1, 2**63 - 1), (-(2**63), 0), (2**63 - 1, 2**63 - 1)):  # vLLM's int64 range
        r = parse_chat_request({"messages": USER, "seed": seed})
        assert r.sampling.params(1, None, 0).seed == engine_seed
    for raw in (b"18446744073709551616", b"-9223372036854775809"):  # past 64 bits: the JSON parser's float
        body = parse_json(b'{"messages": [{"role": "user", "content": ""}], "seed": %s}' % raw)
        with pytest.raises(ApiError, match="'seed' must be an integer between") as e:
            parse_chat_request(body)
        assert e.value.param == "seed" and "float" not in str(e.value)
    with pytest.raises(ApiError, match="'seed' must be an integer, got float"):
        parse_chat_request({"messages": USER, "seed": 1.5})
    assert parse_chat_request({"messages": USER, "top_logprobs": 0}).logprobs is None  # asks for nothing


def test_vllm_fields_that_ask_for_nothing_pass():
    """UNSUPPORTED_VLLM_FIELDS at vLLM's defaults (or null), as clients written for vLLM send them."""
    defaults = {key: neutral[0] if neutral else None for key, neutral in UNSUPPORTED_VLLM_FIELDS.items()}
    parse_chat_request({"messages": USER, **defaults, "length_penalty": 1})
    parse_completion_request({"prompt": "a", **defaults, "echo": True})


def test_continuous_usage_chat_echo_and_empty_prompt_embeds():
    """Issue 55's, as vLLM takes them: continuous_usage_stats with include_usage (alone it asks for nothing),
    chat's echo (the last message when it has the answer's role), an empty prompt_embeds beside a prompt."""
    stream = {"messages": USER, "stream": True}
    both = {"include_usage": True, "continuous_usage_stats": True}
    s = parse_chat_request({**stream, "stream_options": both}).sampling
    assert (s.include_usage, s.is_usage_continuous) == (True, True)
    s = parse_chat_request({**stream, "stream_options": {"continuous_usage_stats": True}}).sampling
    assert (s.include_usage, s.is_usage_continuous) == (False, False)
    assert parse_completion_request({"prompt": "a", "stream": True, "stream_options": both}).sampling.is_usage_continuous
    prefilled = [*USER, {"role": "assistant", "content": "An apple a day"}]
    continued = {"messages": prefilled, "continue_final_message": True, "echo": True}
    assert parse_chat_request(continued).echoed == "An apple a day"
    assert parse_chat_request({**continued, "echo": False}).echoed == ""
    assert parse_chat_request({"messages": USER, "echo": True}).echoed == ""  # the user's: not the answer's role
    no_prompt = {"messages": USER, "echo": True, "add_generation_prompt": False}
    assert parse_chat_request(no_prompt).echoed == "hi"  # vLLM's: the answer takes the last message's role
    assert parse_completion_request({"prompt": "a", "prompt_embeds": []}).prompts == ("a",)
    _bad(parse_completion_request, {"prompt_embeds": []}, "prompt")
    _bad(parse_completion_request, {"prompt": "a", "prompt_embeds": "AAAA"}, "prompt_embeds")


def test_beam_search_fields():
    """vLLM's use_beam_search: n is the width, length_penalty and include_stop_str_in_output come with it;
    completions refuse it streamed and echoed (vLLM's), chat streams the finished beams."""
    s = parse_chat_request({"messages": USER, "use_beam_search": True, "n": 3, "length_penalty": 0.5}).sampling
    assert s.beam is not None and (s.beam.width, s.beam.length_penalty, s.beam.include_stop_str_in_output) == (3, 0.5, False)
    s = parse_chat_request({"messages": USER, "use_beam_search": True, "stream": True, "temperature": 0.7}).sampling
    assert s.beam is not None and s.beam.width == 1 and s.stream
    beam = {"prompt": "a", "use_beam_search": True, "n": 2, "best_of": 2, "include_stop_str_in_output": True}
    s = parse_completion_request({**beam, "prompt": ["a", "b"], "ignore_eos": True, "seed": 3}).sampling
    assert s.beam is not None and s.beam.include_stop_str_in_output and s.ignore_eos
    assert parse_completion_request({"prompt": "a", "use_beam_search": False}).sampling.beam is None
    _bad(parse_completion_request, {**beam, "stream": True}, "stream")
    _bad(parse_completion_request, {**beam, "echo": True}, "echo")
    _bad(parse_completion_request, {**beam, "best_of": 3}, "best_of")
    _bad(parse_completion_request, {**beam, "logit_bias": {"1": 1}}, "logit_bias")
    _bad(parse_completion_request, {"prompt": "a", "include_stop_str_in_output": True}, "include_stop_str_in_output")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    forced = {"messages": USER, "use_beam_search": True, "tools": tools, "tool_choice": "required"}
    _bad(parse_chat_request, forced, "tool_choice")


# ---- completion request checks -----------------------------------------------------------------------------


def test_completion_prompts():
    assert parse_completion_request({"prompt": "a"}).prompts == ("a",)
    assert parse_completion_request({"prompt": [1, 2]}).prompts == ((1, 2),)
    assert parse_completion_request({"prompt": ["a", "b"], "n": 2}).prompts == ("a", "b")
    assert parse_completion_request({"prompt": [[1], [2, 3]]}).prompts == ((1,), (2, 3))
    r = parse_completion_request({"prompt": "a", "logprobs": 3, "echo": True, "max_tokens": 4})
    assert (r.logprobs, r.echo, r.sampling.max_tokens, r.add_special_tokens) == (3, True, 4, True)
    assert not parse_completion_request({"prompt": "a", "add_special_tokens": False}).add_special_tokens


def test_echo_with_logprobs_asks_for_the_prompts_logprobs():
    """vLLM's: echo with logprobs N computes prompt logprobs N (unless prompt_logprobs says otherwise);
    max_tokens 0 is taken with echo alone."""
    parse = lambda **kw: parse_completion_request({"prompt": "a", **kw}).sampling  # noqa: E731
    assert parse(echo=True, logprobs=2).prompt_logprobs == 2
    assert parse(echo=True, logprobs=2, prompt_logprobs=5).prompt_logprobs == 5
    assert parse(logprobs=2).prompt_logprobs is None and parse(echo=True).prompt_logprobs is None
    assert parse(echo=True, logprobs=1, stream=True).prompt_logprobs == 1  # streamed in the echo
    assert parse(echo=True, max_tokens=0).max_tokens == 0
    chat = parse_chat_request({"messages": USER, "prompt_logprobs": 3})
    assert chat.sampling.params(4, None, 0).prompt_logprobs == 3


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "logprobs": 30}, "logprobs"),
        ({"prompt": "a", "echo": "yes"}, "echo"),
        ({"prompt": "a", "suffix": "b"}, "suffix"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
        ({"prompt": "a", "include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"prompt": "a", "bad_words": ["b"]}, "bad_words"),
        ({"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        ({"prompt": "a", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ],
)
def test_completion_bad_input(body, param):
    _bad(parse_completion_request, body, param)
