"""deploy/lib.sh through deploy/server.sh and deploy/pd_run.sh, in seconds: no model is loaded. A stand-in
`python` ($PDSERVE_PYTHON) runs a fake server for `-m pd.server` (its command line names pd.server, as the
real one's does) and the real interpreter for everything else.

Checked: a pid file naming another process (a `sleep`, init) is refused by stop, status and start and the
process is never signalled; a pid file of garbage or of a dead process is removed; stop sends SIGTERM to
the server alone (a rank that ignores it is killed with the group only after PDSERVE_STOP_TIMEOUT_S) and
stops an idle server in about a second; start keeps a server whose ranks are up, starting or restarting,
and restarts one with a rank down for good or whose /health gives no answer; readiness is
/health/ready, or /health on a server without it; pd_run.sh refuses a cluster token file others can read."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd.tools.server_process import free_port, group_members

ROOT = Path(__file__).resolve().parents[2]

# FAKE_HEALTH: a file holding /health's body (default: one rank up). FAKE_NO_READY: no /health/ready (an
# older server). FAKE_RANK: "stopped" spawns a rank (`-c ... pd.rank.worker`, ignoring SIGTERM) that the server
# kills on SIGTERM, "left" one it leaves behind. Every SIGTERM is logged to FAKE_LOG as "ROLE-term PID".
FAKE_SERVER = r"""
import json, os, signal, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RANK = '''
import os, signal, sys, time
def term(*_):
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(f"rank-term {os.getpid()}\\n")
signal.signal(signal.SIGTERM, term)
print("ready", flush=True)
while True:
    time.sleep(1)
'''
port = int(sys.argv[sys.argv.index("--port") + 1])
mode = os.environ.get("FAKE_RANK", "")
rank = None
if mode:
    rank = subprocess.Popen([sys.executable, "-c", RANK, "pd.rank.worker"], stdout=subprocess.PIPE)
    rank.stdout.readline()


def term(*_):
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(f"server-term {os.getpid()}\n")
    if rank is not None and mode == "stopped":
        rank.kill()
        rank.wait()
    os._exit(0)


signal.signal(signal.SIGTERM, term)


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health/ready" and not os.environ.get("FAKE_NO_READY"):
            code, body = 200, b'{"status": "ok"}'
        elif self.path == "/health":
            code, body = 200, b'{"status": "ok", "ranks": [{"rank": 0, "state": "up"}]}'
            if os.environ.get("FAKE_HEALTH"):
                with open(os.environ["FAKE_HEALTH"], "rb") as f:
                    body = f.read()
        else:
            code, body = 404, b'{"error": "not found"}'
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

FAKE_PYTHON = """#!/usr/bin/env bash
if [ "${1:-}" = -m ] && [ "${2:-}" = pd.server ]; then
    shift 2
    exec REAL SERVER pd.server "$@"
fi
exec REAL "$@"
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The scripts' environment: RUN_DIR in tmp_path, the stand-in python, short stop timeout."""
    server = tmp_path / "fake_server.py"
    server.write_text(FAKE_SERVER)
    python = tmp_path / "python"
    python.write_text(
        FAKE_PYTHON.replace("REAL", shlex.quote(sys.executable)).replace("SERVER", shlex.quote(str(server)))
    )
    python.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    e = {
        **os.environ,
        "PDSERVE_RUN_DIR": str(run_dir),
        "PDSERVE_PYTHON": str(python),
        "PDSERVE_STOP_TIMEOUT_S": "45",
        "FAKE_LOG": str(tmp_path / "fake.log"),
    }
    for k in (
        "PDSERVE_CLUSTER_TOKEN",
        "PDSERVE_CLUSTER_TOKEN_FILE",
        "FAKE_HEALTH",
        "FAKE_NO_READY",
        "FAKE_RANK",
    ):
        e.pop(k, None)
    return e


def run(script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "deploy" / script), *args], env=env, capture_output=True, text=True, timeout=120
    )


def run_dir(env: dict[str, str]) -> Path:
    return Path(env["PDSERVE_RUN_DIR"])


def fake_log(env: dict[str, str]) -> list[str]:
    log = Path(env["FAKE_LOG"])
    return log.read_text().splitlines() if log.exists() else []




@contextlib.contextmanager
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "100"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


