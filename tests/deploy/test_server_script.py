"""deploy/server.sh: start waits for /health/ready and prints the URL, status says what runs, start again
leaves a running server alone but restarts one whose rank is down for good, stop ends the whole process
group (no engine rank survives)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pd.tools.server_process import free_port, get_json, group_alive
from tests.server_fixtures import openai_client

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "server.sh"


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900)




def rank_children(pid: int) -> list[int]:
    """The `python -m pd.rank.worker` processes whose parent is pid (from /proc/*/stat and cmdline)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                args = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if ppid == pid and b"pd.rank.worker" in args:
                found.append(int(d.name))
    return found


def test_start_status_stop(tmp_path):
    """--rank-restart-max 0: a rank that dies stays down, and start then restarts the server."""
    env = {**os.environ, "PDSERVE_RUN_DIR": str(tmp_path)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ("--max-model-len", "512", "--kv-cache-gb", "0.1", "--rank-restart-max", "0")
    started = run("start", "--port", str(port), *flags, env=env)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"http://127.0.0.1:{port}/v1" in started.stdout and "deploy/server.sh stop" in started.stdout
        pid = int((tmp_path / f"server-{port}.pid").read_text())
        status, health = get_json(f"http://127.0.0.1:{port}/health")
        assert status == 200 and health["ranks"][0]["state"] == "up"
        (rank_pid,) = rank_children(pid)
        assert os.getpgid(rank_pid) == pid  # the rank is in the server's process group
        again = run("start", "--port", str(port), env=env)
        assert again.returncode == 0 and "already running" in again.stdout
        st = run("status", env=env)
        assert st.returncode == 0 and f"pid {pid}" in st.stdout and '"status":"ok"' in st.stdout

        # the rank dies and, with no restart allowed, stays down: start stops the server and starts it anew
        os.kill(rank_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while get_json(f"{url}/health")[1]["ranks"][0]["state"] != "down":
            assert time.monotonic() < deadline, get_json(f"{url}/health")
            time.sleep(0.3)
        repaired = run("start", "--port", str(port), *flags, env=env)
        assert repaired.returncode == 0, repaired.stdout + repaired.stderr
        assert f"pdserve on port {port} has rank(s) down for good; restarting it" in repaired.stdout
        assert f"stopped server-{port}" in repaired.stdout and "pdserve is ready" in repaired.stdout
        assert not group_alive(pid)
        old_pid, pid = pid, int((tmp_path / f"server-{port}.pid").read_text())
        assert pid != old_pid
        status, health = get_json(f"{url}/health")
        assert status == 200 and health["status"] == "ok" and health["ranks"][0]["state"] == "up", health
        reply = openai_client(url, timeout_s=300).chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
        )
        assert reply.choices[0].message.content
    finally:
        stopped = run("stop", env=env)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    assert "killing" not in stopped.stdout  # the server drained and stopped its ranks within the timeout
    assert not group_alive(pid)
    assert not (tmp_path / f"server-{port}.pid").exists()
    assert run("status", env=env).returncode == 3


def test_start_failure_is_reported(tmp_path):
    env = {**os.environ, "PDSERVE_RUN_DIR": str(tmp_path)}
    r = run("start", "--port", str(free_port()), "--model", "no-such-model", env=env)
    assert r.returncode == 1 and "failed to start" in r.stderr
    assert not list(tmp_path.glob("*.pid"))
