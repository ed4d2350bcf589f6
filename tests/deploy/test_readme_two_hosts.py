"""README.md's "A P/D pair on two hosts", by hand, run as the README writes it: its commands are read from
the README's first code block of that section (so the test fails when the README drifts), with 127.0.0.2
standing for host A (10.0.0.1) and 127.0.0.3 for host B (10.0.0.2), and SmolLM2-135M-Instruct for the
README's model. Each command runs in one scratch folder (the two hosts' shared cluster.token), `python`
and `pdserve` taken from this interpreter's environment.

What this machine adds to the commands, and nothing else: small-memory flags (SMALL), and other ports
than the defaults (8888, 8889, 8900) only when one of those is taken here (then `--port`, `--kv-port-base`
and the port of `--prefill-url` are changed alike). Checked: the token command makes a mode-600 token;
the PE binds host A's address only and the CE's KV receiver host B's; the CE answers a chat through the
OpenAI client, and that answer came through the PE (a handoff sent by the PE and imported by the CE)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd.tools.server_process import ServerProcess, free_port, get_json, group_members
from tests.server_fixtures import metric, openai_client, skip_unless_bindable

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## A P/D pair on two hosts"
HOSTS = {"10.0.0.1": "127.0.0.2", "10.0.0.2": "127.0.0.3"}  # the README's host A and B -> loopback stand-ins
README_MODEL = "Qwen/Qwen3-8B"
MODEL = "smollm2-135m-instruct"
SMALL = ("--max-model-len", "512", "--kv-cache-gb", "0.1", "--hicache-gb", "0.05")
READY_S = 300.0  # both servers load SmolLM2 on shared cores


def readme_commands(readme: str) -> list[str]:
    """The commands of the section's first ```sh block: continuation lines joined, comment lines dropped."""
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, f"no ```sh block under {SECTION!r} in README.md"
    commands, current = [], ""
    for line in block.group(1).splitlines():
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip() and not current.lstrip().startswith("#"):
            commands.append(" ".join(current.split()))
        current = ""
    return commands


def test_the_recipe_is_the_one_this_test_knows() -> None:
    """The shape the test below relies on: a token command, then the PE on host A and the CE on host B."""
    token, pe, ce = readme_commands((ROOT / "README.md").read_text())
    assert token.startswith("python -m transfer.auth > cluster.token")
    assert pe.startswith(f"pdserve serve {README_MODEL} --role pe") and "--host 10.0.0.1" in pe
    assert ce.startswith(f"pdserve serve {README_MODEL} --role ce") and "--kv-host 10.0.0.2" in ce
    assert "--prefill-url http://10.0.0.1:8889" in ce


def _bindable(host: str, port: int) -> bool:
    """Whether a server could listen there now (with SO_REUSEADDR, as the servers bind: an earlier run's
    connections in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _on_this_machine(command: str, ports: dict[int, int], as_written: bool) -> list[str]:
    """The README's server command as argv, hosts and model swapped, ports moved where taken, SMALL added."""
    argv = []
    for arg in shlex.split(command, comments=True):
        for readme_host, host in HOSTS.items():
            arg = arg.replace(readme_host, host)
        arg = arg.replace(README_MODEL, MODEL)
        for default, port in ports.items():
            arg = arg.replace(f":{default}", f":{port}")
        argv.append(arg)
    role = argv[argv.index("--role") + 1]
    if not as_written:
        argv += ["--port", str(ports[8889] if role == "pe" else ports[8888])]
        if role == "ce":
            argv += ["--kv-port-base", str(ports[8900])]
    return [*argv, *SMALL]


