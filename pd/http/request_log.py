"""Request ids in logs: `X-Request-Id` taken from the client (or made), returned in the response, and
put on every log line written while the request is served (a context variable that tasks inherit).

The engine request ids derive from it (`chatcmpl-<id>-<choice>`, `cmpl-<id>-<choice>`), and the CE
passes them to the PE in /prefill, so one id finds a request's lines on the CE, the PE and their ranks.
The opt-in access log (--access-log) writes one line per request with its id.
"""

from __future__ import annotations

import contextvars
import datetime
import logging
import re
import sys
import uuid
from types import TracebackType

import orjson

from pd.config import LOG_FORMATS
from pd.errors import bad_request

log = logging.getLogger(__name__)
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


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log pipelines: time (UTC, ISO 8601), level, logger, message, the
    request's id where one is being served (else absent), `rank` in a rank's lines, `exception` with
    the traceback when the record carries one."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "-")
        if request_id != "-":
            out["request_id"] = request_id
        if self.rank is not None:
            out["rank"] = self.rank
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def install(level: str, log_format: str = "text", rank: int | None = None) -> None:
    """The process's logging on stderr: LOG_FORMAT (text) or one JSON object per line (json), the request
    id filled in on every handler. rank: an engine rank's process (its lines say which)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} not among {list(LOG_FORMATS)}")
    text_format = LOG_FORMAT if rank is None else f"%(asctime)s rank{rank} %(levelname)s %(message)s"
    logging.basicConfig(level=level.upper(), format=text_format)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
        if log_format == "json":
            handler.setFormatter(JsonFormatter(rank))
    if log_format == "json":
        # what would reach stderr past logging goes through it, so every line stays one JSON object:
        # Python's warnings, and an exception nothing caught
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught


def _log_uncaught(kind: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
    log.critical("uncaught exception", exc_info=(kind, e, tb))


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
