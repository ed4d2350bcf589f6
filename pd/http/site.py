"""The listening side of every HTTP port: TLS, a cap on connections, timeouts, and errors from the HTTP
parser written as OpenAI error objects.

    limits                          flag                          answer
    connections held at once        --http-max-connections        503, connection closed
    idle or unfinished headers      --timeout-keep-alive          connection closed
    a body not read in time         --body-timeout                408 (pd/http/io.py)
    a body too large                --max-body-bytes              413
    a header line or field too long (8 KiB), more than 128 headers    431
    a request line that is not HTTP                               400

aiohttp closes a connection that has not sent a complete request within the keep-alive timeout,
counted from its accept or its last response, so an idle connection and one trickling its headers
both end there.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from pd.errors import ApiError

log = logging.getLogger(__name__)
LOG_EVERY_S = 10.0  # refusals are logged at most this often


def _error_body(e: ApiError) -> bytes:
    return orjson.dumps(e.to_dict())


def _parser_error(status: int, exc: BaseException | None) -> ApiError:
    text = str(exc or "").lower()
    if isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage) and "too many headers" in text):
        return ApiError(
            431,
            "the request's headers are too large (at most 8190 bytes a line, 128 headers)",
            code="request_header_fields_too_large",
        )
    if status >= 500:
        return ApiError(status, "internal error", type="server_error", code="internal_error")
    return ApiError(status, "the request is not valid HTTP/1.1", code="bad_http_request")


class JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, whose own errors (a request the parser refused) are JSON."""

    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("the response was started: no error response can follow")
        err = _parser_error(status, exc)
        log.debug("refused a request from %s: %d %s", request.remote, err.status, type(exc).__name__)
        resp = web.Response(status=err.status, body=_error_body(err), content_type="application/json")
        resp.force_close()
        return resp


class _Refuse(asyncio.Protocol):
    """A connection over the cap: one 503 and closed, before anything is read."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(self.body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        transport.write(head.encode() + self.body)
        transport.close()


class LimitedSite(web.TCPSite):
    """A TCPSite that holds at most max_connections connections and makes JsonErrorHandlers."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int, **kw: Any) -> None:
        super().__init__(runner, host, port, **kw)
        self.max_connections = max_connections
        self.num_refused = 0
        self._logged_s = 0.0

    def _make_handler(self) -> asyncio.Protocol:
        server = self._runner.server
        assert server is not None
        if len(server.connections) >= self.max_connections:
            self.num_refused += 1
            loop = asyncio.get_running_loop()
            if loop.time() - self._logged_s >= LOG_EVERY_S:
                self._logged_s = loop.time()
                log.warning(
                    "refusing HTTP connections: %d open (--http-max-connections); %d refused so far",
                    len(server.connections),
                    self.num_refused,
                )
            err = ApiError(
                503, "too many connections; retry later", type="server_error", code="too_many_connections"
            )
            return _Refuse(_error_body(err))
        return JsonErrorHandler(server, loop=asyncio.get_running_loop(), **getattr(server, "_kwargs", {}))

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._make_handler, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


def server_ssl_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """TLS for a listening port when a certificate is given (--ssl-certfile, --ssl-keyfile)."""
    if not certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile or None)
    return ctx


def client_ssl_context(cafile: str | None) -> ssl.SSLContext | bool:
    """How a client verifies an https peer: with the CA file when given (--ssl-ca-certs), else the
    system's trust store."""
    return ssl.create_default_context(cafile=cafile) if cafile else True