def _listening(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses the process group of pid listens on (from /proc/net/tcp; IPv4)."""
    inodes = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            if os.getpgid(int(proc.name)) != pid:
                continue
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            addr, port = fields[1].split(":")
            host = socket.inet_ntoa(bytes.fromhex(addr)[::-1])
            out.add((host, int(port, 16)))
    return out


@contextlib.contextmanager
def _started(argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A server in its own process group; on exit SIGTERM to the group, SIGKILL after 30 s. Its log is
    checked for asyncio complaints after the test, as every ServerProcess's is (tests/conftest.py)."""
    ServerProcess.log_paths.add(log)
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the engine ranks too, whatever state they are in
        proc.wait(30)


def _wait_ready(url: str, procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, Path]) -> None:
    """Until the CE at url serves (every rank up) and sees its PE up; fails at once if a server exits."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                pytest.fail(f"the {name} exited with {proc.returncode}:\n{logs[name].read_text()[-3000:]}")
        with contextlib.suppress(OSError, ValueError):
            status, body = get_json(url + "/health", 2.0)
            ranks_up = all(r.get("state") != "starting" for r in body.get("ranks", []))
            pes_up = [p.get("state") for p in body.get("prefill_engines") or []] == ["up"]
            if status == 200 and ranks_up and pes_up:
                return
        time.sleep(0.5)
    pytest.fail(f"not ready in {READY_S} s:\n" + "\n".join(f"{n}: {p.read_text()[-2000:]}" for n, p in logs.items()))


def test_the_readme_pair_on_two_hosts_answers_a_chat(tmp_path: Path) -> None:
    skip_unless_bindable(*HOSTS.values())
    token_cmd, pe_cmd, ce_cmd = readme_commands((ROOT / "README.md").read_text())
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    for var in ("PDSERVE_CLUSTER_TOKEN", "PDSERVE_CLUSTER_TOKEN_FILE"):  # the README's token file alone
        env.pop(var, None)
    assert shutil.which("pdserve", path=env["PATH"]) == str(bin_dir / "pdserve")

    subprocess.run(["bash", "-c", token_cmd], cwd=tmp_path, env=env, check=True, timeout=60)
    token = tmp_path / "cluster.token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text().strip()) >= 32

    defaults = {8888: ("0.0.0.0", 8888), 8889: (HOSTS["10.0.0.1"], 8889), 8900: (HOSTS["10.0.0.2"], 8900)}
    as_written = all(_bindable(host, port) for host, port in defaults.values())
    ports = {d: d if as_written else free_port() for d in defaults}
    pe_argv, ce_argv = _on_this_machine(pe_cmd, ports, as_written), _on_this_machine(ce_cmd, ports, as_written)
    print("PE:", shlex.join(pe_argv), "\nCE:", shlex.join(ce_argv), "\nports as written:", as_written)

    logs = {"PE": tmp_path / "pe.log", "CE": tmp_path / "ce.log"}
    ce_url = f"http://{HOSTS['10.0.0.2']}:{ports[8888]}"  # host B's address; the CE binds every address
    pe_url = f"http://{HOSTS['10.0.0.1']}:{ports[8889]}"
    with _started(pe_argv, tmp_path, env, logs["PE"]) as pe, _started(ce_argv, tmp_path, env, logs["CE"]) as ce:
        _wait_ready(ce_url, {"PE": pe, "CE": ce}, logs)
        assert (HOSTS["10.0.0.1"], ports[8889]) in _listening(pe.pid)
        assert ("127.0.0.1", ports[8889]) not in _listening(pe.pid)
        assert {("0.0.0.0", ports[8888]), (HOSTS["10.0.0.2"], ports[8900])} <= _listening(ce.pid)

        client = openai_client(ce_url, timeout_s=120)
        [model] = [m.id for m in client.models.list().data]
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8, temperature=0,
        )  # fmt: skip
        assert answer.choices[0].message.content and answer.usage is not None
        assert answer.usage.completion_tokens > 0 and answer.choices[0].finish_reason in ("stop", "length")
        # the engines' counters reach /metrics with their ranks' next stats (a moment after the answer)
        deadline = time.monotonic() + 60
        while not (metric(pe_url, "pdserve_engine_handoffs_sent_total") >= 1
                   and metric(ce_url, "pdserve_engine_handoffs_imported_total") >= 1):  # fmt: skip
            assert time.monotonic() < deadline, "no handoff counted: " + logs["PE"].read_text()[-2000:]
            time.sleep(0.5)
    for proc in (pe, ce):
        assert proc.returncode is not None
    leftover = [p for p in (pe.pid, ce.pid) if group_members(p)]
    assert leftover == [], f"process groups still alive: {leftover}"

