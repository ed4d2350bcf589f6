"""The server's settings (pd/config.py): ServerConfig from the command line, the roles' ports, addresses and
transfer settings (RoleConfig), bad values refused."""

from __future__ import annotations

import pytest

from pd.config import RoleConfig, ServerConfig
from transfer.config import TransferConfig


def test_server_config_cli():
    cfg = ServerConfig.from_argv(
        ["--dp", "2", "--port", "9000", "--deterministic", "--routing", "least-loaded"]
    )
    assert (cfg.dp, cfg.http_port, cfg.engine.is_deterministic, cfg.routing, cfg.engine.model) == (
        2,
        9000,
        True,
        "least-loaded",
        "smollm2-135m-instruct",
    )
    with pytest.raises(ValueError):
        ServerConfig(dp=0)


def test_role_config_and_defaults():
    pe = ServerConfig.from_argv(["--role", "pe", "--transport", "ipc", "--ipc-arena-gb", "0.5"])
    ce = ServerConfig.from_argv(["--role", "ce", "--dp", "2", "--kv-port-base", "9100"])
    assert (pe.http_port, ce.http_port, ServerConfig.from_argv([]).http_port) == (8889, 8888, 8888)
    assert ServerConfig.from_argv(["--role", "pe", "--port", "7000"]).http_port == 7000
    assert ce.kv_address(1) == "127.0.0.1:9101"
    assert ce.role_config(1) == RoleConfig(None, "127.0.0.1", 9101, TransferConfig())
    assert ServerConfig(role="ce", kv_advertise_host="10.0.0.5").kv_address(0) == "10.0.0.5:8900"
    assert ServerConfig(role="ce", kv_advertise_host="fe80::1").kv_address(0) == "[fe80::1]:8900"
    transfer = pe.role_config(0).transfer
    assert (transfer.transport, transfer.ipc_arena_bytes) == ("ipc", 1 << 29) and not ServerConfig().is_pd
    nixl = ServerConfig.from_argv(["--role", "ce", "--nixl-arena-mb", "64"]).role_config(0).transfer
    assert [nixl.nixl_arena_bytes(d) for d in ("cpu", "cuda")] == [64 << 20, 64 << 20]
    assert [TransferConfig().nixl_arena_bytes(d) for d in ("cpu", "cuda")] == [256 << 20, 2048 << 20]
    assert TransferConfig(nixl_arena_mb=0).nixl_arena_bytes("cuda") == 0
    with pytest.raises(ValueError, match="nixl_arena_mb"):
        TransferConfig(nixl_arena_mb=-1)
    for bad in (
        dict(role="x"),
        dict(kv_port_base=65535, dp=2),
        dict(handoff_lease_s=0),
        dict(max_queued_requests=-1),
    ):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


def test_a_bad_value_is_an_error():
    for argv in (["--max-model-len", "1"], ["--ipc-arena-gb", "-1"], ["--prefill-sdpa-min-pairs", "0"]):
        with pytest.raises(ValueError):
            ServerConfig.from_argv(argv)
