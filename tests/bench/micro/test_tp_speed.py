"""bench/micro/tp_speed.py's CPU rehearsal (what bench/device/tp_check.sh runs on two GPUs): a real
--tp 2 group over gloo (this run's rank 0 in a subprocess, its follower spawned by it) times decode rows
and writes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_tp2_rows_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "tp2.json"
    proc = subprocess.run(
        [sys.executable, "bench/micro/tp_speed.py", "--tp", "2", "--tiny", "--batches", "1,3", "--device", "cpu",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["tp"], r["batch"], r["status"]) for r in rows] == [(2, 1, "ok"), (2, 3, "ok")]
    assert all(r["tokens_per_s"] > 0 and r["graphs"] is False for r in rows)
    assert "--tp 2 on cpu" in proc.stdout
