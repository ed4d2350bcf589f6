"""The one error type of the handoff: every refusal and failure, with a short machine-readable code;
and printable(), which every log line and error message applies to text a peer sent."""

from __future__ import annotations

# Codes (the `code` of a HandoffError, and of a NACK on the wire).
AUTH = "auth"  # the peer did not prove it holds the cluster token
VERSION = "version"  # protocol or header version differs
LAYOUT = "layout"  # model or KV layout differs between the two sides
BAD_HEADER = "bad_header"  # a header that does not decode or is inconsistent
UNEXPECTED = "unexpected"  # the receiver has no reservation for this request
TRANSPORT = "transport"  # the transport is not enabled here, or failed
CHECKSUM = "checksum"  # the payload arrived but does not match its checksum
INCOMPLETE = "incomplete"  # the connection closed before the payload was complete
TIMEOUT = "timeout"
REJECTED = "rejected"  # the receiver's on_complete refused the verified sequence: the request's fault
ENGINE_ERROR = "engine_error"  # an engine failed to export or import the sequence (its log says why)
PROTOCOL = "protocol"  # an unexpected or malformed control message
STALE = "stale"  # the receiver does not know the sender's NCCL communicator (it restarted): bootstrap again
# the codes this side knows: a nack with another code is read as PROTOCOL (wire.py)
CODES = frozenset(
    {
        AUTH,
        VERSION,
        LAYOUT,
        BAD_HEADER,
        UNEXPECTED,
        TRANSPORT,
        CHECKSUM,
        INCOMPLETE,
        TIMEOUT,
        REJECTED,
        ENGINE_ERROR,
        PROTOCOL,
        STALE,
    }
)

FIELD_CHARS = 200  # one value a peer sent (a request or sender id, a model name)
MESSAGE_CHARS = 1000  # a whole error message, which may quote several such values


class HandoffError(Exception):
    """A handoff that did not happen. Nothing was delivered to the receiving engine."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def printable(text: object, limit: int = FIELD_CHARS) -> str:
    """str(text) made safe for one log line or an error message: every character that is not printable
    (newlines, escapes, other controls, separators such as U+2028) written as repr writes it (\\n, \\x1b,
    \\u2028), without quotes, and cut after `limit` characters with "...". Backslashes stay as they are,
    so text that is already escaped (a repr, an earlier printable()) comes through unchanged: a peer can
    neither start a line of its own nor fill the log."""
    s = text if isinstance(text, str) else str(text)
    out: list[str] = []
    size = 0
    for ch in s[: limit + 1]:  # every character gives at least one: no need to look further
        piece = ch if ch.isprintable() else repr(ch)[1:-1]
        if size + len(piece) > limit:
            return "".join(out) + "..."
        out.append(piece)
        size += len(piece)
    return "".join(out)
