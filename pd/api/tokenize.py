"""vLLM's /tokenize and /detokenize, and /version (single-engine server and CE).

    POST /tokenize   {"prompt": str, "add_special_tokens": bool (true)}
                     or {"messages": [...], "tools"?, "tool_choice"?, "chat_template_kwargs"?,
                         "reasoning_effort"?, "add_generation_prompt"? (true),
                         "continue_final_message"? (false), "add_special_tokens"? (false)}
                     (rendered as chat requests are)
                     -> {"count", "max_model_len", "tokens": [int], "token_strs": [str] | null}
                        (token_strs with "return_token_strs": true)
    POST /detokenize {"tokens": [int]} -> {"prompt": str}
    GET  /version    -> {"version": str}
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from aiohttp import web

from pd.api.chat import render
from pd.api.protocol import parse_chat_request, parse_model, parse_object, parse_token_ids
from pd.errors import bad_request
from pd.frontend.coordinator import Coordinator
from pd.http.io import json_response


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = _version()


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean, got {type(v).__name__}", key)
    return v


async def tokenize(co: Coordinator, request: web.Request) -> web.Response:
    body = parse_object(await co.read_json(request))
    co.check_model(parse_model(body))
    with_strs = _flag(body, "return_token_strs", False)
    if "messages" in body:
        keys = (
            "messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort",
            "add_generation_prompt", "continue_final_message", "add_special_tokens",
            "chat_template", "documents", "mm_processor_kwargs",  # vLLM's, refused
        )  # fmt: skip
        req = parse_chat_request({k: body[k] for k in keys if k in body})
        ids = list((await render(co, req)).token_ids)
    elif "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", "prompt")
        special = _flag(body, "add_special_tokens", True)
        ids = await co.offload(lambda: list(co.tokenizer(prompt, add_special_tokens=special)["input_ids"]))
    else:
        raise bad_request("give 'prompt' (a string) or 'messages'", "prompt")
    answer: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": co.max_model_len,
        "tokens": ids,
        "token_strs": co.tokenizer.convert_ids_to_tokens(ids) if with_strs else None,
    }
    return json_response(answer)


async def detokenize(co: Coordinator, request: web.Request) -> web.Response:
    body = parse_object(await co.read_json(request))
    co.check_model(parse_model(body))
    ids = parse_token_ids(body, "tokens", len(co.tokenizer))
    text = await co.offload(co.tokenizer.decode, ids)
    return json_response({"prompt": text})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": VERSION})
