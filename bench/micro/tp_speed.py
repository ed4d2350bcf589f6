"""Decode speed of one engine at `--tp N`: this process is the group's first rank (it schedules, samples
and times the steps), ranks 1..N-1 are spawned processes that follow it (engine/parallel/tensor_parallel.py), each
on its own GPU (cuda:K, as pd/rank/worker.py places them) with NCCL, or on the CPU with gloo. Dummy
weights of a bench/configs/ shape; decode steps timed as bench/micro/engine_speed.py times them (prompts
admitted as prefilled, median step). `--tp 1` runs the same rows with no group at all, so
bench/device/tp_check.sh compares the two in one call (the issue's bar: --tp 2 batch-1 decode at least
1.6x the tokens/s of --tp 1).

    python bench/micro/tp_speed.py --tp 2 [--model llama8b] [--batches 1,64] [--context 1024] [--tiny]

Prints one line per row and writes them as JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.micro.engine_speed import engine_decode, model_folder, parse_ints
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.parallel.tensor_parallel import PLAN_STEP, PLAN_STOP, close_group, init_group


def device_of(kind: str, rank: int) -> str:
    return f"cuda:{rank}" if kind == "cuda" else "cpu"


def engine_config(args: argparse.Namespace, folder: Path, rank: int) -> dict[str, Any]:
    return dict(
        model=str(folder), device=device_of(args.device, rank), load_format="dummy", max_num_seqs=max(parse_ints(args.batches)),
        max_num_batched_tokens=args.chunk, block_size=args.block_size, max_model_len=args.context + args.steps + 64,
        kv_cache_gb=args.kv_gb, hicache_gb=0.0, seed=args.seed, enforce_eager=args.enforce_eager,
    )  # fmt: skip


def follower(rank: int, size: int, address: str, kind: str) -> None:
    """Ranks 1..N-1: build each engine the first rank announces and follow it until it says stop."""
    if kind == "cpu":
        torch.set_num_threads(1)
    tp = init_group(rank, size, address, torch.device(device_of(kind, rank)))
    try:
        while True:
            plan, config = tp.receive_plan()
            if plan == PLAN_STOP:
                return
            config["device"] = device_of(kind, rank)
            LLMEngine(EngineConfig(**config), tp).follow()
    finally:
        close_group()


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--model", default="llama8b", help="a name in bench/configs/")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--kv-gb", type=float, default=8.0, help="each rank's KV pool")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs at --tp 1 either (--tp N has none yet)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--row-cap-s", type=float, default=30.0)
    p.add_argument("--tiny", action="store_true", help="toy dims (engine_speed's), a CPU rehearsal over gloo")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.kv_fill = "skip"
    if args.tiny:
        args.context, args.steps, args.chunk, args.block_size, args.kv_gb = 64, 4, 256, 16, 0.05
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        p.error(f"--tp {args.tp} needs {args.tp} GPUs, this machine has {torch.cuda.device_count()}")
    rows: list[dict[str, Any]] = []
    procs: list[Any] = []
    tp = None
    with tempfile.TemporaryDirectory(prefix="tp-speed-") as scratch:
        folder = model_folder(args.model, args, Path(scratch))
        try:
            if args.tp > 1:
                address = free_address()
                ctx = mp.get_context("spawn")
                procs = [ctx.Process(target=follower, args=(r, args.tp, address, args.device), daemon=True)
                         for r in range(1, args.tp)]  # fmt: skip
                for proc in procs:
                    proc.start()
                tp = init_group(0, args.tp, address, torch.device(device_of(args.device, 0)))
                tp.send_plan(PLAN_STEP, engine_config(args, folder, 0))
            t0 = time.monotonic()
            eng = LLMEngine(EngineConfig(**engine_config(args, folder, 0)), tp)
            print(f"# {args.model} --tp {args.tp} on {args.device}: engine up in {time.monotonic() - t0:.1f} s, "
                  f"CUDA graphs {'on' if eng.graph_stats is not None else 'off'}", flush=True)
            for batch in parse_ints(args.batches):
                row = {"model": args.model, "tp": args.tp, "batch": batch, "context": args.context,
                       "graphs": eng.graph_stats is not None, **engine_decode(eng, batch, args.context, args)}
                if row.get("status") == "ok":
                    row["tokens_per_s"] = batch / row["step_s"]
                    print(f"tp {args.tp} decode b={batch} ctx={args.context}: {row['step_s'] * 1e3:.2f} ms/step, "
                          f"{row['tokens_per_s']:,.1f} tok/s", flush=True)
                else:
                    print(f"tp {args.tp} decode b={batch}: {row.get('status')}", flush=True)
                rows.append(row)
            eng.close()
        finally:
            if tp is not None:
                tp.send_plan(PLAN_STOP)
                for proc in procs:
                    proc.join(timeout=60)
                close_group()
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0 if rows and all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
