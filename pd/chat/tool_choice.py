"""A forced tool call (tool_choice "required" or a named function), as vLLM does it: the answer is
constrained to a JSON schema made from the tools, and the constrained text is read back as the calls.

  named {"type": "function", "function": {"name": N}}   the output is the arguments object of N, under
      N's `parameters` schema; the call is (N, that text), content "", finish_reason as generated
  "required"   the output is a JSON array of 1+ (1 when parallel_tool_calls is false) objects
      {"name": <a tool's name>, "parameters": <that tool's arguments>}; one call per element
      (arguments = its parameters as JSON), content "", finish_reason "tool_calls" where it stopped

The prompt is rendered as for "auto" (tools included); no prefix or instruction is added to it.
"""

from __future__ import annotations

import json
from typing import Any

from pd.chat.toolcalls import NOT_JSON, ToolCall, new_call_id
from pd.errors import bad_request

_NO_PARAMETERS = {"type": "object", "properties": {}}


def forced_name(tool_choice: Any) -> str | None:
    """The function a named tool_choice forces; None for the string choices."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def is_forced(tool_choice: Any) -> bool:
    return tool_choice == "required" or isinstance(tool_choice, dict)


def forced_schema(
    tools: tuple[dict[str, Any], ...], tool_choice: Any, parallel_tool_calls: bool
) -> dict[str, Any] | None:
    """The JSON schema a forced choice constrains the output to (vLLM's `_get_json_schema_from_tool`);
    None when the choice forces nothing ("auto", "none")."""
    name = forced_name(tool_choice)
    if name is not None:
        # protocol.py checked that the name is among the tools
        fn = next(t["function"] for t in tools if t["function"]["name"] == name)
        return dict(fn.get("parameters") or _NO_PARAMETERS)
    if tool_choice != "required":
        return None
    defs: dict[str, Any] = {}
    options = []
    for i, t in enumerate(tools):
        params = dict(t["function"].get("parameters") or _NO_PARAMETERS)
        # "$ref": "#/$defs/X" points at the document's root: each tool's definitions move up there
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise bad_request(
                    f"tools define '$defs.{key}' differently, which tool_choice 'required' cannot combine",
                    f"tools[{i}].function.parameters",
                )
            defs[key] = value
        options.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_call(name: str, text: str) -> ToolCall:
    """A named choice's call: the constrained text is its arguments, as generated (vLLM's)."""
    return ToolCall(name, text, new_call_id())


class RequiredCalls:
    """Reads a "required" answer, `[{"name": ..., "parameters": {...}}, ...]`, as it streams: feed()
    returns the calls whose array element closed in this piece. The grammar made the text valid JSON, so
    only strings and nesting are tracked; an element cut short (max_tokens) is no call."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.is_escaped = False
        self.element_start = -1
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[ToolCall]:
        new: list[ToolCall] = []
        for ch in delta:
            self.text += ch
            if self.in_string:
                if self.is_escaped:
                    self.is_escaped = False
                elif ch == "\\":
                    self.is_escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.element_start = len(self.text) - 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and self.element_start >= 0:
                    call = _required_element(self.text[self.element_start :])
                    self.element_start = -1
                    if call is not None:
                        new.append(call)
        self.calls += new
        return new


def _required_element(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except NOT_JSON:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return ToolCall(obj["name"], json.dumps(obj.get("parameters", {}), ensure_ascii=False), new_call_id())


def required_calls(text: str) -> list[ToolCall]:
    reader = RequiredCalls()
    reader.feed(text)
    return reader.calls
