"""Reading request bodies and writing JSON responses (orjson), the same way in every handler."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from aiohttp import web

from pd.errors import ApiError, bad_request


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(e: ApiError) -> web.Response:
    return json_response(e.to_dict(), e.status)


async def read_json(request: web.Request, max_bytes: int) -> Any:
    """The parsed body. Raises 413 past max_bytes (the app's client_max_size) and 400 on bad JSON."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")
    try:
        data = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise ApiError(
            413, f"the request body is larger than {max_bytes} bytes", code="request_too_large"
        ) from e
    if not data:
        raise bad_request("the request body is empty: send a JSON object")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from e


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }
