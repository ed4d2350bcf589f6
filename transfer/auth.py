"""The cluster's shared secret and the challenge-response that proves a peer holds it.

The token comes from PDSERVE_CLUSTER_TOKEN, or from the file named by PDSERVE_CLUSTER_TOKEN_FILE (or
passed explicitly). It never crosses the wire: each side answers the other's fresh random nonce with
an HMAC-SHA256 keyed by the token, compared in constant time. The receiver speaks first, so a peer
learns nothing before it has proven itself; the sender checks the receiver's answer too, so KV is
never pushed to a listener that does not hold the token. It authenticates; it does not encrypt.

    python -m transfer.auth      # prints a fresh token (for PDSERVE_CLUSTER_TOKEN / a token file)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from transfer.errors import AUTH, HandoffError

if TYPE_CHECKING:
    from transfer.messages import AuthOk
    from transfer.wire import Channel

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "PDSERVE_CLUSTER_TOKEN_FILE"
MIN_TOKEN_CHARS = 16
NONCE_BYTES = 32
_CLIENT = b"pdserve-kv-auth/client\x00"
_SERVER = b"pdserve-kv-auth/server\x00"
log = logging.getLogger(__name__)


def generate_token() -> str:
    return secrets.token_urlsafe(32)


def load_token(token: str | None = None, token_file: str | os.PathLike[str] | None = None) -> bytes:
    """The cluster token: the argument, else the token file, else $PDSERVE_CLUSTER_TOKEN, else the file
    named by $PDSERVE_CLUSTER_TOKEN_FILE. Raises ValueError if there is none, it is too short, or its
    file grants group or others any access (checked on every load: a secret others can read is none)."""
    if token is None and token_file is None:
        token = os.environ.get(TOKEN_ENV) or None
        token_file = os.environ.get(TOKEN_FILE_ENV) or None
    if token is None and token_file is not None:
        path = Path(token_file)
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(
                f"cluster token file {path} is readable by others (mode {mode:o}): chmod 600 {path}"
            )
        token = path.read_text().strip()
    if not token:
        raise ValueError(
            f"no cluster token: set {TOKEN_ENV} or {TOKEN_FILE_ENV} (python -m transfer.auth makes one)"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the cluster token must be at least {MIN_TOKEN_CHARS} characters")
    return token.encode()


def _mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"".join(parts), hashlib.sha256).digest()


# NOTE: the handshakes import the wire (and through the codec, torch) when they run, so that making a
# token (`python -m transfer.auth`, deploy/pd_run.sh) stays a fraction of a second.
async def server_handshake(ch: Channel, token: bytes) -> tuple[str, bytes]:
    """Receiver side: (the sender's id, this receiver's proof for auth_ok). Raises HandoffError if the
    peer fails (VERSION for another protocol version). The caller sends AuthOk with the proof, its
    model and layout, or a nack."""
    from transfer.messages import Auth, Hello
    from transfer.wire import MAX_CONTROL_BYTES, PROTOCOL_VERSION

    nonce = secrets.token_bytes(NONCE_BYTES)
    await ch.send(Hello(PROTOCOL_VERSION, nonce))
    msg = await ch.expect(Auth)
    if len(msg.nonce) != NONCE_BYTES:
        raise HandoffError(AUTH, "malformed authentication")
    if not hmac.compare_digest(msg.mac, _mac(token, _CLIENT, nonce, msg.nonce, msg.sender.encode())):
        raise HandoffError(AUTH, "authentication failed")
    ch.max_frame_bytes = MAX_CONTROL_BYTES
    return msg.sender, _mac(token, _SERVER, msg.nonce, nonce)


async def client_handshake(ch: Channel, token: bytes, sender_id: str) -> AuthOk:
    """Sender side. Returns the receiver's AuthOk (its model and layout); raises HandoffError."""
    from transfer.messages import Auth, AuthOk, Hello
    from transfer.wire import MAX_CONTROL_BYTES, PROTOCOL_VERSION

    hello = await ch.expect(Hello)  # another protocol version: VERSION
    if len(hello.nonce) != NONCE_BYTES:
        raise HandoffError(AUTH, "malformed hello")
    nonce = secrets.token_bytes(NONCE_BYTES)
    mac = _mac(token, _CLIENT, hello.nonce, nonce, sender_id.encode())
    await ch.send(Auth(PROTOCOL_VERSION, sender_id, nonce, mac))
    ok = await ch.expect(AuthOk)
    if not hmac.compare_digest(ok.mac, _mac(token, _SERVER, nonce, hello.nonce)):
        raise HandoffError(AUTH, f"receiver {ch.peer} failed to prove it holds the cluster token")
    ch.max_frame_bytes = MAX_CONTROL_BYTES
    return ok


if __name__ == "__main__":
    print(generate_token())
