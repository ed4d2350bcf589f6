"""Reasoning split (--reasoning-parser), chat_template_kwargs / reasoning_effort checks and rendering,
and the refusals of non-text inputs: the pure parts, no engine."""

from __future__ import annotations

import pytest

from pd.api.protocol import RESERVED_TEMPLATE_KWARGS, parse_chat_request
from pd.chat.reasoning import (
    PARSERS,
    DeepSeekR1Parser,
    Qwen3Parser,
    ReasoningSplitter,
    Start,
    reasoning_parser,
    split_reasoning,
)
from pd.chat.renderer import PromptRenderer
from pd.config import REASONING_PARSERS
from pd.errors import ApiError

USER = [{"role": "user", "content": "hi"}]
IN, IF = Start.IN_REASONING, Start.IF_TAG

# (start, output, reasoning, content); reasoning None: the answer has none
CASES = [
    (IN, "<think>Let me see.</think>Paris.", "Let me see.", "Paris."),
    (IN, "Let me see.</think>\n\nParis.", "Let me see.", "\n\nParis."),  # <think> was in the prompt
    (IN, "\n<think>a</think>b", "a", "b"),
    (IN, "thinking, never done", "thinking, never done", ""),  # unterminated: all reasoning
    (IN, "<think>cut short", "cut short", ""),
    (IN, "</think>answer", "", "answer"),
    (IN, "<thi", "<thi", ""),
    (IN, "", "", ""),
    (IN, "a <think> b</think>c", "a <think> b", "c"),  # only a leading <think> is a tag
    (IN, "a</think>b</think>c", "a", "b</think>c"),
    (IF, "<think>Let me see.</think>Paris.", "Let me see.", "Paris."),
    (IF, "  <think>x</think>y", "x", "y"),
    (IF, "Paris.", None, "Paris."),  # no <think>: all content
    (IF, "Paris.</think>", None, "Paris.</think>"),
    (IF, "  Paris", None, "  Paris"),  # spaces held back, then sent as they were
    (IF, "<think>cut short", "cut short", ""),
    (IF, "<thi", None, "<thi"),
    (IF, "<thinking>", None, "<thinking>"),
    (IF, "", None, ""),
]


@pytest.mark.parametrize("start,text,reasoning,content", CASES)
def test_split_whole(start, text, reasoning, content):
    assert split_reasoning(start, text) == (reasoning, content)


