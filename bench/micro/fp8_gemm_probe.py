"""The block-scaled FP8 GEMM (pdkernels/fp8_gemm.py, activations quantized per token group of 128 on the
fly) at llama8b's linear shapes, against bf16 F.linear and torch._scaled_mm (per-tensor FP8, the image's
FP8 GEMM ceiling) in the same run: ms, TFLOP/s, and for small M the weight bytes' GB/s.

    python bench/micro/fp8_gemm_probe.py [--ms 1,64,8192]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.micro.engine_speed import time_op

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def timed(fn: Callable[[], object]) -> float:
    """Median ms of fn on the GPU (engine_speed's timer)."""
    return time_op(fn, torch.device("cuda"), warmup=3, reps=20) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,64,8192")
    args = ap.parse_args()
    print(f"{'shape':8s} {'M':>5s} | {'bf16 ms':>8s} {'scaled_mm ms':>12s} {'block fp8 ms':>12s} | "
          f"{'bf16 TF/s':>9s} {'smm TF/s':>8s} {'fp8 TF/s':>8s} | {'fp8 W GB/s':>10s} | max rel err")
    for m in (int(v) for v in args.ms.split(",")):
        for name, (n, k) in SHAPES.items():
            print(row(name, m, n, k), flush=True)


def row(name: str, m: int, n: int, k: int) -> str:
    """One shape's line of the table."""
    from pdkernels.fp8_gemm import fp8_linear

    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    tiles = w.float().view(n // 128, 128, k // 128, 128)
    scales = tiles.abs().amax(dim=(1, 3)) / 448.0
    w8 = (tiles / scales[:, None, :, None]).view(n, k).clamp(-448, 448).to(torch.float8_e4m3fn)
    t_bf16 = timed(lambda: F.linear(x, w))
    x8, one = x.to(torch.float8_e4m3fn), torch.ones((), device=dev)
    try:
        t_smm = timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    except RuntimeError:
        t_smm = float("nan")
    t_fp8 = timed(lambda: fp8_linear(x, w8, scales))
    ref = F.linear(x.float(), (w8.float().view(n // 128, 128, k // 128, 128) * scales[:, None, :, None]).view(n, k))
    err = ((fp8_linear(x, w8, scales).float() - ref).abs().max() / ref.abs().max()).item()
    flop = 2 * m * n * k
    return (f"{name:8s} {m:5d} | {t_bf16:8.3f} {t_smm:12.3f} {t_fp8:12.3f} | {flop / t_bf16 / 1e9:9.1f} "
            f"{flop / t_smm / 1e9:8.1f} {flop / t_fp8 / 1e9:8.1f} | {n * k / t_fp8 / 1e6:10.0f} | {err:.4f}")

if __name__ == "__main__":
    main()
