"""The CE's /prefill client (pd/disagg/prefill_client.py) against a stand-in PE: a 200 the CE cannot read is
a failed prefill, never a crash; a good answer decodes; a body over the PE's limit is a 413 and is not sent."""

from __future__ import annotations

from typing import Any

import pytest

from engine.codec import to_wire
from engine.request import RequestOutput, SamplingParams, TokenLogprob
from pd.disagg.prefill_client import PrefillFailed
from pd.messages import PrefillBody, PrefillReply
from tests.pd.conftest import CLUSTER_TOKEN

GOOD_REPLY = to_wire(
    PrefillReply(False, 3, 1, 0.1, 0.0, 0, "tcp", RequestOutput("r", [5], "x", [TokenLogprob(5, -0.1)], True, "length"))
)


@pytest.mark.parametrize(
    "answer",
    [
        {"handed_off": True},  # missing fields
        {**GOOD_REPLY, "num_prompt_tokens": "3"},  # a wrong type
        {**GOOD_REPLY, "handed_off": 1},
        {**GOOD_REPLY, "output": {"request_id": "r", "new_token_ids": "5"}},
        {**GOOD_REPLY, "surprise": 1},  # an unknown field
        [1, 2],
    ],
)
def test_malformed_prefill_answer_is_a_failed_prefill(answer: Any) -> None:
    assert _post_prefill(answer) == ("bad_response", 200)


def test_prefill_answer_decodes() -> None:
    got = _post_prefill(GOOD_REPLY)
    assert isinstance(got, PrefillReply) and to_wire(got) == GOOD_REPLY
    assert got.output is not None and got.output.logprobs == [TokenLogprob(5, -0.1)]


def _post_prefill(answer: Any) -> Any:
    """What PrefillClient.prefill makes of a PE whose /prefill answers 200 with `answer`: the reply,
    or (code, status) of the PrefillFailed it raised."""
    import asyncio

    import orjson
    from aiohttp import web

    from pd.disagg.prefill_client import PrefillClient

    bodies: list[Any] = []

    async def prefill(request: web.Request) -> web.Response:
        bodies.append(orjson.loads(await request.read()))
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def main() -> Any:
        app = web.Application()
        app.router.add_post("/prefill", prefill)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = PrefillClient(f"http://127.0.0.1:{port}", CLUSTER_TOKEN.encode(), 10.0)
        await client.start()
        try:
            return await client.prefill(PrefillBody("r", (1, 2, 3), SamplingParams(max_tokens=2), "h:1"))
        except PrefillFailed as e:
            return e.code, e.status
        finally:
            await client.stop()
            await runner.cleanup()

    got = asyncio.run(main())
    assert bodies == [to_wire(PrefillBody("r", (1, 2, 3), SamplingParams(max_tokens=2), "h:1"))]
    return got


async def test_a_prefill_body_over_the_limit_is_a_413_and_is_not_sent():
    from pd.disagg.decode_path import _prefill_error
    from pd.disagg.prefill_client import PrefillClient

    client = PrefillClient("http://127.0.0.1:9", CLUSTER_TOKEN.encode(), 10.0)  # nothing listens there
    await client.start()
    try:
        with pytest.raises(PrefillFailed) as e:
            await client.prefill(PrefillBody("r", tuple(range(1, 2000)), SamplingParams(max_tokens=2), "h:1"), 1024)
    finally:
        await client.stop()
    assert e.value.status == 413 and e.value.code == "request_too_large"
    error = _prefill_error(e.value)
    assert (error.status, error.code) == (413, "request_too_large")
