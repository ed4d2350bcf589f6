"""The one error type of the handoff: every refusal and failure, with a short machine-readable code."""

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
REJECTED = "rejected"  # the receiver's on_complete refused the verified sequence (e.g. import failed)
PROTOCOL = "protocol"  # an unexpected or malformed control message
STALE = "stale"  # the receiver does not know the sender's NCCL communicator (it restarted): bootstrap again


class HandoffError(Exception):
    """A handoff that did not happen. Nothing was delivered to the receiving engine."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
