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
import contextlib
import dataclasses
import hmac
import ipaddress
import logging
import signal
import socket
import ssl
import sys
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from engine.errors import InvalidRequestError, ModelNotFoundError
from pd.api.chat import chat_completions
from pd.api.completions import completions
from pd.api.invocations import invocations
from pd.api.prefill import VERIFIER, prefill
from pd.api.protocol import parse_completion_request
from pd.api.tokenize import detokenize, tokenize, tokenizer_info_endpoint, version
from pd.config import ServerConfig, parse_prefill_urls
from pd.disagg.prefill_auth import Verifier
from pd.errors import ApiError, bad_request, unexpected
from pd.frontend.coordinator import Coordinator
from pd.frontend.metrics import CONTENT_TYPE
from pd.http.io import error_response, json_response
from pd.http.request_log import ACCESS_LOG_FORMAT, HEADER, REQUEST_ID, request_id_of
from pd.http.request_log import install as install_logging
from pd.http.site import LimitedSite, server_ssl_context
from pd.lifecycle import RETRY_AFTER_S, exit_now

log = logging.getLogger(__spec__.name)  # __name__ is "__main__" under python -m
COORDINATOR = web.AppKey("coordinator", Coordinator)
REQUEST_ID_KEY = "request_id"
# besides /v1/*: --api-key applies to them too (vLLM's applies to /v1/* only: these answer what /v1/* does)
KEYED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info", "/invocations")
LINGER_S = 1.0  # after an early answer (408, 413), the rest of a body is read and dropped this long
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _api_error_of(e: web.HTTPException) -> ApiError:
    if e.status == 404:
        return ApiError(
            404,
            "not found: see /v1/models, /v1/chat/completions, /v1/completions, /invocations, /tokenize, "
            "/detokenize, /tokenizer_info, /version, /health, /load, /metrics",
            code="not_found",
        )
    if e.status == 405:
        return ApiError(405, f"method not allowed: {e.reason}", code="method_not_allowed")
    if e.status == 413:
        return ApiError(413, "the request body is too large", code="request_too_large")
    return ApiError(
        e.status, e.text or e.reason, type="invalid_request_error" if e.status < 500 else "server_error"
    )


def _is_api(path: str) -> bool:
    """A path whose POSTs are admitted (counted in flight: /load; refused while draining)."""
    return path.startswith("/v1/") or path in ("/prefill", "/invocations")