@contextlib.contextmanager
def cleanup(env: dict[str, str]) -> Iterator[None]:
    """Whatever a failing test left running from its RUN_DIR goes (SIGKILL to each group it started)."""
    try:
        yield
    finally:
        for f in run_dir(env).glob("*.pid"):
            with contextlib.suppress(ValueError, OSError):
                pid = int(f.read_text())
                if "pd.server" in Path(f"/proc/{pid}/cmdline").read_text():
                    os.killpg(pid, signal.SIGKILL)


def start_fake(env: dict[str, str], port: int) -> int:
    r = run("server.sh", "start", "--port", str(port), env=env)
    assert r.returncode == 0 and "pdserve is ready" in r.stdout, r.stdout + r.stderr
    return int((run_dir(env) / f"server-{port}.pid").read_text())


# ---- pid files that are not ours -------------------------------------------------------------------


@pytest.mark.parametrize("other", ["sleep", "pytest"])
def test_a_pid_file_of_another_process_is_never_signalled(env: dict[str, str], other: str) -> None:
    port = free_port()
    pidfile = run_dir(env) / f"server-{port}.pid"
    with sleeper() as p:
        pid = p.pid if other == "sleep" else os.getpid()  # pytest: a SIGTERM would end the run
        pidfile.write_text(f"{pid}\n")
        stop = run("server.sh", "stop", env=env)
        assert stop.returncode == 1, stop.stdout + stop.stderr
        assert f"{pidfile} holds pid {pid}, which is not a pdserve server" in stop.stderr
        assert "nothing was signalled" in stop.stderr and "stopped" not in stop.stdout

        status = run("server.sh", "status", "--port", str(port), env=env)
        assert status.returncode == 3 and "foreign pid file" in status.stdout, status.stdout

        start = run("server.sh", "start", "--port", str(port), env=env)
        assert start.returncode == 1 and f"not starting pdserve on port {port}" in start.stderr, start.stderr
        assert not (run_dir(env) / f"server-{port}.log").exists()  # nothing was started

        pd_pidfile = run_dir(env) / f"pd-ce-127.0.0.1-{port}.pid"
        pd_pidfile.write_text(f"{pid}\n")
        pd_stop = run("pd_run.sh", "stop", "localhost", "localhost", env=env)
        assert pd_stop.returncode == 1 and f"{pd_pidfile} holds pid {pid}" in pd_stop.stderr, pd_stop.stderr

        assert p.poll() is None  # the sleep is alive: nothing signalled it
        assert pidfile.read_text() == pd_pidfile.read_text() == f"{pid}\n"  # left for the user to look at
    assert not fake_log(env)


@pytest.mark.parametrize("content", ["", "abc\n", "12 34\n", "-5\n", "0\n", "dead"])
def test_a_pid_file_of_garbage_or_a_dead_process_is_removed(env: dict[str, str], content: str) -> None:
    if content == "dead":
        p = subprocess.Popen(["true"])
        p.wait()
        content = f"{p.pid}\n"
    port = free_port()
    pidfile = run_dir(env) / f"server-{port}.pid"
    pidfile.write_text(content)
    r = run("server.sh", "stop", "--port", str(port), env=env)
    assert r.returncode == 0 and "not running" in r.stdout, r.stdout + r.stderr
    assert not pidfile.exists()
    pidfile.write_text(content)
    r = run("server.sh", "status", "--port", str(port), env=env)
    assert r.returncode == 3 and "stale pid file removed" in r.stdout, r.stdout
    assert not pidfile.exists()


# ---- stop: SIGTERM to the server alone --------------------------------------------------------------


def test_stop_of_an_idle_server_takes_about_a_second(env: dict[str, str]) -> None:
    env["FAKE_RANK"] = "stopped"
    port = free_port()
    with cleanup(env):
        pid = start_fake(env, port)
        assert len(group_members(pid)) == 2  # the server and its rank
        t0 = time.monotonic()
        r = run("server.sh", "stop", env=env)
        elapsed_s = time.monotonic() - t0
    assert r.returncode == 0 and f"stopped server-{port}" in r.stdout and "killing" not in r.stdout, r.stdout
    assert elapsed_s < 5, elapsed_s  # about 1 s; loose for 2 busy cores
    assert fake_log(env) == [f"server-term {pid}"]  # the rank got no SIGTERM: its server stopped it
    assert not group_members(pid) and not list(run_dir(env).glob("server-*.pid"))


