"""deploy/pd_run.sh's ssh path, end to end on this machine: a stand-in `ssh` first on PATH runs the remote
command with `bash -c` (what sshd does on a host with the same repository path), in a login-like clean
environment from $HOME, and logs each call. The "remote" host is this machine's own non-loopback address,
which pd_run.sh does not classify as local.

Checked with real servers: start sends the token with `_token --from-stdin` and starts both sides through
ssh; the PE and the CE's KV receivers bind the remote address; a chat request through the printed endpoint
works; status over ssh sees both; start again starts nothing; stop leaves no process. A flag value full of
shell metacharacters and a RUN_DIR with a space survive the hop. A pair with one side on loopback and one
remote is refused: neither could reach the other. A host name that ssh would read as an option is refused
before anything runs."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from pd.tools.server_process import free_port, get_json, group_members
from tests.server_fixtures import openai_client

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "pd_run.sh"
FLAGS = ("--max-model-len", "512", "--kv-cache-gb", "0.1", "--hicache-gb", "0.05")

# Kept here as written by the test: LOG and STDIN are replaced by quoted paths.
FAKE_SSH = r"""#!/usr/bin/env bash
# Stand-in for ssh: checks the call is `ssh -o BatchMode=yes -- HOST COMMAND` (after `--`, no host name
# can be read as an option), logs HOST<TAB>COMMAND, runs COMMAND as sshd would on HOST: `bash -c` from
# $HOME, in a clean environment (nothing of the caller's PDSERVE_* comes through but what COMMAND sets;
# PDSERVE_HOME stands for the remote user's profile).
set -uo pipefail
if [ $# -ne 5 ] || [ "$1" != -o ] || [ "$2" != BatchMode=yes ] || [ "$3" != -- ]; then
    { printf 'BAD'; printf ' %q' "$@"; echo; } >>LOG
    echo "ssh stand-in: expected ssh -o BatchMode=yes -- HOST COMMAND" >&2
    exit 255
fi
printf '%s\t%s\n' "$4" "$5" >>LOG
cd "$HOME" || exit 255
clean=(env -i HOME="$HOME" PATH="$PATH" LANG="${LANG:-C.UTF-8}")
[ -n "${PDSERVE_HOME:-}" ] && clean+=(PDSERVE_HOME="$PDSERVE_HOME")
case "$5" in
    *" _token --from-stdin") tee -a STDIN | "${clean[@]}" bash -c "$5" ;;
    *) exec "${clean[@]}" bash -c "$5" ;;
esac
"""


def own_address() -> str | None:
    """This machine's IPv4 address that is not loopback and can be bound; None without one."""
    candidates = []
    with contextlib.suppress(OSError):
        candidates.append(socket.gethostbyname(socket.gethostname()))
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # UDP: sends nothing, picks the route's source address
        candidates.append(s.getsockname()[0])
    for addr in candidates:
        if addr.startswith("127.") or addr == "0.0.0.0":
            continue
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind((addr, 0))
            return addr
    return None


def listening(port: int) -> set[str]:
    """The IPv4 addresses with a TCP socket listening on port (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        hex_ip, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(hex_ip)[::-1]))
    return found




def ssh_calls(log: Path) -> list[tuple[str, str]]:
    """(host, command) per call; a malformed call fails here."""
    lines = log.read_text().splitlines() if log.exists() else []
    assert not [x for x in lines if x.startswith("BAD")], lines
    return [(h, c) for h, c in (x.split("\t", 1) for x in lines)]


@pytest.fixture
def ssh_env(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """(environment with the stand-in ssh first on PATH and RUN_DIR with a space, RUN_DIR, ssh log)."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc/net/tcp")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log, stdin = tmp_path / "ssh.log", tmp_path / "ssh-stdin"
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH.replace("LOG", shlex.quote(str(log))).replace("STDIN", shlex.quote(str(stdin))))
    ssh.chmod(0o755)
    run_dir = tmp_path / "run dir"
    env = {
        **os.environ,
        "PDSERVE_RUN_DIR": str(run_dir),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    for k in ("PDSERVE_CLUSTER_TOKEN", "PDSERVE_CLUSTER_TOKEN_FILE"):
        env.pop(k, None)
    return env, run_dir, log


def pd_run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
        cwd="/",
    )


