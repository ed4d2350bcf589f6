"""A request's conversation key, read from its raw JSON body: the key the CE itself routes by (its rank
and its PE: pd/api/chat.py's affinity_key, pd/api/completions.py's), so that the router, the CE and the
PE pool agree on what one conversation is. tests/pd/router/test_router.py holds the two equal."""

from __future__ import annotations

from typing import Any

COMPLETION_KEY_CHARS = 1024  # pd/api/completions.py's _AFFINITY_CHARS
COMPLETION_KEY_TOKENS = 256


def _text(content: Any) -> str:
    """A message's content as the CE normalizes it (pd/api/protocol.py): a string, or its text parts
    joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def conversation_key(path: str, body: Any) -> str | None:
    """Chat: the first user message (the same on every turn). Completions: the first prompt's first
    1024 characters (or 256 token ids). /invocations: either, told apart as the CE does (pd/api/invocations.py).
    None: nothing to keep together (the CE will judge the body)."""
    if not isinstance(body, dict):
        return None
    if path == "/invocations":
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        for m in messages:
            if isinstance(m, dict) and m.get("role") == "user":
                return _text(m.get("content"))
        return None
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts: the first, as the CE
        if isinstance(prompt, str):
            return prompt[:COMPLETION_KEY_CHARS]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return ",".join(map(str, prompt[:COMPLETION_KEY_TOKENS]))
    return None


# what of a chat body /tokenize renders as the chat (pd/api/tokenize.py)
CHAT_TOKENIZE_KEYS = (
    "messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort", "add_generation_prompt",
    "continue_final_message", "add_special_tokens",
)  # fmt: skip


def prompt_ids(path: str, body: Any) -> list[int] | dict[str, Any] | None:
    """The token ids of a request's (first) prompt for a kv-aware choice: a completions body's own ids,
    else the /tokenize body that gives them as the CE will prefill them (its template and tokenizer);
    None: the body has no prompt to read (the CE will judge it)."""
    if not isinstance(body, dict):
        return None
    if path == "/invocations":
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    model = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
    if path == "/v1/chat/completions":
        if not isinstance(body.get("messages"), list):
            return None
        return {**model, **{k: body[k] for k in CHAT_TOKENIZE_KEYS if k in body}}
    if path != "/v1/completions":
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # several prompts: the first, as the CE's key
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    if isinstance(prompt, str):
        special = body.get("add_special_tokens", True)
        return {**model, "prompt": prompt, "add_special_tokens": special if isinstance(special, bool) else True}
    return None
