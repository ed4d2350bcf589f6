"""`pdserve router` (python -m pd.router.server): a stateless HTTP front over the CEs.

    pdserve router --decode-url http://ce-a:8888,http://ce-b:8888 --host 0.0.0.0 --port 8080
    pdserve router --decode-url dns+http://pdserve-ce-headless:8888  # every address the name has

A request goes to its conversation's CE (pd/router/backends.py: rendezvous hashing of the key the CE
itself routes by, pd/router/key.py, bounded by load; with --routing kv-aware, the CE with the least work
for its prompt by the CEs' KV events, pd/disagg/kv_choice.py) and its answer streams back as it comes (SSE
chunks are written to the client as the CE writes them). A CE that refuses the connection, breaks it, or
answers 503 before anything was sent to the client is failed over: the request goes to the next CE of
the conversation's order with the same X-Request-Id. Once bytes reached the client, a broken CE cuts the
answer (the client sees the connection close). The router's own routes: /health, /health/live,
/health/ready, /metrics; everything else is passed to a CE (headers, body, status, X-Request-Id).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from pd.disagg.membership import hrw_order
from pd.errors import ApiError, unexpected
from pd.http.io import error_response, json_response, read_body
from pd.http.request_log import ACCESS_LOG_FORMAT, HEADER, REQUEST_ID, request_id_of
from pd.http.request_log import install as install_logging
from pd.lifecycle import RETRY_AFTER_S, exit_now
from pd.router.backends import Backend, BackendPool
from pd.router.config import RouterConfig
from pd.router.key import conversation_key, prompt_ids
from pd.router.metrics import RouterMetrics

log = logging.getLogger(__spec__.name)  # __name__ is "__main__" under python -m
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
KEYED_PATHS = ("/v1/chat/completions", "/v1/completions", "/invocations")
# not passed on in either direction (RFC 9110 7.6.1), and Host (the CE's own)
HOP_BY_HOP = frozenset(
    ("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host")
)  # fmt: skip
TOKENIZE_TIMEOUT_S = 2.0  # a CE slower than this to give a prompt's token ids: routed by the conversation
KEEPALIVE_S = 2.0  # a pooled connection to a CE is closed before the CE's --timeout-keep-alive (5 s)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def cluster_token() -> bytes | None:
    """The cluster token from the environment (a CE's KV events off loopback need its keys), or None."""
    from transfer.auth import load_token

    try:
        return load_token()
    except (ValueError, OSError) as e:
        log.info("no cluster token (%s): CEs' KV event streams off loopback will be left out", e)
        return None


class _Failover(Exception):
    """A CE could not take the request and nothing was sent to the client: try the next."""


class Router:
    """The state the handlers share: config, the CEs, the metrics, the client session."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.pool = BackendPool(
            cfg.decode_url, cfg.load_slack, cfg.load_floor, cfg.health_interval_s, cfg.dns_refresh_s,
            on_state=self._on_state, on_leave=self._on_leave, routing=cfg.routing, block_size=None,
            token=cluster_token() if cfg.routing == "kv-aware" else None, kv_load_weight=cfg.kv_load_weight,
        )  # fmt: skip
        self.metrics.kv_choice = self.pool.kv
        self.session: aiohttp.ClientSession | None = None
        self._known: set[str] = set()  # the CEs whose series exist

    def _on_state(self, b: Backend) -> None:
        if b.url not in self._known:
            self._known.add(b.url)
            self.metrics.add_backend(b.url)
        self.metrics.backend_up.labels(b.url).set(1.0 if b.is_up else 0.0)

    def _on_leave(self, b: Backend) -> None:
        self._known.discard(b.url)
        self.metrics.remove_backend(b.url)

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            auto_decompress=False,  # bytes pass through as the CE wrote them
        )
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        if self.session is not None:
            await self.session.close()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request, self.cfg.max_body_bytes, self.cfg.body_timeout_s)
        key, parsed = None, None
        if request.method == "POST" and request.path in KEYED_PATHS:
            try:
                parsed = orjson.loads(body)
                key = conversation_key(request.path, parsed)
            except orjson.JSONDecodeError:
                key = None  # the CE answers it with its 400
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers[HEADER] = REQUEST_ID.get()
        token_ids = None
        if self.pool.kv is not None and parsed is not None:
            token_ids = await self._token_ids(request.path, parsed, key, headers)
        order = self.pool.order(key, token_ids)
        if not order:
            raise ApiError(503, "no decode engine is known (--decode-url)", type="server_error",
                           code="no_decode_engine")  # fmt: skip
        last = ""
        for i, (b, reason) in enumerate(order):
            self.metrics.selected.labels(b.url, reason if i == 0 else "failover").inc()
            try:
                return await self._attempt(b, request, body, headers, i == len(order) - 1, token_ids)
            except _Failover as e:
                last = f"{b.url}: {e}"
                self.metrics.failovers.labels(b.url).inc()
                if i + 1 < len(order):
                    log.warning("failing over from %s to %s: %s", b.url, order[i + 1][0].url, e)
        self.metrics.requests.labels("none", "502").inc()
        raise ApiError(502, f"no decode engine could take the request; last: {last}", type="server_error",
                       code="decode_engines_failed")  # fmt: skip

    async def _token_ids(self, path: str, body: object, key: str | None, headers: dict[str, str]) -> list[int] | None:
        """The prompt's token ids for the kv-aware order: a completions body's own, else what a CE's
        /tokenize answers (the conversation's first CE up; the client's own Authorization goes with it);
        None when neither gives them (the order is then the conversation's)."""
        ask = prompt_ids(path, body)
        if ask is None or isinstance(ask, list):
            self.metrics.prompt_ids.labels("body" if ask else "none").inc()
            return ask
        up = {b.url: b for b in self.pool.backends.values() if b.is_up}
        if not up or self.session is None:
            self.metrics.prompt_ids.labels("none").inc()
            return None
        url = hrw_order(key or "", list(up))[0]
        auth = {k: v for k, v in headers.items() if k.lower() in ("authorization", HEADER.lower())}
        try:
            async with self.session.post(
                url + "/tokenize", data=orjson.dumps(ask), headers={**auth, "Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S),
            ) as r:
                reply = await r.read()
                tokens = orjson.loads(reply).get("tokens") if r.status == 200 else None
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, orjson.JSONDecodeError, AttributeError) as e:
            log.debug("token ids of a request from %s failed: %s", url, e)
            tokens = None
        if not (isinstance(tokens, list) and tokens and all(type(t) is int for t in tokens)):
            self.metrics.prompt_ids.labels("none").inc()
            return None
        self.metrics.prompt_ids.labels("tokenize").inc()
        return tokens

    async def _attempt(
        self, b: Backend, request: web.Request, body: bytes, headers: dict[str, str], is_last: bool,
        token_ids: list[int] | None = None,
    ) -> web.StreamResponse:
        """The CE's answer, streamed to the client; _Failover while nothing was sent. token_ids (kv-aware):
        the prompt, counted in b's load at its work there while it runs."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s)
        work = 0.0
        if self.pool.kv is not None and token_ids:
            work = self.pool.kv.send(b, token_ids)
        b.inflight_tokens += work
        b.num_inflight += 1
        self.metrics.inflight.labels(b.url).set(b.num_inflight)
        try:
            async with contextlib.AsyncExitStack() as stack:
                try:
                    upstream = await stack.enter_async_context(
                        self.session.request(
                            request.method, b.url + request.path_qs, data=body, headers=headers,
                            timeout=timeout, allow_redirects=False,
                        )
                    )  # fmt: skip
                    # the first bytes of the answer (b"" when it has none) before anything goes to the
                    # client, so that a CE that dies before its first token is failed over
                    first = await upstream.content.readany()
                except (aiohttp.ClientConnectorError, asyncio.TimeoutError) as e:
                    b.set_state(False, f"{type(e).__name__}: {e}")  # refused or unreachable: down now
                    raise _Failover(f"{type(e).__name__}: {e}") from None
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                    b.poke()  # a probe now, not a verdict: it may have been a stale pooled connection
                    raise _Failover(f"{type(e).__name__}: {e}") from None
                if upstream.status == 503 and not is_last:  # draining, or no engine: the next may serve
                    raise _Failover(f"answered 503: {first[:200]!r}")
                # NOTE: outside the handlers above: from here on bytes go to the client, and a client
                # that went away must never be taken for a CE that failed (nor be retried elsewhere)
                return await self._relay(b, request, upstream, first)
        finally:
            b.num_inflight -= 1
            b.inflight_tokens -= work
            if b.url in self._known:  # not a CE that left (dns+) meanwhile: its series are gone
                self.metrics.inflight.labels(b.url).set(b.num_inflight)

    async def _relay(
        self, b: Backend, request: web.Request, upstream: aiohttp.ClientResponse, first: bytes
    ) -> web.StreamResponse:
        out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in HOP_BY_HOP:
                out.headers.add(k, v)
        await out.prepare(request)
        self.metrics.requests.labels(b.url, str(upstream.status)).inc()
        if first:
            await out.write(first)
        chunks = upstream.content.iter_any()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                # bytes reached the client: the answer cannot move; the client sees its connection close
                self.metrics.stream_errors.labels(b.url).inc()
                log.warning("decode engine %s broke off an answer in flight: %s", b.url, e)
                b.poke()
                if request.transport is not None:
                    request.transport.close()
                return out
            await out.write(chunk)  # a client gone raises here, past the handler above
        await out.write_eof()
        return out


ROUTER = web.AppKey("router", Router)


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request: its id (X-Request-Id, taken or made, on its log lines, passed to the CE and
    returned); every error leaves as OpenAI's error object."""
    try:
        request["request_id"] = request_id = request_id_of(request.headers.get(HEADER))
        REQUEST_ID.set(request_id)
        return await handler(request)
    except ApiError as e:
        err = e
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = ApiError(
            e.status, e.text or e.reason, type="invalid_request_error" if e.status < 500 else "server_error"
        )
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        err = unexpected()
    if err.status == 503 and "Retry-After" not in err.headers:
        err.headers["Retry-After"] = str(RETRY_AFTER_S)
    return error_response(err)


async def _request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    if "request_id" in request:
        response.headers[HEADER] = request["request_id"]


async def health(request: web.Request) -> web.Response:
    """200 while a CE is up, with every CE's state."""
    pool = request.app[ROUTER].pool
    body: dict[str, object] = {"status": "ok" if pool.any_up else "down",
                               "decode_engines": [b.describe() for b in pool.backends.values()]}  # fmt: skip
    if pool.kv is not None:
        body["kv_index"] = pool.kv.describe()
    return json_response(body, 200 if pool.any_up else 503)


async def live(request: web.Request) -> web.Response:
    return json_response({"status": "live"})


async def ready(request: web.Request) -> web.Response:
    is_ready = request.app[ROUTER].pool.any_up
    return json_response({"status": "ready" if is_ready else "not_ready",
                          "reason": None if is_ready else "no decode engine is up"}, 200 if is_ready else 503)  # fmt: skip


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[ROUTER].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def forward(request: web.Request) -> web.StreamResponse:
    return await request.app[ROUTER].forward(request)


def make_app(router: Router) -> web.Application:
    app = web.Application(client_max_size=router.cfg.max_body_bytes, middlewares=[guard])
    app[ROUTER] = router
    app.on_response_prepare.append(_request_id_header)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", live)
    app.router.add_get("/health/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{path:.*}", forward)
    return app


async def serve(cfg: RouterConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    router = Router(cfg)
    await router.start()
    runner = web.AppRunner(
        make_app(router),
        handler_cancellation=True,  # a client gone cancels its CE request (the CE aborts it)
        access_log=logging.getLogger(f"{__spec__.name}.access") if cfg.access_log else None,
        access_log_format=ACCESS_LOG_FORMAT,
        shutdown_timeout=cfg.shutdown_timeout_s,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, cfg.host, cfg.port).start()
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", cfg.host, cfg.port, e)
        await runner.cleanup()
        await router.stop()
        return 1
    log.info("router listening on http://%s:%d over %s", cfg.host, cfg.port, cfg.decode_url)
    try:
        await stop.wait()
        log.info("stopping: requests in flight get up to %g s", cfg.shutdown_timeout_s)
    finally:
        await runner.cleanup()
        await router.stop()
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m pd.router.server") -> int:
    try:
        cfg = RouterConfig.from_argv(argv, prog)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    install_logging(cfg.log_level, cfg.log_format)
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    exit_now(main())
