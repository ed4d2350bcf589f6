"""POST /invocations (SageMaker's entry point, as vLLM serves it): a chat completion or a completion,
told apart by the body as vLLM's validators do: `messages` makes it a chat completion (tried first),
`prompt` a completion; anything else is a 400. The answer is the endpoint's own, streamed or whole."""

from __future__ import annotations

import time

from aiohttp import web

from pd.api.chat import answer_chat
from pd.api.completions import answer_completion
from pd.api.protocol import parse_object
from pd.errors import bad_request
from pd.frontend.coordinator import Coordinator


async def invocations(co: Coordinator, request: web.Request) -> web.StreamResponse:
    arrival_s = time.monotonic()
    body = parse_object(await co.read_json(request))
    if "messages" in body:
        return await answer_chat(co, request, body, arrival_s)
    if "prompt" in body:
        return await answer_completion(co, request, body, arrival_s)
    raise bad_request(
        "/invocations serves a chat completion (a body with 'messages') or a completion (a body with 'prompt')",
        "messages",
    )
