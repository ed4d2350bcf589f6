"""The FP8 products at llama8b's linear shapes (pdkernels/fp8_gemm.py's block-scaled GEMM with activations
quantized per token group of 128 on the fly, pdkernels/gemv.py with an FP8 weight and its block scales)
against bf16 (F.linear, the bf16 GEMV) and the ceilings measured in the same run: the device copy
(GB/s, read + write) for small M, torch._scaled_mm on per-tensor FP8 (the image's FP8 GEMM) for large M.
For each M it also tries a few tile settings and prints the best, so gemm_config / gemv_config can be
checked against what the device does.

    python bench/micro/fp8_gemm_probe.py [--ms 1,8,64,8192] [--sweep] [--quant-sweep] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.micro.engine_speed import copy_bytes_per_s, graph_ms

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DEV = torch.device("cuda")


def timed(fn: Callable[[], object]) -> float:
    """Median ms of fn captured in a CUDA graph, as the engine runs its steps (an eager Triton launch costs
    tens of microseconds of host time, more than a decode row's product)."""
    return graph_ms(fn)


def weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bf16 weight and its block-scaled FP8 form (engine/layers/fp8.py quantize)."""
    from engine.layers.fp8 import quantize

    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
    w8, scales = quantize(w)
    return w, w8, scales


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def small_m_row(name: str, m: int, n: int, k: int, copy_gbs: float, sweep: bool) -> str:
    """M <= 8: the GEMVs, as a share of the copy ceiling counting the weight's bytes once (2 B bf16, 1 B FP8)."""
    from engine.layers.fp8 import dequantize
    from pdkernels.fp8_gemm import fp8_linear
    from pdkernels.gemv import GemvConfig, gemv, gemv_config

    w, w8, s = weights(n, k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    t_lin = timed(lambda: F.linear(x, w))
    t_gemv = timed(lambda: gemv(x, w))
    t_gemv8 = timed(lambda: gemv(x, w8, scale=s))
    t_mm8 = timed(lambda: fp8_linear(x, w8, s))
    best = ""
    if sweep:
        base = gemv_config(n, k, m, 1)
        tried: dict[GemvConfig, float] = {}
        for bn, warps in itertools.product((2, 4, 8, 16), (2, 4, 8)):
            cfg = GemvConfig(bn, 16 * 32 * warps, warps)
            try:
                tried[cfg] = timed(functools.partial(gemv, x, w8, scale=s, config=cfg))
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                print(f"  {cfg}: {type(e).__name__}")
        cfg, t = min(tried.items(), key=lambda kv: kv[1])
        best = f" | default {base.block_n}/{base.num_warps}w, best {cfg.block_n}/{cfg.num_warps}w {t:.4f} ms"
    ref = x.float() @ dequantize(w8, s, torch.float32).t()
    err = rel_err(gemv(x, w8, scale=s), ref)
    pct = lambda nbytes, t: 100 * nbytes / (t * 1e-3) / (copy_gbs * 1e9)  # noqa: E731 - as engine_speed counts it
    return (f"{name:8s} {m:5d} | {t_lin:8.4f} {t_gemv:8.4f} {t_gemv8:9.4f} {t_mm8:9.4f} | "
            f"{pct(2 * n * k, min(t_lin, t_gemv)):5.1f}% {pct(n * k, t_gemv8):5.1f}% | "
            f"{min(t_lin, t_gemv) / t_gemv8:5.2f}x | {err:.4f}{best}")


def large_m_row(name: str, m: int, n: int, k: int, sweep: bool) -> str:
    """M > 8: the block GEMM (activation quantization included, and without it) against bf16 F.linear and
    torch._scaled_mm, in TFLOP/s."""
    from engine.layers.fp8 import dequantize
    from pdkernels.fp8_gemm import (
        block_fp8_matmul,
        cublas_blockwise_supported,
        fp8_linear,
        gemm_config,
        per_token_group_quant,
        prepare_weight_scales,
        scaled_mm_blockwise,
    )

    w, w8, s = weights(n, k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    t_lin = timed(lambda: F.linear(x, w))
    x8, one = x.to(torch.float8_e4m3fn), torch.ones((), device=DEV)
    try:
        t_smm = timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    except RuntimeError:
        t_smm = float("nan")
    a8, a_s = per_token_group_quant(x)
    t_mm = timed(lambda: block_fp8_matmul(a8, a_s, w8, s))
    t_lin8 = timed(lambda: fp8_linear(x, w8, s))
    t_cub = float("nan")
    if cublas_blockwise_supported(DEV):
        s_t = prepare_weight_scales(s)
        try:
            t_cub = timed(lambda: scaled_mm_blockwise(x, w8, s_t))
        except RuntimeError as e:
            print(f"  cuBLAS block-scaled: {e}"[:300])
    best = ""
    if sweep:
        base = gemm_config(m, n, k)
        tried: dict[tuple[int, int, int, int], float] = {}
        grid = (((64, 128), (128, 256), (4, 8), (3, 4)) if m >= 1024 else ((16, 32, 64), (32, 64, 128), (4,), (3, 4)))
        for bm, bn, warps, stages in itertools.product(*grid):
            try:
                tried[(bm, bn, warps, stages)] = timed(functools.partial(
                    block_fp8_matmul, a8, a_s, w8, s, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages))
            except Exception as e:  # noqa: BLE001 - a tile that does not fit shared memory is skipped
                print(f"  {(bm, bn, warps, stages)}: {type(e).__name__}")
        cfg, t = min(tried.items(), key=lambda kv: kv[1])
        best = (f" | default {base.block_m}x{base.block_n}/{base.num_warps}w/{base.num_stages}s, best "
                f"{cfg[0]}x{cfg[1]}/{cfg[2]}w/{cfg[3]}s {t:.3f} ms")
    ref = F.linear(x.float(), dequantize(w8, s, torch.float32))
    err = rel_err(fp8_linear(x, w8, s), ref)
    tf = lambda t: 2 * m * n * k / t / 1e9  # noqa: E731
    return (f"{name:8s} {m:5d} | {t_lin:8.3f} {t_smm:8.3f} {t_mm:8.3f} {t_lin8:8.3f} {t_cub:8.3f} | "
            f"{tf(t_lin):7.1f} {tf(t_smm):7.1f} {tf(t_mm):7.1f} {tf(t_lin8):7.1f} {tf(t_cub):7.1f} | "
            f"{100 * t_smm / t_lin8:5.1f}% {100 * t_smm / t_cub:5.1f}% | {err:.4f}{best}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,8,64,8192")
    ap.add_argument("--sweep", action="store_true", help="also try other tile settings and print the best")
    ap.add_argument("--out", type=Path, help="also write the table here")
    ap.add_argument("--quant-sweep", action="store_true", help="also time the activations' quantization alone")
    args = ap.parse_args()
    copy_gbs = copy_bytes_per_s(DEV) / 1e9
    lines = [f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  copy ceiling {copy_gbs:.0f} GB/s "
             "(read + write)"]
    ms = [int(v) for v in args.ms.split(",") if v]  # --ms "": the quantization sweep alone
    if any(m <= 8 for m in ms):
        lines.append(f"{'shape':8s} {'M':>5s} | {'F.linear':>8s} {'gemv':>8s} {'gemv fp8':>9s} {'gemm fp8':>9s} | "
                     f"{'bf16%':>6s} {'fp8%':>6s} | fp8 speedup | max rel err")
    for m in (m for m in ms if m <= 8):
        for name, (n, k) in SHAPES.items():
            lines.append(small_m_row(name, m, n, k, copy_gbs, args.sweep))
            print(lines[-1], flush=True)
    if any(m > 8 for m in ms):
        lines.append(f"{'shape':8s} {'M':>5s} | {'bf16 ms':>8s} {'smm ms':>8s} {'fp8 mm':>8s} {'fp8 lin':>8s} "
                     f"{'cublk ms':>8s} | "
                     f"{'bf16 TF':>7s} {'smm TF':>7s} {'mm TF':>7s} {'lin TF':>7s} {'cub TF':>7s} | lin, cub of smm "
                     "| max rel err")
    for m in (m for m in ms if m > 8):
        for name, (n, k) in SHAPES.items():
            lines.append(large_m_row(name, m, n, k, args.sweep))
            print(lines[-1], flush=True)
    if args.quant_sweep:
        lines += quant_sweep(copy_gbs)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


def quant_sweep(copy_gbs: float) -> list[str]:
    """The activations' quantization alone (per_token_group_quant, cuBLAS's layout) at prefill's and a
    decode batch's rows, for each number of 128-column groups a program takes (fp8_gemm.QUANT_GROUPS), as
    a share of the copy ceiling (2 bytes read and 1 written per value)."""
    from pdkernels import fp8_gemm

    lines = [f"{'quant M x K':>14s} | " + " ".join(f"{g:>2d} groups" for g in (4, 8, 16, 32)) + " | ms, % of copy"]
    saved = fp8_gemm.QUANT_GROUPS
    for m, k in ((8192, 4096), (8192, 14336), (64, 4096), (64, 14336)):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        cells = []
        for groups in (4, 8, 16, 32):
            fp8_gemm.QUANT_GROUPS = groups
            t = timed(functools.partial(fp8_gemm.per_token_group_quant, x, rows_to=fp8_gemm.CUBLAS_ROWS_TO))
            cells.append(f"{t:.4f} {100 * 3 * m * k / (t * 1e-3) / (copy_gbs * 1e9):4.0f}%")
        fp8_gemm.QUANT_GROUPS = saved
        lines.append(f"{m:>6d} x {k:<5d} | " + " | ".join(cells))
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
