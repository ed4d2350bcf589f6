"""The OpenAI-compatible server over colocated engine ranks (single-engine mode), or one side of a
P/D pair: `--role ce` (decode engines behind the same OpenAI API, prefills asked of the PE) or
`--role pe` (prefill engines behind POST /prefill on port 8889).

    python -m pd.server --model smollm2-135m-instruct --dp 2 --port 8888
    python -m pd.server --role pe                                   # PE: 127.0.0.1:8889
    python -m pd.server --role ce --prefill-url http://127.0.0.1:8889  # CE: 8888, KV on 8900+rank

It listens at once (/health says "starting" with 503 until every rank is ready), then serves until
SIGTERM/SIGINT, when it stops its ranks. A rank that fails to start makes the server exit with 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web

from engine.errors import InvalidRequestError, ModelNotFoundError
from pd.chat_api import chat_completions
from pd.completions_api import completions
from pd.config import ServerConfig
from pd.coordinator import Coordinator, load_tokenizer
from pd.errors import ApiError, bad_request, internal
from pd.http_io import error_response, json_response
from pd.metrics import CONTENT_TYPE
from pd.prefill_server import TOKEN, prefill

log = logging.getLogger("pd.server")
COORDINATOR = web.AppKey("coordinator", Coordinator)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _api_error_of(e: web.HTTPException) -> ApiError:
    if e.status == 404:
        return ApiError(
            404,
            "not found: see /v1/models, /v1/chat/completions, /v1/completions, /health, /metrics",
            code="not_found",
        )
    if e.status == 405:
        return ApiError(405, f"method not allowed: {e.reason}", code="method_not_allowed")
    if e.status == 413:
        return ApiError(413, "the request body is too large", code="request_too_large")
    return ApiError(
        e.status, e.text or e.reason, type="invalid_request_error" if e.status < 500 else "server_error"
    )


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as OpenAI's error object; nothing a client sends takes the server down."""
    co = request.app[COORDINATOR]
    try:
        return await handler(request)
    except ApiError as e:
        err = e
    except InvalidRequestError as e:  # the engine's own checks (SamplingParams), run in this process
        err = bad_request(str(e), e.param)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = _api_error_of(e)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("unexpected error in %s %s", request.method, request.path)
        err = internal(f"internal error: {type(e).__name__}: {e}")
    co.metrics.http_errors.labels(str(err.status)).inc()
    return error_response(err)


def _handler(fn: Callable[[Coordinator, web.Request], Awaitable[web.StreamResponse]]) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await fn(request.app[COORDINATOR], request)

    return handle


async def models(request: web.Request) -> web.Response:
    co = request.app[COORDINATOR]
    card = {"id": co.model_name, "object": "model", "created": co.created, "owned_by": "pdserve"}
    if any(r.info for r in co.ranks):
        card["max_model_len"] = co.max_model_len
    if request.match_info.get("model") is not None:
        if request.match_info["model"] != co.model_name:
            raise ApiError(
                404,
                f"The model '{request.match_info['model']}' does not exist",
                param="model",
                code="model_not_found",
            )
        return json_response(card)
    return json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    status, body = request.app[COORDINATOR].health()
    return json_response(body, status)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[COORDINATOR].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def make_app(co: Coordinator) -> web.Application:
    app = web.Application(client_max_size=co.cfg.max_body_bytes, middlewares=[openai_errors])
    app[COORDINATOR] = co
    app.router.add_post("/v1/chat/completions", _handler(chat_completions))
    app.router.add_post("/v1/completions", _handler(completions))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def make_prefill_app(co: Coordinator, token: bytes) -> web.Application:
    """The PE's app: /prefill (cluster token required), /health, /metrics, /v1/models."""
    app = web.Application(client_max_size=co.cfg.max_body_bytes, middlewares=[openai_errors])
    app[COORDINATOR] = co
    app[TOKEN] = token
    app.router.add_post("/prefill", _handler(prefill))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(cfg: ServerConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        co = Coordinator(cfg, await asyncio.to_thread(load_tokenizer, cfg.engine.model))
    except (ModelNotFoundError, OSError, ValueError) as e:
        log.error("cannot load the tokenizer or chat template of %s: %s", cfg.engine.model, e)
        return 1
    token = b""
    if cfg.is_pd:
        from transfer.auth import load_token

        try:
            token = load_token(token_file=cfg.cluster_token_file or None)
        except (ValueError, OSError) as e:
            log.error("--role %s needs the cluster token: %s", cfg.role, e)
            return 2
    app = make_prefill_app(co, token) if cfg.role == "pe" else make_app(co)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, cfg.host, cfg.http_port).start()
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", cfg.host, cfg.http_port, e)
        await runner.cleanup()
        return 1
    url = f"http://{cfg.host}:{cfg.http_port}"
    log.info("listening on %s (role %s); starting %d engine rank(s) of %s", url, cfg.role, cfg.dp, cfg.engine.model)
    code = 0
    try:
        starting = asyncio.create_task(co.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            if starting.exception() is not None:
                log.error("engine ranks failed to start: %s", starting.exception())
                code = 1
            else:
                log.info("ready: %s/v1 serves %s on %d rank(s)", url, co.model_name, cfg.dp)
                await stopping
        else:
            starting.cancel()
        stopping.cancel()
    finally:
        log.info("stopping")
        await co.stop()
        await runner.cleanup()
    return code


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = ServerConfig.from_argv(argv)
    except ValueError as e:
        print(f"pd.server: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
