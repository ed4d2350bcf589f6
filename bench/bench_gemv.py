"""Small-batch matrix products (decode's weights) on the GPU: cuBLAS through F.linear against a Triton
GEMV, per weight shape of an 8B-shaped model, against the device-copy ceiling measured in the same run.

Each shape is timed over 32 distinct weights (more than the L2 holds) in one CUDA graph, so the time
is the weights' trip through HBM, as in a decode step. Prints a table; --out writes JSON.

    python bench/bench_gemv.py --batches 1,8 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x_ptr, w_ptr, y_ptr, N, K, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk0 = tl.arange(0, BLOCK_K)
        for m in tl.static_range(M):
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + rk0
                w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=rn[:, None] < N)
                x = tl.load(x_ptr + m * K + rk)
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            tl.store(y_ptr + m * N + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rn < N)

    return gemv


def graph_ms(fn: Any, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def copy_ceiling_gbps() -> float:
    src = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    return 2 * src.numel() * 2 / (graph_ms(copy) / 1e3) / 1e9


CONFIGS = ((8, 512, 4), (16, 256, 4), (16, 512, 4), (32, 256, 4), (4, 1024, 4), (8, 1024, 8))


def time_shape(name: str, ws: list[torch.Tensor], m: int, copy_gbps: float) -> list[dict[str, Any]]:
    """cuBLAS and each Triton configuration over the 32 weights ws at batch m."""
    n, k = ws[0].shape
    nbytes = len(ws) * n * k * 2
    gemv = _kernel()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[-1])  # triton_run leaves the last weight's product in y

    def row(impl: str, ms: float, **kw: Any) -> dict[str, Any]:
        return {"shape": name, "n": n, "k": k, "m": m, "impl": impl, "us": ms * 1e3 / len(ws),
                "frac": nbytes / (ms / 1e3) / 1e9 / copy_gbps, **kw}  # fmt: skip

    def cublas() -> None:
        for w in ws:
            F.linear(x, w)

    rows = [row("cublas", graph_ms(cublas))]
    for bn, bk, nw in CONFIGS:
        if k % bk:
            continue

        def triton_run(bn: int = bn, bk: int = bk, nw: int = nw) -> None:
            for w in ws:
                gemv[(-(-n // bn),)](x, w, y, n, k, M=m, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)

        triton_run()
        err = ((y[:1].float() - ref[:1].float()).norm() / ref[:1].float().norm()).item()
        rows.append(row(f"triton {bn}x{bk} w{nw}", graph_ms(triton_run), err=err))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemv: needs CUDA")
        return 0
    copy_gbps = copy_ceiling_gbps()
    print(f"copy ceiling {copy_gbps:,.0f} GB/s (read + write)")
    rows = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(32)]
        for m in [int(b) for b in args.batches.split(",")]:
            rows += time_shape(name, ws, m, copy_gbps)
        del ws
        torch.cuda.empty_cache()
    print(f"{'shape':<8} {'m':>3} {'impl':<22} {'us':>8} {'of copy':>8} {'rel err':>9}")
    for r in rows:
        print(
            f"{r['shape']:<8} {r['m']:>3} {r['impl']:<22} {r['us']:8.1f} {r['frac']:8.1%} {r.get('err', 0):9.1e}"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_gemv.json").write_text(
            json.dumps({"copy_GBps": copy_gbps, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
