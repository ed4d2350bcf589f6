"""--log-format json in a process of its own: every line on stderr is one JSON object, a logged line, a
Python warning and an exception nothing caught alike (the live server's lines: tests/pd/frontend/test_server_metrics.py)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import logging, warnings
from pd.http.request_log import REQUEST_ID, install
install("info", "json")
logging.getLogger("pd.test").info("plain %d", 1)
REQUEST_ID.set("req-7")
logging.getLogger("pd.test").warning("within a request")
warnings.warn("careful")
raise RuntimeError("boom")
"""


def test_every_line_is_json() -> None:
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    records = [json.loads(line) for line in p.stderr.splitlines()]
    assert [(r["level"], r["logger"]) for r in records] == [
        ("info", "pd.test"), ("warning", "pd.test"), ("warning", "py.warnings"), ("critical", "pd.http.request_log"),
    ]  # fmt: skip
    assert records[0]["message"] == "plain 1" and "request_id" not in records[0]
    assert records[1]["request_id"] == "req-7"
    assert "careful" in records[2]["message"]
    assert "RuntimeError: boom" in records[3]["exception"]
    assert all(r["time"].endswith("+00:00") for r in records)
