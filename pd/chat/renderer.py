"""Chat messages (and tools) -> prompt token ids, through the checkpoint's own chat template.

A template that does not mention tools gets them through FALLBACK_TOOLS_PROMPT, a Hermes-style system
prompt (the format Qwen2.5 and Hermes templates teach): the tool signatures as JSON inside <tools>, and
calls asked for as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. In that mode, earlier
assistant tool calls are written back in the same format and tool results become user turns in
<tool_response> tags, so any template can render the whole conversation.

A forced call (tool_choice "required" or a named function) renders the same prompt as "auto": the answer is
constrained to the tools' JSON schema instead (pd/chat/tool_choice.py), as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pd.chat.toolcalls import ToolParser, parser_for_template
from pd.errors import bad_request

FALLBACK_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: tuple[int, ...]


def _arguments_as_object(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except (ValueError, RecursionError):
            return args
    return args


class PromptRenderer:
    """Renders chats for one tokenizer; knows whether its template has tool support."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template: str | None = chat_template or getattr(tokenizer, "chat_template", None) or None
        if isinstance(self.template, dict):  # some tokenizers keep several named templates
            self.template = self.template.get("default") or next(iter(self.template.values()), None)
        self.supports_tools = self.template is not None and "tools" in self.template
        self.tool_parser: ToolParser = parser_for_template(self.template if self.supports_tools else None)

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A raw completion prompt: the tokenizer's own special tokens (BOS) included unless told not to."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render_chat(
        self,
        messages: tuple[dict[str, Any], ...],
        tools: tuple[dict[str, Any], ...] = (),
        tool_choice: Any = "auto",
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> RenderedPrompt:
        """template_kwargs: more variables for the template (chat_template_kwargs; the caller keeps them
        off the renderer's own arguments). continue_final_message: the prompt ends inside the last message,
        where its content ends (transformers renders it closed and cuts what follows the content).
        add_special_tokens: the tokenizer's own (BOS) on top of what the template writes."""
        if self.template is None:
            raise bad_request(
                "this model has no chat template: use /v1/completions, or start the server with --chat-template FILE",
                "messages",
                code="no_chat_template",
            )
        use_tools = bool(tools) and tool_choice != "none"
        msgs = [dict(m) for m in messages]
        if use_tools and not self.supports_tools:
            msgs = self._with_fallback_tools(msgs, tools)
        else:
            for m in msgs:
                if m.get("tool_calls"):
                    m["tool_calls"] = [
                        {
                            **c,
                            "function": {
                                **c["function"],
                                "arguments": _arguments_as_object(c["function"]["arguments"]),
                            },
                        }
                        for c in m["tool_calls"]
                    ]
        for m in msgs:
            if m.get("content") is None:
                m["content"] = ""
        try:
            text = self.tokenizer.apply_chat_template(
                msgs,
                tools=list(tools) if use_tools and self.supports_tools else None,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except Exception as e:  # jinja raises TemplateError (and the template's own raise_exception)
            raise bad_request(f"the chat template refused these messages: {e}", "messages") from e
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return RenderedPrompt(text, tuple(ids))

    def _with_fallback_tools(
        self, msgs: list[dict[str, Any]], tools: tuple[dict[str, Any], ...]
    ) -> list[dict[str, Any]]:
        block = FALLBACK_TOOLS_PROMPT.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        out: list[dict[str, Any]] = []
        for m in msgs:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [
                    "<tool_call>\n"
                    + json.dumps(
                        {
                            "name": c["function"]["name"],
                            "arguments": _arguments_as_object(c["function"]["arguments"]),
                        }
                    )
                    + "\n</tool_call>"
                    for c in m["tool_calls"]
                ]
                text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
                out.append({"role": "assistant", "content": text})
            elif m["role"] == "tool":
                out.append(
                    {
                        "role": "user",
                        "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>",
                    }
                )
            else:
                out.append(m)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
        return out
