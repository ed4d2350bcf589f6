"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n`, closed by `data: [DONE]\\n\\n`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from pd.errors import ApiError

if TYPE_CHECKING:
    from pd.generation import ChoiceUpdate, Generation

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def stream_choices(
    request: web.Request,
    gen: Generation,
    chunk: Callable[[ChoiceUpdate], dict[str, Any] | None],
    final_usage: Callable[[], dict[str, Any] | None],
) -> web.StreamResponse:
    """A generation as an SSE response: one event per update that `chunk` turns into a chunk, then
    `final_usage()` (None: not asked for), then [DONE].

    The response starts only once the first update is there, so a rejection before any token is still
    a plain HTTP error; an error after that goes in-band, with no [DONE].
    """
    updates = gen.updates()
    first = await updates.__anext__()
    resp = web.StreamResponse(headers=HEADERS)
    await resp.prepare(request)
    try:
        c = chunk(first)
        if c is not None:
            await resp.write(sse_event(c))
        async for u in updates:
            c = chunk(u)
            if c is not None:
                await resp.write(sse_event(c))
    except ApiError as e:
        await resp.write(sse_event(e.to_dict()))
        return resp
    last = final_usage()
    if last is not None:
        await resp.write(sse_event(last))
    await resp.write(DONE)
    return resp
