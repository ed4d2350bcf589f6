"""Request ids in logs: `X-Request-Id` taken from the client (or made), returned in the response, and
put on every log line written while the request is served (a context variable that tasks inherit).

The engine request ids derive from it (`chatcmpl-<id>-<choice>`, `cmpl-<id>-<choice>`), and the CE
passes them to the PE in /prefill, so one id finds a request's lines on the CE, the PE and their ranks.
The opt-in access log (--access-log) writes one line per request with its id.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

from pd.errors import bad_request

HEADER = "X-Request-Id"
MAX_CHARS = 128
_VALID = re.compile(rf"[A-Za-z0-9._:@+=-]{{1,{MAX_CHARS}}}")
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s [%(request_id)s] %(message)s"
# aiohttp's access logger: remote address, request line, status, bytes, seconds, the request's id
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tf %{X-Request-Id}o'


class RequestIdFilter(logging.Filter):
    """Gives every record a `request_id` (the current request's, else "-")."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


def install(level: str) -> None:
    """The process's logging: LOG_FORMAT on stderr, the request id filled in on every handler."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())


def request_id_of(header: str | None) -> str:
    """The client's X-Request-Id if it is well formed (letters, digits and ._:@+=-, at most 128 chars),
    else 400; a new one when the client sent none."""
    if header is None or header == "":
        return uuid.uuid4().hex
    if not _VALID.fullmatch(header):
        raise bad_request(
            f"{HEADER} must be 1 to {MAX_CHARS} characters of A-Z a-z 0-9 . _ : @ + = -",
            code="invalid_request_id",
        )
    return header
