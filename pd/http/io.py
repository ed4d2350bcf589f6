"""Reading request bodies and writing JSON responses (orjson), the same way in every handler."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from pd.errors import ApiError, bad_request


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(e: ApiError) -> web.Response:
    resp = json_response(e.to_dict(), e.status)
    resp.headers.update(e.headers)
    if e.headers.get("Connection") == "close":
        resp.force_close()  # no lingering for the rest of a body that is not coming
    return resp


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The raw body. Raises 413 past max_bytes (the app's client_max_size), 408 when it does not arrive
    within timeout_s (the connection is then closed)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except web.HTTPRequestEntityTooLarge as e:
        raise ApiError(
            413, f"the request body is larger than {max_bytes} bytes", code="request_too_large"
        ) from e
    except asyncio.TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout_s:g} s",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None


async def read_json(request: web.Request, max_bytes: int, timeout_s: float) -> Any:
    """The parsed body (read_body's limits); 400 on bad JSON."""
    return parse_json(await read_body(request, max_bytes, timeout_s))


def parse_json(data: bytes) -> Any:
    if not data:
        raise bad_request("the request body is empty: send a JSON object")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from e


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }
