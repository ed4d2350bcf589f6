"""Small-batch matrix products (decode's weights) on the GPU: cuBLAS through F.linear against the Triton
GEMV of pdkernels/gemv.py, per weight shape of an 8B-shaped model, against the device-copy ceiling
measured in the same run.

Each shape is timed over 32 distinct weights (more than the L2 holds) in one CUDA graph, so the time
is the weights' trip through HBM, as in a decode step. Per shape and batch: cuBLAS; gemv with its
default configuration (gemv_config), a sweep over a few other tiles, with programmatic dependent launch
(pdl), and with pdl plus an L2 prefetch of each program's first two weight tiles. For the down
projection also the fused activation, gemv(gate_up, w, act="silu") over [m, 2 * 14336], against
fused_ops.silu_mul followed by cuBLAS. --naive adds the first experiment's kernel (each row of x
reads the weights again) at its tiles. --quick: cuBLAS, the default configuration (with and without
the fused activation) and the pdl variants only. Prints a table; --out writes JSON.

    python bench/micro/gemv.py --batches 1,8 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.micro.engine_speed import copy_bytes_per_s, graph_ms  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# gemv tiles swept besides the default: (BLOCK_N, BLOCK_K, warps), bf16; BLOCK_K = 256 * warps keeps one
# 16-byte run per thread and weight row, 2048 with 4 warps gives each thread two
SWEEP = ((4, 1024, 4), (8, 1024, 4), (16, 1024, 4), (32, 1024, 4), (8, 512, 2), (16, 512, 2), (8, 2048, 8),
         (16, 2048, 4))
NAIVE_CONFIGS = ((8, 512, 4), (16, 256, 4), (16, 512, 4), (32, 256, 4), (4, 1024, 4), (8, 1024, 8))


def _naive_kernel() -> Any:
    """The first experiment's GEMV: a [BLOCK_N, BLOCK_K] accumulator per row, rows one after another."""
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


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def time_shape(name: str, ws: list[torch.Tensor], m: int, copy_gbps: float, quick: bool,
               naive: bool) -> list[dict[str, Any]]:
    """cuBLAS and the gemv variants over the 32 weights ws at batch m (errors: the last weight's product)."""
    from pdkernels.fused_ops import silu_mul
    from pdkernels.gemv import GemvConfig, gemv, gemv_config

    n, k = ws[0].shape
    nbytes = len(ws) * n * k * 2
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[-1])
    default = gemv_config(n, k, m)

    def row(impl: str, ms: float, **kw: Any) -> dict[str, Any]:
        return {"shape": name, "n": n, "k": k, "m": m, "impl": impl, "us": ms * 1e3 / len(ws),
                "frac": nbytes / (ms / 1e3) / 1e9 / copy_gbps, **kw}  # fmt: skip

    def tiles(c: GemvConfig) -> str:
        return f"{c.block_n}x{c.block_k}w{c.num_warps}"

    def cublas() -> None:
        for w in ws:
            F.linear(x, w)

    rows = [row("cublas", graph_ms(cublas))]

    def time_gemv(label: str, cfg: GemvConfig, **kw: Any) -> None:
        def run() -> None:
            for w in ws:
                gemv(x, w, out=y, config=cfg, **kw)

        ms = graph_ms(run)  # its first call leaves the last weight's product in y
        rows.append(row(label, ms, err=rel_err(y, ref), config=asdict(cfg), **kw))

    time_gemv(f"gemv {tiles(default)} (default)", default)
    if not quick:
        for bn, bk, nw in SWEEP:
            cfg = GemvConfig(bn, bk, nw)
            if cfg != default:
                time_gemv(f"gemv {tiles(cfg)}", cfg)
    time_gemv(f"gemv {tiles(default)} pdl", default, pdl=True)
    time_gemv(f"gemv {tiles(default)} pdl+pf2", default, pdl=True, prefetch=2)

    if name == "down":  # the SiLU-and-mul before the down projection, fused into its input
        gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16) * 2
        act_ref = F.linear(silu_mul(gate_up), ws[-1])

        def unfused() -> None:
            for w in ws:
                F.linear(silu_mul(gate_up), w)

        rows.append(row("silu_mul + cublas", graph_ms(unfused)))
        for label, kw in (("", {}), (" pdl+pf2", {"pdl": True, "prefetch": 2})):

            def fused(kw: dict[str, Any] = kw) -> None:
                for w in ws:
                    gemv(gate_up, w, act="silu", out=y, config=default, **kw)

            ms = graph_ms(fused)
            rows.append(row(f"gemv silu {tiles(default)}{label}", ms, err=rel_err(y, act_ref), config=asdict(default),
                            act="silu", **kw))

    if naive:
        kernel = _naive_kernel()
        for bn, bk, nw in NAIVE_CONFIGS:
            if k % bk:
                continue

            def naive_run(bn: int = bn, bk: int = bk, nw: int = nw) -> None:
                for w in ws:
                    kernel[(-(-n // bn),)](x, w, y, n, k, M=m, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)

            ms = graph_ms(naive_run)
            rows.append(row(f"naive {bn}x{bk} w{nw}", ms, err=rel_err(y, ref)))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8", help="rows of x, comma-separated (at most 8)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--quick", action="store_true", help="cuBLAS, the default configuration and pdl only")
    p.add_argument("--naive", action="store_true", help="also the first experiment's kernel")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gemv: needs CUDA")
        return 0
    copy_gbps = copy_bytes_per_s(torch.device("cuda")) / 1e9  # eager: a graph's memcpy node is no ceiling
    print(f"copy ceiling {copy_gbps:,.0f} GB/s (read + write)")
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(32)]
        for m in [int(b) for b in args.batches.split(",")]:
            rows += time_shape(name, ws, m, copy_gbps, args.quick, args.naive)
        del ws
        torch.cuda.empty_cache()
    print(f"{'shape':<8} {'m':>3} {'impl':<30} {'us':>8} {'of copy':>8} {'rel err':>9}")
    for r in rows:
        print(
            f"{r['shape']:<8} {r['m']:>3} {r['impl']:<30} {r['us']:8.1f} {r['frac']:8.1%} {r.get('err', 0):9.1e}"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gemv.json").write_text(
            json.dumps({"copy_GBps": copy_gbps, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
