"""How the CE proves to the PE that a /prefill comes from the cluster, without sending the secret.

The CE signs each request with an HMAC-SHA256 keyed by the cluster token over the method, the path, a
timestamp, a fresh nonce and the body's SHA-256:

    Authorization: PDSERVE-HMAC-SHA256 ts=<unix seconds>,nonce=<32 hex>,sig=<64 hex>

The PE recomputes it over the body it read and accepts the request only if the signature matches
(compared in constant time), the timestamp is within `window_s` of its clock, and the nonce was not
seen within the window (so a captured request cannot be replayed, even unchanged). A captured request
reveals neither the token nor a way to sign another body. Like the KV receivers' handshake
(transfer/auth.py) it authenticates; TLS (--ssl-certfile) is what encrypts.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict

SCHEME = "PDSERVE-HMAC-SHA256"
_HEADER = re.compile(r"PDSERVE-HMAC-SHA256 ts=(\d{1,12}),nonce=([0-9a-f]{32}),sig=([0-9a-f]{64})")
MAX_NONCES = 1_000_000  # remembered at most (a flood of valid signatures needs the token anyway)


class AuthFailed(Exception):
    """The request is not signed by a holder of the cluster token (the text says why, for the log)."""


def _signature(token: bytes, method: str, path: str, ts: str, nonce: str, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest()
    msg = "\n".join((SCHEME, method.upper(), path, ts, nonce, digest)).encode()
    return hmac.new(token, msg, hashlib.sha256).hexdigest()


def sign(token: bytes, method: str, path: str, body: bytes, now: float | None = None) -> str:
    """The Authorization header's value for one request."""
    ts = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(16)
    return f"{SCHEME} ts={ts},nonce={nonce},sig={_signature(token, method, path, ts, nonce, body)}"


class Verifier:
    """The PE's side: checks signatures and remembers the nonces it accepted for `window_s`."""

    def __init__(self, token: bytes, window_s: float) -> None:
        self.token = token
        self.window_s = window_s
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten

    def verify(
        self, method: str, path: str, header: str | None, body: bytes, now: float | None = None
    ) -> None:
        now = time.time() if now is None else now
        m = _HEADER.fullmatch(header or "")
        if m is None:
            raise AuthFailed(f"no {SCHEME} signature")
        ts, nonce, sig = m.groups()
        if not hmac.compare_digest(sig, _signature(self.token, method, path, ts, nonce, body)):
            raise AuthFailed("the signature does not match")
        if abs(now - int(ts)) > self.window_s:
            raise AuthFailed(f"the signature's timestamp is {now - int(ts):+.0f} s off this clock")
        self._forget(now)
        if nonce in self._seen:
            raise AuthFailed("replayed (the nonce was used already)")
        if len(self._seen) >= MAX_NONCES:
            self._seen.popitem(last=False)
        self._seen[nonce] = now + 2 * self.window_s

    def _forget(self, now: float) -> None:
        while self._seen:
            nonce, until = next(iter(self._seen.items()))
            if until > now:
                return
            del self._seen[nonce]
