"""Which transport NCCL picks between two ranks, its version, and the bandwidth it reaches for
messages of 1 MiB to 1 GiB, next to a raw TCP socket between the same two processes.

Run one rank per host (rank 0 listens on --peer, rank 1 connects to it; same --peer on both):

    host-a$ python bench/nccl_xtray_test.py --rank 0 --peer host-a:29600
    host-b$ python bench/nccl_xtray_test.py --rank 1 --peer host-a:29600

or both ranks on this host (rank 1 is started for you; NCCL needs two GPUs for that):

    python bench/nccl_xtray_test.py --local

Rank 1 sends, rank 0 receives (the PE -> CE direction). Each size is sent --iters times (default:
enough for ~512 MiB, at least 3) after a warm-up; bandwidth is bytes / time at the receiver, from a
TCP sync to the last byte (NCCL: CUDA events on the communicator's stream). NCCL's choice is read
from its own log (NCCL_DEBUG=INFO, written to a temporary file): the "via ..." lines of the
connection it set up (P2P/CUMEM, SHM, NET/IB/.../GDRDMA, NET/Socket, ...) and the network plugin.
Without CUDA (or cupy) on either rank it says so and measures TCP only. The control port binds to
the address in --peer (use the cluster-facing address, not 0.0.0.0, on a shared network).

Two ceilings are measured in the same run, next to the point-to-point figures:
  - torch.distributed's own NCCL all-reduce between the two ranks (gloo without CUDA), as bus
    bandwidth (nccl-tests' busbw: size/time x 2(n-1)/n, which for two ranks is size/time): what NCCL
    reaches on the link with its collective algorithms;
  - with --local and both GPUs visible to rank 0, a device-to-device copy from rank 1's GPU to rank
    0's through PyTorch (cudaMemcpyPeerAsync once peer access is on): the link's raw copy rate.
--json writes everything (versions, NCCL's transport, and each column per size).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = "1M,4M,16M,64M,256M,1G"
_LEN = struct.Struct(">I")


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(s)


def iters_for(size: int, wanted: int | None) -> int:
    return wanted or max(3, min(100, (512 << 20) // size))


# ---- control connection (blocking, msgpack frames) ------------------------------------------------


def send_msg(sock: socket.socket, msg: Any) -> None:
    body = msgpack.packb(msg, use_bin_type=True)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the other rank closed the connection")
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    return msgpack.unpackb(recv_exact(sock, n), raw=False)


def connect(
    rank: int, host: str, port: int, timeout_s: float, listener: socket.socket | None = None
) -> socket.socket:
    if rank == 0:
        with listener or socket.create_server((host, port)) as lst:
            lst.settimeout(timeout_s)
            sock, _ = lst.accept()
    else:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# ---- what each rank has -------------------------------------------------------------------------


def local_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"host": socket.gethostname(), "cuda": False, "nccl": None, "why": ""}
    try:
        import torch
    except ImportError:
        info["why"] = "torch is not installed"
        return info
    if not torch.cuda.is_available():
        info["why"] = "no CUDA device"
        return info
    dev = torch.device(device)
    if (dev.index or 0) >= torch.cuda.device_count():
        info["why"] = f"no device {dev} ({torch.cuda.device_count()} GPU here)"
        return info
    props = torch.cuda.get_device_properties(dev)
    info.update(cuda=True, gpu=props.name, device=str(dev), gpu_uuid=str(getattr(props, "uuid", dev)))
    try:
        from transfer.nccl import CupyNccl

        info["nccl"] = CupyNccl().version()
    except Exception as e:  # HandoffError when cupy is missing
        info["why"] = f"no NCCL through cupy ({e})"
    return info


# ---- measurements -------------------------------------------------------------------------------


def tcp_bandwidth(sock: socket.socket, rank: int, sizes: list[int], iters: int | None) -> list[float]:
    """GB/s per size, measured on rank 0 (the receiver); both ranks return the same list."""
    buf = bytearray(max(sizes))
    view = memoryview(buf)
    out = []
    for size in sizes:
        n = iters_for(size, iters)
        for phase in ("warmup", "timed"):
            count = 1 if phase == "warmup" else n
            if rank == 1:
                recv_exact(sock, 1)  # go
                for _ in range(count):
                    sock.sendall(view[:size])
                recv_exact(sock, 1)  # done
            else:
                t0 = time.perf_counter()
                sock.sendall(b"g")
                for _ in range(count):
                    got = 0
                    while got < size:
                        k = sock.recv_into(view[got:size], size - got, socket.MSG_WAITALL)
                        if k == 0:
                            raise ConnectionError("the sender went away")
                        got += k
                dt = time.perf_counter() - t0
                sock.sendall(b"d")
        if rank == 0:
            out.append(size * n / dt / 1e9)
    if rank == 0:
        send_msg(sock, out)
        return out
    return list(recv_msg(sock))


def nccl_bandwidth(
    sock: socket.socket, rank: int, device: str, sizes: list[int], iters: int | None
) -> list[float]:
    import torch

    from transfer.nccl import CupyNccl

    backend = CupyNccl()
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    if rank == 1:
        uid = backend.unique_id()
        send_msg(sock, uid)
    else:
        uid = recv_msg(sock)
    comm = backend.init(uid, rank, dev)  # NOTE: both ranks must reach this (it blocks until both have)
    buf = torch.empty(max(sizes), dtype=torch.uint8, device=dev)
    peer = 1 - rank
    out = []
    for size in sizes:
        n = iters_for(size, iters)
        t = buf[:size]
        for phase in ("warmup", "timed"):
            count = 1 if phase == "warmup" else n
            _sync(sock, rank)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(comm.stream)
            for _ in range(count):
                (backend.send if rank == 1 else backend.recv)(comm, [t], peer)
            end.record(comm.stream)
            end.synchronize()
        if rank == 0:
            out.append(size * n / (start.elapsed_time(end) / 1e3) / 1e9)
    backend.abort(comm)
    if rank == 0:
        send_msg(sock, out)
        return out
    return list(recv_msg(sock))


def allreduce_busbw(
    sock: socket.socket, rank: int, host: str, device: str | None, sizes: list[int], iters: int | None
) -> list[float]:
    """torch.distributed's all-reduce (float32 sums) between the two ranks, NCCL on device (gloo on
    the CPU when device is None): bus bandwidth in GB/s per size (for two ranks, size / time), timed on
    rank 0 from a barrier to the last all-reduce's end."""
    import torch
    import torch.distributed as dist

    dev = torch.device(device) if device else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if rank == 0:
        store = dist.TCPStore(host, 0, 2, is_master=True, timeout=_timedelta(120), wait_for_workers=False)
        send_msg(sock, store.port)
    else:
        store = dist.TCPStore(host, int(recv_msg(sock)), 2, is_master=False, timeout=_timedelta(120))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=2, device_id=dev if dev.type == "cuda" else None
    )
    try:
        buf = torch.ones(max(sizes) // 4, dtype=torch.float32, device=dev)
        out = []
        for size in sizes:
            n = iters_for(size, iters)
            t = buf[: size // 4]
            dist.all_reduce(t)  # warm-up (and the communicator's lazy setup)
            _settle(dev)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(t)
            _settle(dev)
            out.append(size * n / (time.perf_counter() - t0) / 1e9)  # x 2(n-1)/n = 1 for two ranks
    finally:
        dist.destroy_process_group()
    if rank == 0:
        send_msg(sock, out)
        return out
    return list(recv_msg(sock))


def _settle(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def peer_copy_bandwidth(src: str, dst: str, sizes: list[int], iters: int | None) -> list[float] | None:
    """GB/s (bytes moved one way) of a device-to-device copy from src to dst through PyTorch, which
    uses cudaMemcpyPeerAsync once peer access is on; None unless both devices are visible here."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    a, b = torch.device(src), torch.device(dst)
    x = torch.empty(max(sizes), dtype=torch.uint8, device=a)
    y = torch.empty(max(sizes), dtype=torch.uint8, device=b)
    out = []
    for size in sizes:
        n = iters_for(size, iters)
        y[:size].copy_(x[:size])  # warm-up (peer access is enabled on the first copy)
        torch.cuda.synchronize(a)
        torch.cuda.synchronize(b)
        t0 = time.perf_counter()
        for _ in range(n):
            y[:size].copy_(x[:size], non_blocking=True)
        torch.cuda.synchronize(a)
        torch.cuda.synchronize(b)
        out.append(size * n / (time.perf_counter() - t0) / 1e9)
    return out


def _sync(sock: socket.socket, rank: int) -> None:
    if rank == 0:
        sock.sendall(b"s")
        recv_exact(sock, 1)
    else:
        recv_exact(sock, 1)
        sock.sendall(b"s")


def nccl_choice(log_dir: str) -> tuple[list[str], list[str]]:
    """(the 'via ...' transports, the network plugins) that NCCL logged in this process."""
    via, nets = set(), set()
    for f in glob.glob(os.path.join(log_dir, "nccl.*.log")):
        text = Path(f).read_text(errors="replace")
        via.update(re.findall(r"->\s*\d+\[[0-9a-fA-Fx]+\].*?\bvia\s+(\S+)", text))
        nets.update(re.findall(r"Using network (\S+)", text))
    return sorted(via), sorted(nets)


# ---- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, choices=(0, 1), help="0 listens (receives), 1 connects (sends)")
    ap.add_argument("--peer", default="127.0.0.1:29600", help="rank 0's host:port (the same on both ranks)")
    ap.add_argument("--local", action="store_true", help="run both ranks on this host (starts rank 1)")
    ap.add_argument(
        "--device", default=None, help="CUDA device of this rank (default cuda:0; --local rank 1: cuda:1)"
    )
    ap.add_argument("--sizes", default=SIZES, help=f"message sizes (default {SIZES})")
    ap.add_argument(
        "--iters", type=int, default=None, help="messages per size (default: ~512 MiB, at least 3)"
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the other rank")
    ap.add_argument("--json", type=Path, default=None, help="rank 0: also write every figure here")
    ap.add_argument(
        "--quiet", action="store_true", help=argparse.SUPPRESS
    )  # rank 1 of --local: rank 0 prints
    args = ap.parse_args(argv)
    host, _, port_s = args.peer.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.local:
        listener = socket.create_server((host, int(port_s)))  # bound first: the child needs the port
        port = listener.getsockname()[1]
        cmd = [
            sys.executable,
            __file__,
            "--rank",
            "1",
            "--peer",
            f"{host}:{port}",
            "--device",
            "cuda:1",
            "--sizes",
            args.sizes,
        ]
        child = subprocess.Popen(cmd + (["--iters", str(args.iters)] if args.iters else []) + ["--quiet"])
        try:
            return run(
                0, host, port, args.device or "cuda:0", sizes, args.iters, args.timeout, False, listener,
                json_path=args.json, peer_from="cuda:1",
            )  # fmt: skip
        finally:
            child.wait(timeout=60)
    if args.rank is None:
        ap.error("give --rank 0|1 (one per host) or --local")
    return run(
        args.rank,
        host,
        int(port_s),
        args.device or "cuda:0",
        sizes,
        args.iters,
        args.timeout,
        quiet=args.quiet,
        json_path=args.json,
    )


def run(
    rank: int,
    host: str,
    port: int,
    device: str,
    sizes: list[int],
    iters: int | None,
    timeout_s: float,
    quiet: bool,
    listener: socket.socket | None = None,
    json_path: Path | None = None,
    peer_from: str | None = None,
) -> int:
    """peer_from: also time copies from that device to this rank's (both ranks on this host)."""
    log_dir = tempfile.mkdtemp(prefix="nccl-xtray-")
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,P2P,NET")
    os.environ.setdefault("NCCL_DEBUG_FILE", os.path.join(log_dir, "nccl.%h.%p.log"))
    mine = local_info(device)
    sock = connect(rank, host, port, timeout_s, listener)
    with sock:
        send_msg(sock, mine)
        theirs = recv_msg(sock)
        infos = {rank: mine, 1 - rank: theirs}
        same_gpu = infos[0]["host"] == infos[1]["host"] and infos[0].get("gpu_uuid", 0) == infos[1].get(
            "gpu_uuid", 1
        )
        use_nccl = all(i["cuda"] and i["nccl"] for i in infos.values()) and not same_gpu
        tcp = tcp_bandwidth(sock, rank, sizes, iters)
        nccl = nccl_bandwidth(sock, rank, device, sizes, iters) if use_nccl else None
        allreduce = allreduce_busbw(sock, rank, host, device if use_nccl else None, sizes, iters)
    peer = peer_copy_bandwidth(peer_from, device, sizes, iters) if use_nccl and peer_from else None
    if quiet:
        return 0
    via, nets = nccl_choice(log_dir) if nccl is not None else ([], [])
    print(f"rank 0: {_describe(infos[0])}")
    print(f"rank 1: {_describe(infos[1])}")
    if nccl is None:
        why = "; ".join(
            f"rank {r}: {i['why'] or 'the same GPU as the other rank'}" for r, i in sorted(infos.items())
        )
        print(f"NCCL not measured ({why}): TCP only")
    else:
        print(
            f"NCCL {infos[rank]['nccl']}: transport {', '.join(via) or '(not logged)'}; network {', '.join(nets) or '-'}"
        )
    print(
        f"\n{'size':>8} {'iters':>6} {'tcp GB/s':>9} {'nccl p2p GB/s':>14} {'all-reduce busbw':>17} "
        f"{'peer copy GB/s':>15}"
    )
    for i, size in enumerate(sizes):
        cols = [f"{c[i]:.2f}" if c else "-" for c in (nccl, allreduce, peer)]
        print(f"{_fmt(size):>8} {iters_for(size, iters):>6} {tcp[i]:>9.2f} {cols[0]:>14} {cols[1]:>17} {cols[2]:>15}")
    if json_path is not None:
        doc = {
            "ranks": infos, "nccl_version": infos[rank]["nccl"], "transport": via, "network": nets,
            "sizes": sizes, "iters": [iters_for(n, iters) for n in sizes], "tcp_gbps": tcp,
            "nccl_p2p_gbps": nccl, "allreduce_backend": "nccl" if use_nccl else "gloo",
            "allreduce_busbw_gbps": allreduce, "peer_copy_gbps": peer,
        }  # fmt: skip
        json_path.write_text(json.dumps(doc, indent=2, default=str))
    return 0


def _describe(info: dict[str, Any]) -> str:
    if not info["cuda"]:
        return f"{info['host']}, no CUDA ({info['why']})"
    return f"{info['host']}, {info['gpu']} ({info['device']}), NCCL {info['nccl'] or 'unavailable'}"


def _fmt(size: int) -> str:
    return f"{size >> 30} GiB" if size >= 1 << 30 else f"{size >> 20} MiB"


if __name__ == "__main__":
    sys.exit(main())
