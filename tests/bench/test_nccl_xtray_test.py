"""bench/nccl_xtray_test.py's pieces that run anywhere: NCCL log parsing, the TCP measurement, a local run."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

from bench import nccl_xtray_test as xtray


def test_nccl_log_parsing(tmp_path: Path) -> None:
    (tmp_path / "nccl.a.1.log").write_text(
        "h:1:2 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0\n"
        "h:1:2 [0] NCCL INFO Using network IB\n"
        "h:1:2 [0] NCCL INFO Channel 00/1 : 1[1] -> 0[0] [receive] via NET/IB/0/GDRDMA\n"
        "h:1:2 [0] NCCL INFO Channel 01/1 : 1[1b000] -> 0[3d000] [receive] via NET/IB/0/GDRDMA\n"
        "h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
    )
    assert xtray.nccl_choice(str(tmp_path)) == (["NET/IB/0/GDRDMA", "P2P/CUMEM/read"], ["IB"])
    assert (
        xtray.parse_size("1G") == 1 << 30
        and xtray.parse_size("4MiB") == 4 << 20
        and xtray.parse_size("512") == 512
    )


def test_tcp_bandwidth_between_two_ranks() -> None:
    a, b = socket.socketpair()
    sizes, out = [1 << 16, 1 << 20], {}
    t = threading.Thread(target=lambda: out.update(r1=xtray.tcp_bandwidth(b, 1, sizes, 3)))
    t.start()
    out["r0"] = xtray.tcp_bandwidth(a, 0, sizes, 3)
    t.join(10)
    assert out["r0"] == out["r1"] and len(out["r0"]) == 2 and all(x > 0 for x in out["r0"])




def test_xtray_local_run_writes_its_figures(tmp_path: Path) -> None:
    """Both ranks as two processes on this host: TCP, and the all-reduce ceiling through
    torch.distributed (gloo without CUDA; NCCL and the peer copy need two GPUs, and say so)."""
    import json
    import subprocess

    out = tmp_path / "xtray.json"
    script = Path(__file__).resolve().parents[2] / "bench" / "nccl_xtray_test.py"
    cmd = [sys.executable, str(script), "--local", "--peer", "127.0.0.1:0", "--sizes", "64K,1M"]
    done = subprocess.run(cmd + ["--iters", "3", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["sizes"] == [64 << 10, 1 << 20]
    assert len(doc["tcp_gbps"]) == 2 and all(x > 0 for x in doc["tcp_gbps"])
    assert len(doc["allreduce_busbw_gbps"]) == 2 and all(x > 0 for x in doc["allreduce_busbw_gbps"])
    if doc["nccl_p2p_gbps"] is None:  # no two GPUs here
        assert doc["allreduce_backend"] == "gloo" and "NCCL not measured" in done.stdout
    assert "all-reduce busbw" in done.stdout
