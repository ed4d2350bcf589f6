"""deploy/pd_run.sh on localhost, next to a single-engine server from deploy/server.sh: start waits for
both sides and prints the endpoint; a crashed PE is brought back by `start` without touching the CE;
stop leaves no process behind; the single-engine server is unaffected throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pd.testing import free_port, get_json, group_alive, group_members
from tests.server_fixtures import openai_client

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("--max-model-len", "512", "--kv-cache-gb", "0.1", "--hicache-gb", "0.05")


def run(script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "deploy" / script), *args], env=env, capture_output=True, text=True, timeout=900
    )






def ask(port: int) -> str:
    client = openai_client(f"http://127.0.0.1:{port}", timeout_s=300)
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
    )
    return r.choices[0].message.content or ""


def test_pair_beside_a_single_engine_server(tmp_path):
    env = {**os.environ, "PDSERVE_RUN_DIR": str(tmp_path)}
    env.pop("PDSERVE_CLUSTER_TOKEN", None)
    env.pop("PDSERVE_CLUSTER_TOKEN_FILE", None)
    single, ce, pe, kv = free_port(), free_port(), free_port(), free_port()
    ports = ("--port", str(ce), "--pe-port", str(pe), "--kv-port-base", str(kv))
    pids: list[int] = []
    try:
        r = run("server.sh", "start", "--port", str(single), *FLAGS, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        pids.append(int((tmp_path / f"server-{single}.pid").read_text()))
        r = run("pd_run.sh", "start", "localhost", "localhost", *ports, *FLAGS, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"P/D pair ready: http://127.0.0.1:{ce}/v1" in r.stdout
        token = tmp_path / "cluster.token"
        assert token.stat().st_mode & 0o077 == 0 and len(token.read_text().strip()) >= 16
        ce_pid = int((tmp_path / f"pd-ce-{ce}.pid").read_text())
        pe_pid = int((tmp_path / f"pd-pe-{pe}.pid").read_text())
        pids += [ce_pid, pe_pid]
        status, health = get_json(f"http://127.0.0.1:{ce}/health")
        assert status == 200 and health["role"] == "ce" and health["ranks"][0]["state"] == "up"
        # the rank is in the CE's process group
        assert [p for p, args in group_members(ce_pid).items() if b"pd.rank" in args and p != ce_pid]
        assert ask(ce) and ask(single)

        st = run("pd_run.sh", "status", *ports[:4], env=env)
        assert st.returncode == 0 and "pe running" in st.stdout and "ce running" in st.stdout

        # the PE crashes; start brings it back and leaves the CE alone
        os.killpg(pe_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while group_alive(pe_pid):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        r = run("pd_run.sh", "start", "localhost", "localhost", *ports, *FLAGS, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "ce already running" in r.stdout and "starting the pe" in r.stdout
        assert int((tmp_path / f"pd-ce-{ce}.pid").read_text()) == ce_pid
        new_pe = int((tmp_path / f"pd-pe-{pe}.pid").read_text())
        pids.append(new_pe)
        deadline = time.monotonic() + 60  # the CE's health check sees the new PE
        while get_json(f"http://127.0.0.1:{ce}/health")[1]["prefill_engines"][0]["state"] != "up":
            assert time.monotonic() < deadline
            time.sleep(0.3)
        assert ask(ce)
    finally:
        stopped = run("pd_run.sh", "stop", "localhost", "localhost", env=env)
        run("server.sh", "stop", env=env)
    assert stopped.returncode == 0 and "stopped pd-ce" in stopped.stdout and "stopped pd-pe" in stopped.stdout
    assert "killing" not in stopped.stdout  # each side drained and stopped its ranks within the timeout
    assert not [p for p in pids if group_alive(p)]
    assert not list(tmp_path.glob("*.pid"))
    assert run("pd_run.sh", "status", env=env).returncode == 3
