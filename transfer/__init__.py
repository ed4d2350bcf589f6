"""The P/D handoff: a sequence's KV, SWA state and first token, moved from a PE rank to a CE rank.

    handoff.py    the header (msgpack) and payload layout; layout checks
    checksum.py   the payload checksum (torch/numpy, same value on CPU and GPU)
    checksum_gpu.py  the same in one pass on a GPU (Triton), used once it matches torch there
    auth.py       the cluster token and the HMAC challenge-response
    wire.py       control-connection framing and message flow
    messages.py   the control messages (hello .. ack, nack), one frozen dataclass each
    sender.py     KVSender.send(addr, export) -> Ack
    receiver.py   KVReceiver(on_handoff, on_complete): verify, then deliver
    transports.py the transports' one table: each name, its class and its Capabilities (no transport imported)
    transport.py  the transport interface and factory: tcp.py, nccl.py, ipc.py, nixl.py

Names are imported lazily, so `import transfer.auth` does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "HandoffError": "transfer.errors",
    "HandoffHeader": "transfer.header",
    "TransferConfig": "transfer.config",
    "KVSender": "transfer.sender",
    "Ack": "transfer.sender",
    "KVReceiver": "transfer.receiver",
    "load_token": "transfer.auth",
    "make_transport": "transfer.transport",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'transfer' has no attribute {name!r}")
