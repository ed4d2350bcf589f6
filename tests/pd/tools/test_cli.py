"""The `pdserve` command (pd/tools/cli.py) and `--config FILE.yaml` (pd/flags.py): the file's keys are the
flags' names, kebab or snake case; a key that names no flag is an error; the command line wins."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ForwardConfig
from pd.config import ServerConfig
from pd.flags import config_defaults
from pd.tools.server_process import ServerProcess, get_json
from tests.server_fixtures import openai_client

PDSERVE = str(Path(sys.executable).parent / "pdserve")  # the console script (pip install -e .)
MODEL = "smollm2-135m-instruct"


def _config(tmp_path: Path, text: str, *argv: str) -> ServerConfig:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return ServerConfig.from_argv(["--config", str(path), *argv])


def test_config_keys_are_flag_names(tmp_path: Path) -> None:
    """kebab, snake and --kebab keys; bools as --x / --no-x; lists and comma text for tuples; flags of the
    nested engine, forward and transfer groups; an alias; null for an X | None setting."""
    cfg = _config(
        tmp_path,
        "max-model-len: 1024\n"
        "served_model_name: tiny\n"
        "--dp: 2\n"
        "deterministic: true\n"
        "chain_residuals: false\n"
        "pdl: true\n"
        "gemv-rows: 1\n"
        "prefill-sdpa: 'off'\n"
        "accept-transports: [tcp, ipc]\n"
        "hicache-size-gb: 0\n"
        "kv_cache_gb: 0.25\n"
        "api-key: null\n"
        "send-timeout-s: '7'\n",
    )
    assert (cfg.engine.max_model_len, cfg.served_model_name, cfg.dp) == (1024, "tiny", 2)
    assert cfg.engine.is_deterministic and cfg.engine.forward == ForwardConfig(
        prefill_sdpa="off", chain_residuals=False, pdl=True, gemv_rows=1
    )
    assert (cfg.transfer.accept_transports, cfg.transfer.send_timeout_s) == (("tcp", "ipc"), 7.0)
    assert (cfg.engine.hicache_gb, cfg.engine.kv_cache_gb) == (0.0, 0.25)
    assert _config(tmp_path, "accept_transports: tcp,nccl\n").transfer.accept_transports == ("tcp", "nccl")
    assert _config(tmp_path, "") == ServerConfig()


def test_a_json_setting_takes_a_yaml_map(tmp_path: Path) -> None:
    """--speculative-config in a file: a YAML map (it becomes that JSON) or the JSON text itself."""
    want = {"method": "ngram", "num_speculative_tokens": 3}
    as_map = _config(tmp_path, "speculative-config: {method: ngram, num_speculative_tokens: 3}\n")
    as_text = _config(tmp_path, "speculative_config: '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'\n")
    for cfg in (as_map, as_text):
        assert cfg.engine.speculative_config is not None and json.loads(cfg.engine.speculative_config) == want
    with pytest.raises(ValueError, match="unknown keys \\['k'\\]"):
        _config(tmp_path, "speculative-config: {method: ngram, num_speculative_tokens: 3, k: 1}\n")


def test_forward_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="gemv_rows must be within 0..8"):
        ForwardConfig(gemv_rows=9)


def test_the_command_line_wins(tmp_path: Path) -> None:
    text = "max-model-len: 1024\ndeterministic: true\nport: 9000\n"
    cfg = _config(tmp_path, text, "--max-model-len", "512", "--no-deterministic")
    assert (cfg.engine.max_model_len, cfg.engine.is_deterministic, cfg.port) == (512, False, 9000)
    # before --config or after it: the same
    cfg = ServerConfig.from_argv(["--max-model-len", "256", "--config", str(tmp_path / "cfg.yaml")])
    assert (cfg.engine.max_model_len, cfg.port) == (256, 9000)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-modl-len: 2048\n", "unknown key 'max-modl-len' (did you mean 'max-model-len'?)"),
        ("is_deterministic: true\n", "unknown key 'is_deterministic'"),  # the flag's name, not the field's
        ("config: other.yaml\n", "unknown key 'config'"),
        ("max-model-len: 1\nmax_model_len: 2\n", "'max_model_len' sets --max-model-len a second time"),
        ("hicache-gb: 1\nhicache-size-gb: 2\n", "'hicache-size-gb' sets --hicache-gb a second time"),
        ("deterministic: 1\n", "'deterministic': expected bool, got 1"),
        ("max-model-len: true\n", "'max-model-len': expected int, got True"),
        ("max-model-len: 2.5\n", "'max-model-len': expected int, got 2.5"),
        ("dp: null\n", "'dp': --dp takes no null"),
        ("dtype: float8\n", "'dtype': 'float8' not among"),
        ("accept-transports: [tcp, smoke]\n", "not among"),
        ("- max-model-len\n", "expected a map of flag names to values"),
    ],
)
def test_a_bad_config_is_an_error_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        config_defaults(ServerConfig, path)
    assert message in str(e.value)


def test_a_bad_config_exits_as_a_bad_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _config(tmp_path, "max-modl-len: 2048\n")
    assert e.value.code == 2
    assert "--config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ServerConfig.from_argv(["--config", str(tmp_path / "missing.yaml")])
    assert "missing.yaml" in capsys.readouterr().err


def test_serve_takes_the_model_positionally(tmp_path: Path) -> None:
    """`pdserve serve MODEL` is `python -m pd.server --model MODEL`; the positional wins over the file."""
    cfg = ServerConfig.from_argv(
        ["m1", "--role", "pe", "--dp", "2"], "pdserve serve", is_model_positional=True
    )
    assert (cfg.engine.model, cfg.role, cfg.dp) == ("m1", "pe", 2)
    (tmp_path / "cfg.yaml").write_text("model: m2\n")
    argv = ["--config", str(tmp_path / "cfg.yaml")]
    assert ServerConfig.from_argv(argv, "pdserve serve", is_model_positional=True).engine.model == "m2"
    assert (
        ServerConfig.from_argv([*argv, "m3"], "pdserve serve", is_model_positional=True).engine.model == "m3"
    )
    with pytest.raises(SystemExit):
        ServerConfig.from_argv(["m1"])  # python -m pd.server takes no positional


def _pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PDSERVE, *args], capture_output=True, text=True, timeout=120)


def test_pdserve_help_and_usage_errors() -> None:
    out = _pdserve("--help")
    assert out.returncode == 0
    for command in ("serve", "pd", "models", "bench"):
        assert f"\n    {command} " in out.stdout
    serve = _pdserve("serve", "--help")
    assert serve.returncode == 0
    assert "usage: pdserve serve" in serve.stdout and "--config FILE.yaml" in serve.stdout
    assert "--max-model-len" in serve.stdout and "--prefill-url" in serve.stdout
    assert _pdserve().returncode == 2
    assert _pdserve("nope").returncode == 2
    assert _pdserve("bench", "nope").returncode == 2
    assert "pd_run.sh start" in _pdserve("pd", "--help").stdout


def test_pdserve_models_list() -> None:
    out = _pdserve("models", "list")
    assert out.returncode == 0, out.stderr
    assert MODEL in out.stdout
    assert _pdserve("models", "path", "no-such-model").returncode == 2  # the tool's exit status


@pytest.mark.slow
def test_pdserve_serve_with_a_config_file(tmp_path: Path) -> None:
    """A real `pdserve serve MODEL --config cfg.yaml`: the file's name and context length are served."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("served-model-name: cli-test\nmax_model_len: 640\nkv-cache-gb: 0.1\nhicache-gb: 0\n")
    with ServerProcess(
        "--config", str(cfg), command=(PDSERVE, "serve", MODEL), log_path=tmp_path / "s.log"
    ) as s:
        status, body = get_json(s.url + "/v1/models")
        assert status == 200
        assert [(m["id"], m["max_model_len"]) for m in body["data"]] == [("cli-test", 640)]
        reply = openai_client(s.url, timeout_s=120).chat.completions.create(
            model="cli-test", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert (
            reply.model == "cli-test" and reply.usage is not None and 1 <= reply.usage.completion_tokens <= 4
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--dp", "two"), "pdserve serve: error: argument --dp/--data-parallel-size/-dp: invalid int value: 'two'"),
        (("--no-such-flag",), "pdserve serve: error: unrecognized arguments: --no-such-flag"),
        (("--dp", "0"), "pdserve serve: error: --dp must be >= 1, got 0"),  # a range error: the command's name too
    ],
)
def test_a_bad_flag_is_two_lines_under_the_commands_name(argv: tuple[str, ...], message: str) -> None:
    out = _pdserve("serve", *argv)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[0] == message and len(lines) <= 2, out.stderr


