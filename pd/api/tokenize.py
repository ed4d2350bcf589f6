"""vLLM's /tokenize and /detokenize, and /version (single-engine server and CE).

    POST /tokenize   {"prompt": str, "add_special_tokens": bool (true)}
                     or {"messages": [...], "tools"?, "tool_choice"?, "chat_template_kwargs"?,
                         "reasoning_effort"?, "add_generation_prompt"? (true),
                         "continue_final_message"? (false), "add_special_tokens"? (false)}
                     (rendered as chat requests are)
                     -> {"count", "max_model_len", "tokens": [int], "token_strs": [str] | null}
                        (token_strs with "return_token_strs": true)
    POST /detokenize {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info -> the tokenizer's configuration (vLLM's --enable-tokenizer-info-endpoint, served
                     here by default: it tells nothing /tokenize does not): its init arguments (special
                     tokens as their text, `added_tokens_decoder` as {id: {"content", "special", ...}}),
                     `tokenizer_class`, and `chat_template`, the one the server renders with
    GET  /version    -> {"version": str}
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pd import __version__
from pd.api.chat import render
from pd.api.protocol import parse_chat_request, parse_model, parse_object, parse_token_ids
from pd.errors import bad_request
from pd.frontend.coordinator import Coordinator
from pd.http.io import json_response

VERSION = __version__


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


# the tokenizer's init arguments that name files on this host: left out (name_or_path: the --model given)
_FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def _plain(value: Any) -> Any:
    """A tokenizer init argument as JSON takes it: an AddedToken as its text (vLLM's), containers item by
    item, anything else JSON has no type for as its str."""
    if hasattr(value, "content") and isinstance(value.content, str):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def tokenizer_info(co: Coordinator) -> dict[str, Any]:
    """vLLM's /tokenizer_info answer, with added_tokens_decoder whole as in tokenizer_config.json."""
    tokenizer = co.tokenizer
    kwargs = dict(getattr(tokenizer, "init_kwargs", None) or {})
    added = kwargs.pop("added_tokens_decoder", None) or getattr(tokenizer, "added_tokens_decoder", {})
    info = {k: _plain(v) for k, v in kwargs.items() if k not in _FILE_KEYS and k != "chat_template"}
    info["name_or_path"] = co.cfg.engine.model
    info["added_tokens_decoder"] = {
        str(i): t.__getstate__() if hasattr(t, "__getstate__") and hasattr(t, "special") else _plain(t)
        for i, t in sorted(added.items())
    }
    info["tokenizer_class"] = type(tokenizer).__name__
    if co.renderer.template is not None:
        info["chat_template"] = co.renderer.template
    return info


async def tokenizer_info_endpoint(co: Coordinator, request: web.Request) -> web.Response:
    info = await co.offload(tokenizer_info, co)
    # the stdlib's encoder: a tokenizer's model_max_length may be past 64 bits (transformers' "no limit")
    return web.Response(text=json.dumps(info), content_type="application/json")


async def version(request: web.Request) -> web.Response:
    return json_response({"version": VERSION})
