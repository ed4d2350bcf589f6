"""A real server in a child process, for tests and benchmarks: a free port, its own process group,
waits for /health, and ends the whole group (engine ranks included) on exit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def signed_headers(token: str | bytes, body: bytes) -> dict[str, str]:
    """Headers of a /prefill signed with the cluster token (pd/disagg/prefill_auth.py), as a CE sends them."""
    from pd.disagg.prefill_auth import sign

    key = token.encode() if isinstance(token, str) else token
    return {"Authorization": sign(key, "POST", "/prefill", body), "Content-Type": "application/json"}


def get_json(url: str, timeout_s: float = 10.0, context: ssl.SSLContext | None = None) -> tuple[int, Any]:
    """(status, parsed body) of a GET, error statuses included (`context`: how an https URL is verified)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class ServerProcess:
    # every log file a server of this process wrote to (tests/conftest.py reads them after each test)
    log_paths: ClassVar[set[Path]] = set()

    def __init__(
        self,
        *args: str,
        log_path: Path | None = None,
        ready_timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
        port: int | None = None,
        ssl_ca: str | None = None,
        command: Sequence[str] = (sys.executable, "-m", "pd.server"),
        host: str = "127.0.0.1",
    ) -> None:
        """ssl_ca: the server serves https (its --ssl-certfile is in args), verified with this CA file;
        command: what runs, before --port and args (`pdserve serve MODEL`); host: another loopback
        address stands for another host (passed as --host)."""
        self.command = list(command)
        self.host = host
        self.port = port or free_port()
        self.args = ["--port", str(self.port), *(["--host", host] if host != "127.0.0.1" else []), *args]
        self.ssl_context = ssl.create_default_context(cafile=ssl_ca) if ssl_ca else None
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rank_pids(self) -> dict[int, int]:
        """The live engine rank processes of this server: rank -> pid (/health shows no pids)."""
        return rank_pids(self.pid)

    def __enter__(self) -> ServerProcess:
        return self.start().wait_ready()

    def start(self) -> ServerProcess:
        """Starts the process without waiting (start several, then wait_ready each: they load at once)."""
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        if self.log_path:
            ServerProcess.log_paths.add(Path(self.log_path))
        self.proc = subprocess.Popen(
            [*self.command, *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
        )
        return self

    def wait_ready(self) -> ServerProcess:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                status, body = get_json(self.url + "/health", 2.0, self.ssl_context)
                # 200 comes with the first rank up: wait for every rank (routing sees them all)
                if status == 200 and all(r.get("state") != "starting" for r in body.get("ranks", [])):
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

    def terminate(self) -> None:
        """SIGTERM to the whole group without waiting (stop several at once: terminate each, then stop)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None:
            return
        self.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # ranks included, whatever state they are in
        self.proc.wait()
        self.proc = None


def group_members(pgid: int) -> dict[int, list[bytes]]:
    """The live (not zombie) processes of a process group: pid -> command line."""
    members: dict[int, list[bytes]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    members[int(d.name)] = (d / "cmdline").read_bytes().split(b"\0")
    return members


def group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def rank_pids(server_pid: int) -> dict[int, int]:
    """The engine ranks (`python -m pd.rank.worker --rank N`) that are children of server_pid: rank -> pid."""
    out: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if ppid == server_pid and b"pd.rank.worker" in argv:
                out[int(argv[argv.index(b"--rank") + 1])] = int(d.name)
    return out


class PDPair:
    """A P/D pair for tests: a PE and a CE (`--role pe|ce`) on free loopback ports, sharing a fresh
    cluster token (in their environment), `args` to both. url is the CE's (the OpenAI endpoint)."""

    def __init__(
        self,
        *args: str,
        log_dir: Path | None = None,
        pe_args: tuple[str, ...] = (),
        ce_args: tuple[str, ...] = (),
        token: str = "pd-test-cluster-token-0123456789",
        ready_timeout_s: float = 600.0,
    ) -> None:
        self.token = token
        self.env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": token}
        self.env.pop("PDSERVE_CLUSTER_TOKEN_FILE", None)
        self.kv_port = free_port()
        self.args, self.pe_args = args, pe_args
        self.log_dir = log_dir
        self.ready_timeout_s = ready_timeout_s
        self.pe = self._pe(None)
        self.ce = ServerProcess(
            "--role",
            "ce",
            *args,
            *ce_args,
            "--prefill-url",
            self.pe.url,
            "--kv-port-base",
            str(self.kv_port),
            log_path=log_dir / "ce.log" if log_dir else None,
            ready_timeout_s=ready_timeout_s,
            env=self.env,
        )

    def _pe(self, port: int | None) -> ServerProcess:
        return ServerProcess(
            "--role",
            "pe",
            *self.args,
            *self.pe_args,
            log_path=self.log_dir / "pe.log" if self.log_dir else None,
            ready_timeout_s=self.ready_timeout_s,
            env=self.env,
            port=port,
        )

    @property
    def url(self) -> str:
        return self.ce.url

    def start(self) -> PDPair:
        self.pe.start()
        self.ce.start()
        return self

    def wait_ready(self) -> PDPair:
        self.pe.wait_ready()
        self.ce.wait_ready()
        self.wait_pe_seen()
        return self

    def wait_pe_seen(self, timeout_s: float = 30.0) -> None:
        """Waits until the CE's health check sees the PE up."""
        deadline = time.monotonic() + timeout_s
        while not all(p["state"] == "up" for p in get_json(self.ce.url + "/health")[1].get("prefill_engines") or [{}]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the CE does not see the PE after {timeout_s} s")
            time.sleep(0.2)

    def restart_pe(self) -> None:
        """A new PE on the same port (after a kill), ready and seen by the CE."""
        self.pe.stop()
        self.pe = self._pe(self.pe.port)
        self.pe.start().wait_ready()
        self.wait_pe_seen()

    def __enter__(self) -> PDPair:
        try:
            return self.start().wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def terminate(self) -> None:
        self.ce.terminate()
        self.pe.terminate()

    def stop(self) -> None:
        self.terminate()
        self.ce.stop()
        self.pe.stop()


def rank_metrics(port: int, rank: int = 0, host: str = "127.0.0.1") -> dict[str, float]:
    """One rank's samples from /metrics, other labels summed away: name -> value."""
    import re

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    pattern = rf'^(\w+)\{{(?:[^}}]*,)?rank="{rank}"(?:,[^}}]*)?\}} (\S+)$'
    for m in re.finditer(pattern, text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


_PD_BUSY_GAUGES = (
    "pdserve_engine_num_reservations_waiting",
    "pdserve_engine_num_reservations_held",
    "pdserve_engine_num_committed_blocks",
    "pdserve_engine_num_handoffs_inflight",
)


def wait_idle(port: int, rank: int = 0, timeout_s: float = 20.0, host: str = "127.0.0.1") -> dict[str, float]:
    """Waits until the rank runs nothing and its KV pool is all free; returns its metrics then."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = rank_metrics(port, rank, host)
        idle = m.get("pdserve_num_requests_running") == 0 and m.get("pdserve_num_requests_waiting") == 0
        free = m.get("pdserve_kv_free_blocks") == m.get("pdserve_kv_total_blocks")
        # P/D ranks: no reservation held or waiting, nothing committed, no handoff in flight
        pd_busy = [k for k in _PD_BUSY_GAUGES if m.get(k, 0.0) != 0.0]
        if idle and free and not pd_busy and m.get("pdserve_num_requests_inflight") == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"rank {rank} not idle after {timeout_s} s: {m}")
        time.sleep(0.2)
