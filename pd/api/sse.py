"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n`, closed by `data: [DONE]\\n\\n`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from pd.errors import ApiError, unexpected

if TYPE_CHECKING:
    from pd.api.protocol import SamplingFields
    from pd.frontend.generation import ChoiceSource, ChoiceUpdate

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def stream_choices(
    request: web.Request,
    gen: ChoiceSource,
    head: dict[str, Any],
    choice: Callable[[ChoiceUpdate], dict[str, Any] | None],
    usage: Callable[[], dict[str, Any]],
    chunk_usage: Callable[[ChoiceUpdate], dict[str, Any]],
    sampling: SamplingFields,
) -> web.StreamResponse:
    """A generation as an SSE response: one chunk ({**head, "choices": [...]}) per update that `choice`
    turns into a choice, then, when the request asked for usage (sampling.include_usage), a last chunk
    with no choices and `usage()`, then [DONE]. With usage asked for, every other chunk has "usage": null,
    or with vLLM's continuous_usage_stats (sampling.is_usage_continuous) chunk_usage(update), the usage of
    its choice so far. Of `sampling`, only those two stream options are read.

    The response starts only once the first update is there, so a rejection before any token is still
    a plain HTTP error; an error after that goes in-band, with no [DONE].
    """

    def chunk(u: ChoiceUpdate) -> dict[str, Any] | None:
        c = choice(u)
        if c is None:
            return None
        if not sampling.include_usage:
            return {**head, "choices": [c]}
        return {**head, "choices": [c], "usage": chunk_usage(u) if sampling.is_usage_continuous else None}

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
    except ConnectionResetError:  # the client went away mid-stream: nothing to answer (the caller aborts)
        raise
    except Exception:  # the response has begun: the error goes in-band, as the middleware would answer it
        log.exception("unexpected error in the stream of %s %s", request.method, request.path)
        await resp.write(sse_event(unexpected().to_dict()))
        return resp
    if sampling.include_usage:
        await resp.write(sse_event({**head, "choices": [], "usage": usage()}))
    await resp.write(DONE)
    return resp