def test_a_port_in_use_stops_the_start_before_anything_loads() -> None:
    """One line naming the address, exit 1, and no engine rank started (no weights loaded)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _pdserve("serve", MODEL, "--port", str(port))
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "engine rank" not in out.stderr and "loading the weights" not in out.stderr


def test_a_ce_with_a_loopback_kv_host_and_a_remote_pe_is_refused_at_start() -> None:
    """--kv-host 127.0.0.1 (the default) with a PE on another host (192.0.2.1, an address no host here has):
    the PE would send KV to its own loopback, so the CE stops at once, naming the flag. A PE on another
    loopback address (127.0.0.2: this host) is no such case."""
    env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": "cli-test-cluster-token-0123456789"}
    argv = [PDSERVE, "serve", MODEL, "--role", "ce", "--port", "0", "--prefill-url", "http://192.0.2.1:8889"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2
    assert "--kv-host 127.0.0.1 is a loopback address, but --prefill-url names http://192.0.2.1:8889" in out.stderr
    assert "engine rank" not in out.stderr


def test_a_remote_pe_needs_a_kv_address_it_reaches() -> None:
    from pd.server import _remote_pe_behind_loopback_kv

    def remote(*argv: str) -> str | None:
        return _remote_pe_behind_loopback_kv(ServerConfig.from_argv(["--role", "ce", *argv]))

    assert remote("--prefill-url", "http://192.0.2.1:8889") == "http://192.0.2.1:8889"
    assert remote("--prefill-url", "http://localhost:8889,http://192.0.2.1:1", "--kv-host", "localhost") == "http://192.0.2.1:1"
    assert remote("--prefill-url", "http://127.0.0.2:8889") is None  # this host
    assert remote("--prefill-url", "http://192.0.2.1:8889", "--kv-host", "0.0.0.0") is None
    assert remote("--prefill-url", "http://192.0.2.1:8889", "--kv-advertise-host", "192.0.2.7") is None
    assert remote("--prefill-url", "dns+http://pe.ns.svc:8889") is None  # its addresses: the lookups'
