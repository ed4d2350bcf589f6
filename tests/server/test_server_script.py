"""deploy/server.sh: start waits for /health and prints the URL, status says what runs, stop ends the
whole process group (no engine rank survives)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pd.testing import free_port, get_json

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "server.sh"


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_status_stop(tmp_path):
    env = {**os.environ, "PDSERVE_RUN_DIR": str(tmp_path)}
    port = free_port()
    started = run("start", "--port", str(port), "--max-model-len", "512", "--kv-cache-gb", "0.1", env=env)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"http://127.0.0.1:{port}/v1" in started.stdout and "deploy/server.sh stop" in started.stdout
        pid = int((tmp_path / f"server-{port}.pid").read_text())
        status, health = get_json(f"http://127.0.0.1:{port}/health")
        assert status == 200 and health["ranks"][0]["state"] == "up"
        rank_pid = health["ranks"][0]["pid"]
        assert os.getpgid(rank_pid) == pid  # the rank is in the server's process group
        again = run("start", "--port", str(port), env=env)
        assert again.returncode == 0 and "already running" in again.stdout
        st = run("status", env=env)
        assert st.returncode == 0 and f"pid {pid}" in st.stdout and '"status":"ok"' in st.stdout
    finally:
        stopped = run("stop", env=env)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    assert not group_alive(pid)
    assert not (tmp_path / f"server-{port}.pid").exists()
    assert run("status", env=env).returncode == 3


def test_start_failure_is_reported(tmp_path):
    env = {**os.environ, "PDSERVE_RUN_DIR": str(tmp_path)}
    r = run("start", "--port", str(free_port()), "--model", "no-such-model", env=env)
    assert r.returncode == 1 and "failed to start" in r.stderr
    assert not list(tmp_path.glob("*.pid"))
