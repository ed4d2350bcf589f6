"""The command line (pd/flags.py): one flag per settings field, named, defaulted and explained by it; the
flags users pass keep their defaults; a misspelled flag is an error."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from engine.config import ForwardConfig
from pd.config import ServerConfig
from pd.flags import parser_for
from transfer.config import TransferConfig

# Every flag README.md, deploy/ and the tests pass, with the default it has always had.
USER_FLAGS: dict[str, object] = {
    "--model": "smollm2-135m-instruct", "--role": "single", "--served-model-name": None,
    "--host": "127.0.0.1", "--port": None, "--dp": 1, "--device": "auto", "--deterministic": False,
    "--enforce-eager": False, "--routing": "affinity", "--chat-template": None, "--max-model-len": None,
    "--max-num-seqs": 64, "--max-num-batched-tokens": 2048, "--block-size": 128, "--kv-cache-gb": None,
    "--hicache-gb": None, "--hicache-size-gb": None, "--hicache-state-slots": None, "--dtype": "auto",
    "--gpu-memory-utilization": 0.9, "--load-format": "auto", "--seed": 0, "--max-body-bytes": 4 << 20,
    "--rank-start-timeout-s": 600.0, "--log-level": "info", "--prefill-url": "http://127.0.0.1:8889",
    "--kv-host": "127.0.0.1", "--kv-advertise-host": None, "--kv-port-base": 8900, "--transport": "tcp",
    "--ipc-arena-gb": 4.0, "--handoff-lease-s": 30.0, "--prefill-timeout-s": 600.0,
    "--fallback-local-prefill": False, "--max-queued-requests": 256, "--queue-timeout-s": 120.0,
    "--cluster-token-file": None, "--quantization": None, "--tp": 1,
    # vLLM's names and switches (issue 52), with vLLM's defaults
    "--tensor-parallel-size": 1, "-tp": 1, "--data-parallel-size": 1, "-dp": 1, "--enable-prefix-caching": True,
    "--no-enable-prefix-caching": True, "--generation-config": "auto", "--trust-remote-code": False,
    "--kv-transfer-config": None,
}  # fmt: skip


def _settings(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """The leaf fields of a settings dataclass by path ("engine.forward.prefill_sdpa")."""
    hints = typing.get_type_hints(cls)
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_settings(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f
    return out


def test_flags_are_the_settings_fields():
    """One flag per field of ServerConfig and of the EngineConfig and TransferConfig it nests, named,
    defaulted and explained by the field; the flags users pass keep their defaults; from no flags, the
    dataclasses' own defaults."""
    parser = parser_for(ServerConfig, "pd.server", "")
    actions = [a for a in parser._actions if a.dest != "help"]
    fields = _settings(ServerConfig)
    assert sorted(a.dest for a in actions) == sorted(fields)  # one to one
    for a in actions:
        f = fields[a.dest]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert a.default == default, a.dest
        assert f.metadata["help"] and a.help == f.metadata["help"]
        name = f.metadata.get("flag", a.dest.rpartition(".")[2].replace("_", "-"))
        assert a.option_strings[0] == f"--{name}", a.dest
    by_flag = {s: a for a in actions for s in a.option_strings}
    for flag, default in USER_FLAGS.items():
        assert by_flag[flag].default == default, flag
    assert by_flag["--hicache-size-gb"] is by_flag["--hicache-gb"]
    assert ServerConfig.from_argv([]) == ServerConfig()
    cfg = ServerConfig.from_argv(
        "--hicache-size-gb 2 --prefill-sdpa off --prefill-sdpa-min-pairs 7 --no-chain-residuals "
        "--accept-transports tcp,ipc --ipc-time-copies --idle-timeout-s 3 --num-swa-slots 5 --nixl-copy-in "
        "--ipc-copy-in".split()
    )
    assert (cfg.engine.hicache_gb, cfg.engine.num_swa_slots, cfg.engine.forward) == (
        2.0,
        5,
        ForwardConfig(prefill_sdpa="off", prefill_sdpa_min_pairs=7, chain_residuals=False),
    )
    assert cfg.transfer == TransferConfig(
        accept_transports=("tcp", "ipc"), ipc_time_copies=True, idle_timeout_s=3.0, nixl_copy_in=True,
        ipc_copy_in=True,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-num-seq", "3"],  # an abbreviation is not taken either
        ["--determinstic"],
        ["--deterministic=yes"],
        ["--prefill-sdpa", "fast"],
        ["--accept-transports", "tcp,udp"],
        ["--dp", "two"],
        ["--quantization", "int8"],
    ],
)
def test_a_misspelled_flag_is_an_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ServerConfig.from_argv(argv)
    assert "error" in capsys.readouterr().err
