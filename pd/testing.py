"""A real server in a child process, for tests and benchmarks: a free port, its own process group,
waits for /health, and ends the whole group (engine ranks included) on exit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout_s: float = 10.0) -> tuple[int, Any]:
    """(status, parsed body) of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class ServerProcess:
    def __init__(self, *args: str, log_path: Path | None = None, ready_timeout_s: float = 600.0) -> None:
        self.port = free_port()
        self.args = ["--port", str(self.port), *args]
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd.server", *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                if get_json(self.url + "/health", 2.0)[0] == 200:
                    return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not ready in {self.ready_timeout_s} s: {self.log_tail()}")

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def log_tail(self, num_chars: int = 4000) -> str:
        return (
            self.log_path.read_text(errors="replace")[-num_chars:]
            if self.log_path and self.log_path.exists()
            else ""
        )

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # ranks included, whatever state they are in
        self.proc.wait()
        self.proc = None


def rank_metrics(port: int, rank: int = 0) -> dict[str, float]:
    """One rank's samples from /metrics, other labels summed away: name -> value."""
    import re

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    pattern = rf'^(\w+)\{{(?:[^}}]*,)?rank="{rank}"(?:,[^}}]*)?\}} (\S+)$'
    for m in re.finditer(pattern, text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def wait_idle(port: int, rank: int = 0, timeout_s: float = 20.0) -> dict[str, float]:
    """Waits until the rank runs nothing and its KV pool is all free; returns its metrics then."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = rank_metrics(port, rank)
        idle = m.get("pdserve_num_requests_running") == 0 and m.get("pdserve_num_requests_waiting") == 0
        free = m.get("pdserve_kv_free_blocks") == m.get("pdserve_kv_total_blocks")
        if idle and free and m.get("pdserve_num_requests_inflight") == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"rank {rank} not idle after {timeout_s} s: {m}")
        time.sleep(0.2)
