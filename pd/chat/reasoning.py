"""Reasoning ("thinking") split from the answer: `<think>...</think>` in a chat answer becomes
`reasoning_content`, the rest `content`, whole or streamed (--reasoning-parser; vLLM's parsers' names).

    deepseek_r1  the template opens <think> in the prompt: the answer starts in reasoning (a leading
                 <think> in the output is dropped) and </think> ends it; no </think>: all reasoning
    qwen3        reasoning only when the output starts with <think>, or when the prompt ends with one
                 (Qwen3 thinking-2507 templates open it there); `enable_thinking: false` (a
                 chat_template_kwargs entry) turns it off; otherwise all content

A reasoning that never closes (max_tokens hit while thinking) is all reasoning, streamed or not: the
whole answer is the streamed one's concatenation, since both go through one ReasoningSplitter.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

THINK_START = "<think>"
THINK_END = "</think>"


class Start(enum.Enum):
    """How an answer starts."""

    IN_REASONING = "in_reasoning"  # thinking from the first token; a leading <think> is dropped
    IF_TAG = "if_tag"  # thinking only when the output starts with <think>


class ReasoningParser(Protocol):
    name: str

    def start(self, prompt_text: str, template_kwargs: dict[str, Any]) -> Start | None:
        """How the answer to this rendered prompt starts; None: no reasoning to split off."""
        ...


class DeepSeekR1Parser:
    name = "deepseek_r1"

    def start(self, prompt_text: str, template_kwargs: dict[str, Any]) -> Start | None:
        return Start.IN_REASONING


class Qwen3Parser:
    name = "qwen3"

    def start(self, prompt_text: str, template_kwargs: dict[str, Any]) -> Start | None:
        if template_kwargs.get("enable_thinking") is False:
            return None
        return Start.IN_REASONING if prompt_text.rstrip().endswith(THINK_START) else Start.IF_TAG


def continued_start(final_message: str) -> Start | None:
    """How an answer that continues the client's final message (continue_final_message) starts: thinking
    when that message left a <think> open, else all content, whatever the template does."""
    return Start.IN_REASONING if final_message.rfind(THINK_START) > final_message.rfind(THINK_END) else None


PARSERS: dict[str, ReasoningParser] = {p.name: p for p in (DeepSeekR1Parser(), Qwen3Parser())}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser --reasoning-parser names (None: none)."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (a tag arriving in pieces)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _Phase(enum.Enum):
    HEAD = "head"  # before the first non-space text: a leading <think> may be arriving
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningSplitter:
    """One answer's text, fed in deltas, split into (reasoning, content) deltas safe to send now.

    Text that may be the beginning of a tag is held back until the next delta (or finish) decides it.
    """

    def __init__(self, start: Start) -> None:
        self.start = start
        self.phase = _Phase.HEAD
        self.held = ""
        self.has_reasoning = False  # the answer entered reasoning (so `content` may be None)

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) of the answer so far that were not returned yet."""
        self.held += delta
        if self.phase is _Phase.HEAD:
            head = self.held.lstrip()
            if head.startswith(THINK_START):
                self.held = head[len(THINK_START) :]
                self._enter(_Phase.REASONING)
            elif THINK_START.startswith(head):
                return "", ""  # only spaces, or a part of <think>, so far
            else:
                self._enter(_Phase.REASONING if self.start is Start.IN_REASONING else _Phase.CONTENT)
        reasoning = ""
        if self.phase is _Phase.REASONING:
            before, end, after = self.held.partition(THINK_END)
            if end:
                reasoning, self.held = before, after
                self.phase = _Phase.CONTENT
            else:
                cut = len(self.held) - _partial_suffix(self.held, THINK_END)
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
        content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the answer's end."""
        rest, self.held = self.held, ""
        if self.phase is _Phase.HEAD:
            self._enter(_Phase.REASONING if self.start is Start.IN_REASONING else _Phase.CONTENT)
        return (rest, "") if self.phase is _Phase.REASONING else ("", rest)

    def _enter(self, phase: _Phase) -> None:
        self.phase = phase
        self.has_reasoning = self.has_reasoning or phase is _Phase.REASONING


def split_reasoning(start: Start, text: str) -> tuple[str | None, str]:
    """A whole answer's (reasoning, content); reasoning None when the answer has none."""
    s = ReasoningSplitter(start)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2 if s.has_reasoning else None), c1 + c2