def _streamed(start: Start, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    s = ReasoningSplitter(start)
    out = [s.feed(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out), out


@pytest.mark.parametrize("start,text,reasoning,content", CASES)
def test_split_streamed_at_every_position(start, text, reasoning, content):
    """The tags may arrive split anywhere: every cut into two and three pieces, and one char at a time,
    give the whole split (so no delta ever showed a part of a tag)."""
    cuts = [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    for pieces in [*cuts, list(text)]:
        r, c, _ = _streamed(start, pieces)
        assert (r, c) == (reasoning or "", content), pieces


def test_streamed_reasoning_goes_out_before_the_end():
    s = ReasoningSplitter(IN)
    assert s.feed("<think>") == ("", "")
    assert s.feed("step one, ") == ("step one, ", "")
    assert s.feed("step two</") == ("step two", "")  # "</" may be the end tag: held
    assert s.feed("think>\n\nAns") == ("", "\n\nAns")
    assert s.feed("wer") == ("", "wer")
    assert s.finish() == ("", "")
    q = ReasoningSplitter(IF)
    assert q.feed("Hello") == ("", "Hello")  # no <think> first: content at once


def test_parsers_and_registry():
    assert set(PARSERS) == {"deepseek_r1", "qwen3"} and reasoning_parser(None) is None
    assert tuple(PARSERS) == REASONING_PARSERS  # the flag's choices (pd/config.py) are the parsers here
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("granite")
    r1, q3 = reasoning_parser("deepseek_r1"), reasoning_parser("qwen3")
    assert isinstance(r1, DeepSeekR1Parser) and isinstance(q3, Qwen3Parser)
    prompt, opened, closed = (
        "<|im_start|>assistant\n",
        "<|im_start|>assistant\n<think>\n",
        "<think>\n\n</think>\n\n",
    )
    assert r1.start(prompt, {}) is IN and r1.start(prompt, {"enable_thinking": False}) is IN
    assert q3.start(prompt, {}) is IF and q3.start(opened, {}) is IN and q3.start(closed, {}) is IF
    assert q3.start(prompt, {"enable_thinking": False}) is None
    assert q3.start(opened, {"enable_thinking": True}) is IN


# ---- request checks ----------------------------------------------------------------------------------


def _bad(body: dict, param: str, code: str | None = None) -> str:
    with pytest.raises(ApiError) as e:
        parse_chat_request(body)
    assert (e.value.status, e.value.param) == (400, param), (e.value.param, e.value.message)
    if code is not None:
        assert e.value.code == code
    return e.value.message


def test_chat_template_kwargs_and_reasoning_effort():
    r = parse_chat_request({"messages": USER})
    assert r.chat_template_kwargs == {} and r.include_reasoning
    r = parse_chat_request(
        {
            "messages": USER,
            "chat_template_kwargs": {"enable_thinking": False, "custom": [1, {"a": None}]},
            "reasoning_effort": "low",
            "include_reasoning": False,
        }
    )
    assert r.chat_template_kwargs == {
        "enable_thinking": False,
        "custom": [1, {"a": None}],
        "reasoning_effort": "low",
    }
    assert not r.include_reasoning
    for effort in ("none", "minimal", "medium", "high"):
        assert parse_chat_request({"messages": USER, "reasoning_effort": effort}).chat_template_kwargs == {
            "reasoning_effort": effort
        }
    # the top-level field wins over the same kwarg
    r = parse_chat_request(
        {"messages": USER, "chat_template_kwargs": {"reasoning_effort": "x"}, "reasoning_effort": "high"}
    )
    assert r.chat_template_kwargs == {"reasoning_effort": "high"}
    assert parse_chat_request({"messages": USER, "chat_template_kwargs": None}).chat_template_kwargs == {}


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": [["enable_thinking", False]]}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_effort": 2}, "reasoning_effort"),
        ({"include_reasoning": "no"}, "include_reasoning"),
    ],
)
def test_bad_template_kwargs(extra, param):
    _bad({"messages": USER, **extra}, param)


@pytest.mark.parametrize("key", sorted(RESERVED_TEMPLATE_KWARGS))
def test_template_kwargs_may_not_clash_with_the_renderers_arguments(key):
    message = _bad(
        {"messages": USER, "chat_template_kwargs": {"enable_thinking": True, key: 1}}, "chat_template_kwargs"
    )
    assert key in message


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
    ],
)
def test_non_text_content_parts_are_refused(part):
    content = [{"type": "text", "text": "What is this?"}, part]
    message = _bad(
        {"messages": [{"role": "user", "content": content}]}, "messages[0].content", "unsupported_content"
    )
    assert f"'messages[0].content[1]' is a '{part['type']}' part" in message and "text-only" in message


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"modalities": "text"}, "modalities"),
    ],
)
def test_audio_output_is_refused(extra, param):
    _bad({"messages": USER, **extra}, param)


def test_text_modalities_and_earlier_reasoning_are_fine():
    r = parse_chat_request(
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
            ],
            "modalities": ["text"],
        }
    )
    assert r.messages[1] == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning": "A greeting.",  # the template reads either name (vLLM's)
        "reasoning_content": "A greeting.",
    }
    assert r.messages[2]["content"] == "again"


# ---- rendering -------------------------------------------------------------------------------------

# A template whose prompt shows its extra variables and opens the thinking as DeepSeek-R1's does.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "[thinking={{ 'off' if enable_thinking is defined and not enable_thinking else 'on' }}"
    " effort={{ reasoning_effort | default('unset') }}]"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def renderer():
    from pd.frontend.coordinator import load_tokenizer

    return PromptRenderer(load_tokenizer("smollm2-135m-instruct"), TEMPLATE)


def test_template_kwargs_reach_the_template(renderer):
    msgs = tuple(parse_chat_request({"messages": USER}).messages)
    assert "[thinking=on effort=unset]" in renderer.render_chat(msgs).text
    req = parse_chat_request(
        {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"}
    )
    p = renderer.render_chat(req.messages, req.tools, req.tool_choice, req.chat_template_kwargs)
    assert "[thinking=off effort=high]" in p.text and p.text.endswith("<think>\n")
    assert reasoning_parser("qwen3").start(p.text, {}) is IN  # the prompt opened the thinking