def test_stop_kills_the_group_after_the_stop_timeout(env: dict[str, str]) -> None:
    """A server that exits on SIGTERM leaving its rank behind: the rank (which ignores SIGTERM, and got
    none) goes with SIGKILL to the group once PDSERVE_STOP_TIMEOUT_S has passed."""
    env["FAKE_RANK"] = "left"
    env["PDSERVE_STOP_TIMEOUT_S"] = "1"
    port = free_port()
    with cleanup(env):
        pid = start_fake(env, port)
        t0 = time.monotonic()
        r = run("server.sh", "stop", "--port", str(port), env=env)
        elapsed_s = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"server-{port} did not exit within 1s of SIGTERM; killing its process group {pid}" in r.stdout
    assert f"stopped server-{port}" in r.stdout and 1 <= elapsed_s < 8, (r.stdout, elapsed_s)
    assert fake_log(env) == [f"server-term {pid}"]
    assert not group_members(pid)


# ---- start: keep, or repair --------------------------------------------------------------------------


@pytest.mark.parametrize("no_ready", [False, True])
def test_start_keeps_a_server_whose_ranks_are_up_or_coming_back(
    env: dict[str, str], tmp_path: Path, no_ready: bool
) -> None:
    """no_ready: an older server without /health/ready; start waits for /health instead."""
    if no_ready:
        env["FAKE_NO_READY"] = "1"
    health = tmp_path / "health.json"
    health.write_text(
        '{"status": "degraded", "ranks": [{"rank": 0, "state": "up"}, {"rank": 1, "state": "restarting"},'
        ' {"rank": 2, "state": "starting"}]}'
    )
    env["FAKE_HEALTH"] = str(health)
    port = free_port()
    with cleanup(env):
        pid = start_fake(env, port)
        r = run("server.sh", "start", "--port", str(port), env=env)
        assert r.returncode == 0 and f"already running on port {port} (pid {pid})" in r.stdout, r.stdout
        assert int((run_dir(env) / f"server-{port}.pid").read_text()) == pid and group_members(pid)
        run("server.sh", "stop", env=env)
    assert fake_log(env) == [f"server-term {pid}"]  # from the stop alone


@pytest.mark.parametrize("health_body", ["down", "garbage"])
def test_start_restarts_a_server_with_a_rank_down_or_no_answer(
    env: dict[str, str], tmp_path: Path, health_body: str
) -> None:
    health = tmp_path / "health.json"
    health.write_text('{"status": "ok", "ranks": [{"rank": 0, "state": "up"}]}')
    env["FAKE_HEALTH"] = str(health)
    port = free_port()
    with cleanup(env):
        pid = start_fake(env, port)
        if health_body == "down":
            health.write_text(
                '{"status": "degraded", "ranks": [{"rank": 0, "state": "up"}, {"rank": 1, "state": "down"}]}'
            )
            said = f"pdserve on port {port} has rank(s) down for good; restarting it"
        else:
            health.write_text("<html>not json</html>")
            said = f"pdserve on port {port} (pid {pid}) does not answer"
        r = run("server.sh", "start", "--port", str(port), env=env)
        assert r.returncode == 0 and said in r.stdout and "pdserve is ready" in r.stdout, r.stdout + r.stderr
        new_pid = int((run_dir(env) / f"server-{port}.pid").read_text())
        assert new_pid != pid and not group_members(pid) and group_members(new_pid)
        run("server.sh", "stop", env=env)
    assert fake_log(env) == [f"server-term {pid}", f"server-term {new_pid}"]


# ---- cluster token --------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["env", "run_dir"])
def test_pd_run_refuses_a_token_file_others_can_read(env: dict[str, str], tmp_path: Path, where: str) -> None:
    token = tmp_path / "token" if where == "env" else run_dir(env) / "cluster.token"
    token.write_text("a-cluster-token-0123456789\n")
    token.chmod(0o644)
    if where == "env":
        env["PDSERVE_CLUSTER_TOKEN_FILE"] = str(token)
    r = run("pd_run.sh", "start", "localhost", "localhost", "--port", str(free_port()), env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"cluster token file {token} is readable by others (mode 644): chmod 600 {token}" in r.stderr
    assert not list(run_dir(env).glob("*.pid")) and not list(run_dir(env).glob("*.log"))
