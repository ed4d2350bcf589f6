"""Tool calls in model output: parsers for the formats chat templates teach, and a streaming hold-back.

Formats (picked from the chat template's text, see `parser_for_template`):
  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2/2.5/3, and the
               fallback system prompt for templates without tool support)
  llama3_json  the whole answer is `{"name": ..., "parameters": {...}}` (optionally `<|python_tag|>` first,
               several calls separated by `;`)
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`
A block that does not parse stays in the content: the client sees the text, never a broken call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            d["index"] = index
        return d


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: tuple[ToolCall, ...]


# what a parse of model output raises when it is no (JSON) call: nesting deeper than the decoder's
# recursion limit is no call either, never a RecursionError that fails the request
NOT_JSON = (ValueError, RecursionError)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_from(obj: Any) -> ToolCall | None:
    """{"name": str, "arguments"|"parameters": object|json-string} -> ToolCall, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except NOT_JSON:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def _loads_lenient(text: str) -> Any:
    """JSON of a call as small models write it: trailing junk ignored, a missing final brace added,
    a half-written closing tag dropped. Raises ValueError when nothing parses."""
    text = text.strip()
    for k in range(len("</tool_call>"), 1, -1):
        if text.endswith("</tool_call>"[:k]):
            text = text[:-k].rstrip()
            break
    dec = json.JSONDecoder()
    for candidate in (text, text + "}"):
        try:
            return dec.raw_decode(candidate)[0]
        except NOT_JSON:
            continue
    raise ValueError("no JSON object")


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


class HermesParser:
    name = "hermes"
    start_markers: tuple[str, ...] = ("<tool_call>",)
    json_at_start = False
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        for m in self._block.finditer(text):
            try:
                call = _call_from(_loads_lenient(m.group(1)))
            except NOT_JSON:
                call = None
            if call is None:
                continue  # not a call: its text stays in the content
            kept.append(text[pos : m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        return ParsedOutput(_content("".join(kept)) if calls else _content(text), tuple(calls))


class Llama3JsonParser:
    name = "llama3_json"
    start_markers: tuple[str, ...] = ("<|python_tag|>",)
    json_at_start = True

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return ParsedOutput(_content(text), ())
        dec = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = dec.raw_decode(body, pos)
            except NOT_JSON:
                return ParsedOutput(_content(text), ())
            call = _call_from(obj)
            if call is None:
                return ParsedOutput(_content(text), ())
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParsedOutput(None, tuple(calls))


class MistralParser:
    name = "mistral"
    start_markers: tuple[str, ...] = ("[TOOL_CALLS]",)
    json_at_start = False
    _named = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")

    def parse(self, text: str) -> ParsedOutput:
        head, marker, rest = text.partition("[TOOL_CALLS]")
        if not marker:
            return ParsedOutput(_content(text), ())
        calls: list[ToolCall] = []
        dec = json.JSONDecoder()
        try:
            for chunk in rest.split("[TOOL_CALLS]"):
                m = self._named.match(chunk)
                if m:  # v11+: name[ARGS]{...}
                    args, _ = dec.raw_decode(chunk, m.end())
                    call = _call_from({"name": m.group(1), "arguments": args})
                    if call is None:
                        raise ValueError("bad call")
                    calls.append(call)
                    continue
                objs, _ = dec.raw_decode(chunk.strip())
                for obj in objs if isinstance(objs, list) else [objs]:
                    call = _call_from(obj)
                    if call is None:
                        raise ValueError("bad call")
                    calls.append(call)
        except NOT_JSON:
            return ParsedOutput(_content(text), ())
        return ParsedOutput(_content(head), tuple(calls))


ToolParser = HermesParser | Llama3JsonParser | MistralParser
PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for_template(template: str | None) -> ToolParser:
    """The format a chat template teaches its model; hermes when it teaches none (our fallback prompt's)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MistralParser()
    if "<tool_call>" in t:
        return HermesParser()
    if "<|python_tag|>" in t or ('"parameters"' in t and "ipython" in t):
        return Llama3JsonParser()
    return HermesParser()


class ToolStreamFilter:
    """Streams content while holding back anything that may be the start of a tool call.

    feed() returns the text that is safe to send now; finish() parses everything (with `parse`, by
    default the parser's own) and returns the content not yet sent plus the tool calls.
    """

    def __init__(self, parser: ToolParser, parse: Callable[[str], ParsedOutput] | None = None) -> None:
        self.parser = parser
        self.parse = parse or parser.parse
        self.text = ""
        self.num_sent = 0
        self.in_call = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_call:
            return ""
        rest = self.text[self.num_sent :]
        if self.parser.json_at_start and self.num_sent == 0 and not self.text.strip():
            return ""  # only whitespace so far: a JSON call may still follow
        if self.parser.json_at_start and self.num_sent == 0 and self.text.lstrip().startswith("{"):
            self.in_call = True
            return ""
        cut = len(rest)
        for marker in self.parser.start_markers:
            i = rest.find(marker)
            if i >= 0:
                cut = min(cut, i)
                self.in_call = True
        if not self.in_call:
            for marker in self.parser.start_markers:  # a marker may be arriving in pieces
                for k in range(min(len(marker) - 1, len(rest)), 0, -1):
                    if rest.endswith(marker[:k]):
                        cut = min(cut, len(rest) - k)
                        break
        self.num_sent += cut
        return rest[:cut]

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        parsed = self.parse(self.text)
        sent = self.text[: self.num_sent]
        if not parsed.tool_calls:
            return self.text[self.num_sent :], ()
        content = parsed.content or ""
        if content.startswith(sent.strip()) and sent.strip():
            return content[len(sent.strip()) :], parsed.tool_calls
        return ("" if sent.strip() else content), parsed.tool_calls
