"""The tcp handoff striped over N sockets (--kv-tcp-streams N) against N raw sockets, in the same run.

One export of --tokens tokens of the layout of bench/configs/<layout>.json (bf16, 128-token pages; 2048
tokens of llama8b: 256 MiB) is handed off to a KVReceiver in a second process by a KVSender with
tcp_streams N, for each N of --streams. The ceiling beside each row: the same bytes pushed through N
plain sockets at once (one thread each, contiguous shares as the handoff cuts them) to the same
process, which recv_into()s them into reused buffers (no framing, no checksum, no auth). Reported:
milliseconds and GB/s of the whole send (the sender's checksum where the export has none, as on the
CPU; offer, payload, the receiver's checksum on the way in, ack) and its share of the ceiling, the
send without the sender's checksum (`transfer`: offer to ack, what N changes) and its share, and the
raw N sockets' (bar on real hosts: >= 80%). The sender keeps its connections (a PE does): the first send of each N opens them and
is not timed; the best of --repeats after it is reported, as is the raw ceiling's.

    python bench/micro/tcp_streams.py                                 # 256 MiB, N = 1, 2, 4, 8
    python bench/micro/tcp_streams.py --tokens 16384 --device cuda    # 2 GiB from and to GPU memory
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.micro.handoff import TOKEN, first_answer, layout_of, reused_payload, synthetic_export  # noqa: E402
from engine.handoff import KVLayout  # noqa: E402
from transfer.config import TransferConfig  # noqa: E402
from transfer.header import payload_segments  # noqa: E402
from transfer.receiver import KVReceiver  # noqa: E402
from transfer.sender import KVSender  # noqa: E402
from transfer.tcp import byte_view  # noqa: E402

GB = 1e9
_HEAD = struct.Struct(">QQ")  # the raw sockets' preamble: the connection's index, its byte count


def _raw_sinks(lst: socket.socket) -> None:
    """One thread per connection: `index, length`, then the bytes into that index's reused buffer;
    answers one byte."""
    buffers: dict[int, bytearray] = {}
    lock = threading.Lock()

    def serve(conn: socket.socket) -> None:
        with conn:
            index, n = _HEAD.unpack(conn.recv(_HEAD.size, socket.MSG_WAITALL))
            with lock:
                if len(buffers.get(index, b"")) < n:
                    buffers[index] = bytearray(n)
                buf = buffers[index]
            view, got = memoryview(buf), 0
            while got < n:
                k = conn.recv_into(view[got:n], n - got, socket.MSG_WAITALL)
                if k == 0:
                    break
                got += k
            conn.sendall(b"k")

    while True:
        conn, _ = lst.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def receiver_main(conn: Any, layout: dict[str, Any], device: str, token: bytes) -> None:
    lst = socket.create_server(("127.0.0.1", 0), backlog=64)
    threading.Thread(target=_raw_sinks, args=(lst,), daemon=True).start()
    on_handoff = reused_payload(device)

    async def main() -> None:
        cfg = TransferConfig(idle_timeout_s=120.0)
        async with KVReceiver(token, KVLayout.from_fields(layout), on_handoff, lambda h, e: None, config=cfg) as r:
            conn.send((r.port, lst.getsockname()[1]))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop

    asyncio.run(main())


def raw_send(port: int, payload: torch.Tensor, n: int) -> float:
    """Seconds to push payload's bytes through n plain sockets at once (contiguous shares), to the
    last one's answer; connecting is not timed."""
    total = payload.numel()
    bounds = [k * total // n for k in range(n + 1)]
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    go = threading.Barrier(n + 1)

    def push(k: int) -> None:
        s, share = socks[k], payload[bounds[k] : bounds[k + 1]]
        go.wait()
        s.sendall(_HEAD.pack(k, share.numel()))
        s.sendall(share.numpy().data)
        s.recv(1)

    threads = [threading.Thread(target=push, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for s in socks:
        s.close()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="llama8b", help="a config in bench/configs")
    ap.add_argument("--tokens", type=int, default=2048, help="the sequence's length (2048 of llama8b: 256 MiB)")
    ap.add_argument("--streams", default="1,2,4,8", help="comma-separated N of --kv-tcp-streams")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu | cuda: where both ends keep the payload")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    layout = layout_of(args.layout)
    exp = synthetic_export(layout, args.tokens, torch.device(args.device))
    segments = payload_segments(exp, layout)
    nbytes = sum(byte_view(t).numel() for t in segments)
    flat = torch.cat([byte_view(t).cpu() for t in segments])  # the raw sockets' bytes, in host memory
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, layout.fields(), args.device, TOKEN), daemon=True)
    proc.start()
    rows = []
    try:
        kv_port, raw_port = first_answer(parent, proc, 120)
        addr = f"127.0.0.1:{kv_port}"
        for n in [int(x) for x in args.streams.split(",")]:
            sender = KVSender(TOKEN, layout, config=TransferConfig(tcp_streams=n, idle_timeout_s=120.0))
            try:

                async def sends(sender: KVSender = sender) -> list[Any]:
                    await sender.send(addr, exp)  # opens the connections; warms both ends' buffers
                    return [await sender.send(addr, exp) for _ in range(args.repeats)]

                acks = asyncio.run(sends())
            finally:
                sender.close()
            ack = min(acks, key=lambda a: a.elapsed_s)
            moved = min(acks, key=lambda a: a.elapsed_s - a.checksum_s)
            transfer_s = moved.elapsed_s - moved.checksum_s
            raw_send(raw_port, flat, n)  # warm-up: the sink's buffers
            raw_s = min(raw_send(raw_port, flat, n) for _ in range(args.repeats))
            rows.append(
                {
                    "streams": n,
                    "bytes": nbytes,
                    "handoff_ms": ack.elapsed_s * 1e3,
                    "handoff_gbps": nbytes / ack.elapsed_s / GB,
                    "recv_ms": ack.recv_s * 1e3,
                    "transfer_ms": transfer_s * 1e3,
                    "transfer_of_raw": raw_s / transfer_s,
                    "raw_ms": raw_s * 1e3,
                    "raw_gbps": nbytes / raw_s / GB,
                    "of_raw": raw_s / ack.elapsed_s,
                    "sender_phases_ms": {k: v * 1e3 for k, v in ack.phases.items()},
                    "receiver_phases_ms": {k: v * 1e3 for k, v in ack.receiver_phases.items()},
                    "verify_ms": ack.verify_s * 1e3,
                }
            )
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    print(f"tcp handoff of {nbytes / 2**20:.0f} MiB ({args.layout}, {args.tokens} tokens, {args.device}) vs N raw sockets")
    print(f"{'N':>3} {'handoff ms':>11} {'GB/s':>6} {'of raw':>7} {'transfer ms':>12} {'of raw':>7} {'raw N ms':>9} {'GB/s':>6}")
    for r in rows:
        print(
            f"{r['streams']:>3} {r['handoff_ms']:>11.1f} {r['handoff_gbps']:>6.2f} {r['of_raw']:>7.0%}"
            f" {r['transfer_ms']:>12.1f} {r['transfer_of_raw']:>7.0%} {r['raw_ms']:>9.1f} {r['raw_gbps']:>6.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "argv": sys.argv[1:]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