def _check_api_key(request: web.Request, key: str) -> None:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    given_b = given.strip().encode("utf-8", "surrogateescape")  # a header's bytes may not be UTF-8
    if scheme.lower() != "bearer" or not hmac.compare_digest(given_b, key.encode()):
        raise ApiError(
            401,
            "Incorrect API key provided: send it as `Authorization: Bearer KEY`",
            code="invalid_api_key",
        )


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request: its id (X-Request-Id, on its log lines and its response), the API key on /v1/*,
    admission (503 while draining); every error leaves as OpenAI's error object, and nothing a client
    sends takes the server down."""
    co = request.app[COORDINATOR]
    admitted = False
    try:
        request[REQUEST_ID_KEY] = request_id = request_id_of(request.headers.get(HEADER))
        REQUEST_ID.set(request_id)
        if co.cfg.api_key is not None and (request.path.startswith("/v1/") or request.path in KEYED_PATHS):
            _check_api_key(request, co.cfg.api_key)
        if _is_api(request.path) and request.method == "POST":
            co.admission.admit()
            admitted = True
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
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        err = unexpected()
    finally:
        if admitted:
            co.admission.done()
    co.metrics.http_errors.labels(str(err.status)).inc()
    if err.status == 503 and "Retry-After" not in err.headers:
        err.headers["Retry-After"] = str(RETRY_AFTER_S)
    return error_response(err)


async def _request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    if REQUEST_ID_KEY in request:
        response.headers[HEADER] = request[REQUEST_ID_KEY]


def _handler(fn: Callable[[Coordinator, web.Request], Awaitable[web.StreamResponse]]) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await fn(request.app[COORDINATOR], request)

    return handle


def _permission(created: int) -> dict[str, object]:
    """vLLM's model_permission object (OpenAI's older model object had it): what this server allows."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


async def models(request: web.Request) -> web.Response:
    """OpenAI's model object, with vLLM's root (the --model given), parent, max_model_len, permission."""
    co = request.app[COORDINATOR]
    card: dict[str, object] = {
        "id": co.model_name,
        "object": "model",
        "created": co.created,
        "owned_by": "pdserve",
        "root": co.cfg.engine.model,
        "parent": None,
    }
    if any(r.info for r in co.ranks):
        card["max_model_len"] = co.max_model_len
    card["permission"] = [_permission(co.created)]
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


async def live(request: web.Request) -> web.Response:
    """The process serves HTTP (a liveness probe: restart it if this fails)."""
    return json_response({"status": "live"})


async def ready(request: web.Request) -> web.Response:
    """A request can be served now (a readiness probe: send traffic only while this is 200)."""
    is_ready, reason = request.app[COORDINATOR].readiness()
    return json_response(
        {"status": "ready" if is_ready else "not_ready", "reason": reason}, 200 if is_ready else 503
    )


async def load(request: web.Request) -> web.Response:
    """vLLM's server load (--enable-server-load-tracking, on here): the generation requests in flight,
    streams until their last chunk."""
    return json_response({"server_load": request.app[COORDINATOR].admission.num_inflight})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[COORDINATOR].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _base_app(co: Coordinator, max_body_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[guard])
    app[COORDINATOR] = co
    app.on_response_prepare.append(_request_id_header)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", live)
    app.router.add_get("/health/ready", ready)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    return app


def make_app(co: Coordinator) -> web.Application:
    app = _base_app(co, co.cfg.max_body_bytes)
    app.router.add_post("/v1/chat/completions", _handler(chat_completions))
    app.router.add_post("/v1/completions", _handler(completions))
    app.router.add_get("/v1/models/{model:.+}", models)  # served names may have a slash (org/name)
    app.router.add_post("/invocations", _handler(invocations))
    app.router.add_post("/tokenize", _handler(tokenize))
    app.router.add_post("/detokenize", _handler(detokenize))
    app.router.add_get("/tokenizer_info", _handler(tokenizer_info_endpoint))
    app.router.add_get("/version", version)
    return app


def make_prefill_app(co: Coordinator, token: bytes) -> web.Application:
    """The PE's app: /prefill (signed with the cluster token: pd/disagg/prefill_auth.py), /health*, /load,
    /metrics, /v1/models."""
    app = _base_app(co, co.cfg.prefill_max_body_bytes)  # what a decode engine may send (ServerConfig)
    app[VERIFIER] = Verifier(token, co.cfg.prefill_auth_window_s)
    app.router.add_post("/prefill", _handler(prefill))
    return app


async def serve(cfg: ServerConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    token = b""
    if cfg.is_pd:
        from transfer.auth import load_token

        try:
            token = load_token(token_file=cfg.cluster_token_file or None)
        except (ValueError, OSError) as e:
            log.error("--role %s needs the cluster token: %s", cfg.role, e)
            return 2
    try:  # NOTE: before anything loads: a port in use or a bad certificate ends the start at once
        tls = server_ssl_context(cfg.ssl_certfile, cfg.ssl_keyfile)
        await _check_bindable(cfg.host, cfg.http_port)
    except (OSError, ssl.SSLError) as e:
        log.error("cannot listen on %s:%d: %s", cfg.host, cfg.http_port, e)
        return 1
    if cfg.role == "ce":
        remote = await asyncio.to_thread(_remote_pe_behind_loopback_kv, cfg)
        if remote is not None:
            log.error(
                "--kv-host %s is a loopback address, but --prefill-url names %s on another host: that prefill "
                "engine could not reach this decode engine's KV receivers. Pass --kv-host 0.0.0.0 (or an address "
                "of this host it reaches; --kv-advertise-host for the one it should use)",
                cfg.kv_advertise_host or cfg.kv_host, remote,
            )  # fmt: skip
            return 2
    co = Coordinator(cfg)
    starting = asyncio.create_task(co.start())  # the ranks load while this process loads the tokenizer
    try:
        await co.load_tokenizer()
    except (ModelNotFoundError, OSError, ValueError) as e:
        log.error("cannot load the tokenizer, chat template or generation config of %s: %s", cfg.engine.model, e)
        await _abandon(co, starting)
        return 1
    try:  # the checkpoint's sampling defaults pass the API's checks, or the server does not start
        parse_completion_request({"prompt": "", **co.sampling_defaults})
    except ApiError as e:
        log.error("the checkpoint's generation_config.json: %s (--generation-config vllm ignores it)", e.message)
        await _abandon(co, starting)
        return 1
    app = make_prefill_app(co, token) if cfg.role == "pe" else make_app(co)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=logging.getLogger(f"{__spec__.name}.access") if cfg.access_log else None,
        access_log_format=ACCESS_LOG_FORMAT,
        keepalive_timeout=cfg.timeout_keep_alive_s,
        lingering_time=LINGER_S,
    )
    await runner.setup()
    try:
        await LimitedSite(runner, cfg.host, cfg.http_port, cfg.http_max_connections, ssl_context=tls).start()
    except (OSError, ssl.SSLError) as e:
        log.error("cannot listen on %s:%d: %s", cfg.host, cfg.http_port, e)
        await runner.cleanup()
        await _abandon(co, starting)
        return 1
    url = f"{'https' if tls else 'http'}://{cfg.host}:{cfg.http_port}"
    log.info("listening on %s (role %s); starting %d engine rank(s) of %s", url, cfg.role, cfg.dp, cfg.engine.model)
    code = 0
    try:
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            if starting.exception() is not None:
                log.error("engine ranks failed to start: %s", starting.exception())
                code = 1
            else:
                log.info("ready: %s/v1 serves %s on %d rank(s)", url, co.model_name, cfg.dp)
                await stopping
                await _drain(co, cfg.shutdown_timeout_s, stop)
        else:
            starting.cancel()
        stopping.cancel()
    finally:
        log.info("stopping")
        await co.stop()
        await runner.cleanup()
    return code


def _is_local(host: str) -> bool | None:
    """Whether host is this machine (a loopback address, or one a socket here can bind); None: unknown
    (the name does not resolve now)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, _, _, _, address in infos:
        if ipaddress.ip_address(str(address[0]).partition("%")[0]).is_loopback:  # (an IPv6 scope id aside)
            return True
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
                return True
            except OSError:
                pass
    return False


def _remote_pe_behind_loopback_kv(cfg: ServerConfig) -> str | None:
    """A CE's --prefill-url entry on another host while the KV address it gives its PEs is loopback (the
    PE would send to its own loopback), or None. dns+ entries are left to their lookups."""
    kv_host = cfg.kv_advertise_host or cfg.kv_host
    if kv_host != "localhost":
        try:
            if not ipaddress.ip_address(kv_host.strip("[]")).is_loopback:
                return None
        except ValueError:  # a name: what it stands for is the name's business
            return None
    for target in parse_prefill_urls(cfg.prefill_url):
        if not target.dns and _is_local(target.host) is False:
            return target.url
    return None


async def _check_bindable(host: str, port: int) -> None:
    """Raises OSError when the server could not listen on host:port (in use, no such address): bound
    as aiohttp binds it, and closed again."""
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, host, port, reuse_address=True)
    server.close()
    await server.wait_closed()


async def _abandon(co: Coordinator, starting: asyncio.Task[None]) -> None:
    """Stops the ranks that were starting (the server gives up before it served)."""
    starting.cancel()
    with contextlib.suppress(BaseException):
        await starting
    await co.stop()


async def _drain(co: Coordinator, timeout_s: float, stop: asyncio.Event) -> None:
    """Takes no new requests and gives those in flight up to timeout_s; a second signal cuts it short."""
    co.admission.drain()
    stop.clear()
    n = co.admission.num_inflight
    log.info(
        "draining: %d request(s) in flight, waiting up to %g s (a second signal stops at once)", n, timeout_s
    )
    if await co.admission.wait_idle(timeout_s, interrupt=stop):
        log.info("drained: no request in flight")
    else:
        log.warning("stopping with %d request(s) still in flight", co.admission.num_inflight)


def pin_hub_model(cfg: ServerConfig) -> ServerConfig:
    """cfg with a hub id (--model ORG/NAME[@REVISION]) replaced by its snapshot folder, downloaded here
    first if missing: the ranks (restarts included) and the tokenizer then read that one snapshot and call
    the hub no more. Clients keep the name: --served-model-name, else ORG/NAME. A local folder or a
    catalogue name is left to the ranks, as before. Raises ModelNotFoundError (one line: what to do)."""
    from engine.checkpoints import download, hub_model_of

    engine = cfg.engine
    hub = hub_model_of(engine.model, engine.revision, engine.download_dir)
    if hub is None:
        return cfg
    for name in ("httpx", "httpx2"):  # huggingface_hub's HTTP clients log every request at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    log.info("model %s: the snapshot in huggingface_hub's cache (downloading what is missing)", hub)
    folder = download(hub, engine.download_dir)
    log.info("model %s: %s", hub, folder)
    pinned = dataclasses.replace(engine, model=str(folder), revision=None, download_dir=None)
    return dataclasses.replace(cfg, engine=pinned, served_model_name=cfg.served_model_name or hub.repo_id)


def main(
    argv: list[str] | None = None, prog: str = "python -m pd.server", is_model_positional: bool = False
) -> int:
    """Serves until stopped; the exit status. `pdserve serve MODEL` is this with is_model_positional."""
    try:
        cfg = ServerConfig.from_argv(argv, prog, is_model_positional)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    install_logging(cfg.log_level, cfg.log_format)
    try:
        cfg = pin_hub_model(cfg)
    except ModelNotFoundError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    exit_now(main())
