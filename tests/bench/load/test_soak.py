"""bench/load/soak.py against a real single-engine server for a few seconds: its one rank is killed and
restarted mid-run, and the soak must end clean (nothing good lost, bad requests answered 4xx, pool idle)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pd.tools.server_process import ServerProcess

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]


def test_soak_survives_a_rank_kill(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    out = tmp_path / "soak.json"
    args = ("--model", "smollm2-135m-instruct", "--max-model-len", "1024", "--kv-cache-gb", "0.1")
    with ServerProcess(*args, log_path=tmp_path / "server.log") as server:
        (run_dir / f"server-{server.port}.pid").write_text(f"{server.pid}\n")
        soak = subprocess.run(
            [sys.executable, "-m", "bench.load.soak", "--url", server.url, "--minutes", "0.2"]
            + ["--run-dir", str(run_dir), "--kill-every-s", "6", "--force", "--out", str(out)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
        )
        print(soak.stdout, soak.stderr)
        assert soak.returncode == 0, soak.stdout + soak.stderr + server.log_tail()
    doc = json.loads(out.read_text())
    requests = doc["requests"]
    assert len(doc["kills"]) >= 1 and doc["restarts_seen"] == {f"server-{server.port}": len(doc["kills"])}
    assert requests["good_ok"] > 0 and requests["good_lost"] == 0 and doc["served_after_kills"]
    assert requests["bad_request_4xx"] > 0 and requests["bad_request_not_4xx"] == 0
    assert doc["pools_idle"] == {f"server-{server.port} rank 0": True} and doc["ok"]