def test_pair_on_a_remote_host_through_ssh(
    tmp_path: Path, ssh_env: tuple[dict[str, str], Path, Path]
) -> None:
    ip = own_address()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address to bind")
    env, run_dir, log = ssh_env
    marker = tmp_path / "evaluated"
    name = f"smol lm; $(touch {marker}) `touch {marker}` 'q' \"dq\" & | * \\ #"
    ce, pe, kv = free_port(), free_port(), free_port()
    ports = ("--port", str(ce), "--pe-port", str(pe))
    start = ("start", ip, ip, *ports, "--kv-port-base", str(kv), *FLAGS, "--served-model-name", name)
    groups: list[int] = []
    try:
        r = pd_run(*start, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        calls = ssh_calls(log)
        assert {h for h, _ in calls} == {ip}
        prefix = f"PDSERVE_RUN_DIR={shlex.quote(str(run_dir))} {SCRIPT} "
        assert all(shlex.split(c)[:2] == shlex.split(prefix) for _, c in calls), calls
        verbs = [shlex.split(c)[2:4] for _, c in calls]
        # the CE is launched first, loads while the PE starts, and is waited for once the PE is ready
        assert verbs == [["_token", "--from-stdin"]] * 2 + [["_launch", "ce"], ["_start", "pe"], ["_wait", "ce"]], calls
        # the token went over stdin (once per remote host named) and is the one the remote RUN_DIR holds
        token = run_dir / "cluster.token"
        assert token.stat().st_mode & 0o077 == 0 and len(token.read_text().strip()) >= 16
        assert (tmp_path / "ssh-stdin").read_text() == token.read_text() * 2
        assert all("--cluster-token-file" in shlex.split(calls[i][1]) for i in (2, 3))

        m = re.search(r"P/D pair ready: (\S+)/v1 ", r.stdout)
        assert m, r.stdout
        ce_url = m.group(1)
        groups = [
            int((run_dir / f"pd-{side}-{bind}-{port}.pid").read_text())
            for side, bind, port in (("pe", ip, pe), ("ce", ip, ce))
        ]
        # the PE and the KV receivers bind the remote address, the OpenAI API stays on loopback
        assert listening(pe) == {ip} and listening(kv) == {ip} and listening(ce) == {"127.0.0.1"}
        status, health = get_json(f"http://{ip}:{pe}/health")
        assert status == 200 and health["role"] == "pe"
        status, health = get_json(f"{ce_url}/health")
        assert status == 200 and health["role"] == "ce" and health["prefill_engines"][0]["state"] == "up"
        # the flag value came through both hops intact, and nothing in it was run by a shell
        assert get_json(f"http://{ip}:{pe}/v1/models")[1]["data"][0]["id"] == name
        assert get_json(f"{ce_url}/v1/models")[1]["data"][0]["id"] == name
        assert not marker.exists()
        reply = openai_client(ce_url, timeout_s=300).chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert reply.choices[0].message.content

        st = pd_run("status", ip, ip, *ports, env=env)
        rows = [line.split() for line in st.stdout.splitlines()[1:]]
        assert st.returncode == 0 and [r[:3] for r in rows] == [[ip, "pe", str(pe)], [ip, "ce", str(ce)]]
        assert [shlex.split(c)[2:6] for _, c in ssh_calls(log)[5:]] == [
            ["_status", "pe", ip, str(pe)],
            ["_status", "ce", ip, str(ce)],
        ]

        before = {g: group_members(g) for g in groups}
        again = pd_run(*start, env=env)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "pe already running" in again.stdout and "ce already running" in again.stdout
        assert "starting" not in again.stdout
        assert {g: group_members(g) for g in groups} == before
    finally:
        groups = sorted({*groups, *(int(f.read_text()) for f in run_dir.glob("*.pid"))})
        stopped = pd_run("stop", ip, ip, *ports, env=env)
        survivors = [g for g in groups if group_members(g)]
        for g in survivors:  # whatever stop missed goes, so that a failure here leaves no server behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(g, signal.SIGKILL)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "stopped pd-ce" in stopped.stdout and "stopped pd-pe" in stopped.stdout, stopped.stdout
    assert [shlex.split(c)[2:4] for _, c in ssh_calls(log)[-2:]] == [["_stop", "ce"], ["_stop", "pe"]]
    assert len(groups) == 2 and not survivors
    assert not list(run_dir.glob("*.pid"))
    assert pd_run("status", ip, ip, env=env).returncode == 3
    assert not marker.exists()


@pytest.mark.parametrize("local_side", ["pe", "ce"])
def test_one_local_one_remote_side_is_refused(
    local_side: str, ssh_env: tuple[dict[str, str], Path, Path]
) -> None:
    """A side on loopback is out of the other host's reach: the remote CE would dial its own 127.0.0.1 for
    /prefill, or the remote PE its own for the KV receivers. start refuses before anything runs."""
    ip = own_address()
    if ip is None:
        pytest.skip("no non-loopback IPv4 address to bind")
    env, run_dir, log = ssh_env
    hosts = ("localhost", ip) if local_side == "pe" else (ip, "127.0.0.1")
    r = pd_run("start", *hosts, "--port", str(free_port()), "--pe-port", str(free_port()), *FLAGS, env=env)
    assert r.returncode != 0 and "hosts on loopback and remote ones do not mix" in r.stderr, r.stdout + r.stderr
    assert not ssh_calls(log) and not list(run_dir.glob("*.pid"))


@pytest.mark.parametrize("command", ["start", "stop", "status"])
def test_a_host_name_ssh_would_read_as_an_option_is_refused(
    command: str, ssh_env: tuple[dict[str, str], Path, Path]
) -> None:
    env, run_dir, log = ssh_env
    host = "-oProxyCommand=touch pwned"
    r = pd_run(command, "localhost", host, env=env)
    assert r.returncode != 0 and f"host name '{host}' starts with '-': refused" in r.stderr, (
        r.stdout + r.stderr
    )
    assert not log.exists() and not run_dir.exists()
