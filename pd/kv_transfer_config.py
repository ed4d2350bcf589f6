"""vLLM's `--kv-transfer-config` JSON, read as the pdserve flags it corresponds to.

    {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}   ->  --role pe --transport nixl
    {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
     "kv_ip": "10.0.0.2", "kv_port": 14579}                       ->  --role ce --kv-host 10.0.0.2 --kv-port-base 14579

What has no counterpart here is refused by name (another connector, a key of vLLM's that pdserve has
no setting for), never taken and ignored. A flag given beside it that says otherwise is an error too.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = {"kv_producer": "pe", "kv_consumer": "ce"}  # kv_both: the --role given (vLLM's proxy picks; here a flag does)
CONNECTORS = {"NixlConnector": "nixl", "P2pNcclConnector": "nccl"}  # vLLM's name: pdserve's --transport
KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port")


def kv_transfer_settings(text: str, role: str) -> dict[str, Any]:
    """The settings (by flag dest: "role", "transfer.transport", "kv_host", "kv_port_base") the JSON text
    gives; role: the --role given otherwise. ValueError names what has no counterpart."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config must be a JSON object: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(
            f"--kv-transfer-config: {unknown} have no counterpart in pdserve (it takes {list(KEYS)}; see "
            "`pdserve serve --help` for its own P/D flags)"
        )
    out: dict[str, Any] = {}
    kv_role = raw.get("kv_role", "kv_both")
    if kv_role in ROLES:
        out["role"] = role = ROLES[kv_role]
    elif kv_role != "kv_both":
        raise ValueError(f"--kv-transfer-config: kv_role must be kv_producer, kv_consumer or kv_both, got {kv_role!r}")
    elif role == "single":
        raise ValueError(
            "--kv-transfer-config: kv_role kv_both leaves the side to --role: add --role pe (prefill) or "
            "--role ce (decode)"
        )
    connector = raw.get("kv_connector")
    if connector is not None:
        if connector not in CONNECTORS:
            raise ValueError(
                f"--kv-transfer-config: kv_connector {connector!r} has no pdserve transport (it takes "
                f"{', '.join(CONNECTORS)}; or leave it out and pass --transport tcp|ipc|nccl|nixl)"
            )
        if role == "pe":  # a decode engine takes every transport of --accept-transports
            out["transfer.transport"] = CONNECTORS[connector]
    for key, dest, flag in (("kv_ip", "kv_host", "--kv-host"), ("kv_port", "kv_port_base", "--kv-port-base")):
        if key not in raw:
            continue
        if role != "ce":
            raise ValueError(
                f"--kv-transfer-config: {key} is where a decode engine receives KV ({flag}); a prefill engine "
                "sends to the address each decode engine tells it"
            )
        value = raw[key]
        if key == "kv_port" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"--kv-transfer-config: kv_port must be an integer, got {value!r}")
        if key == "kv_ip" and not isinstance(value, str):
            raise ValueError(f"--kv-transfer-config: kv_ip must be a string, got {value!r}")
        out[dest] = value
    return out
