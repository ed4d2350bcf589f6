"""A forward pass's products: `linear` takes a decode step's few rows through pdkernels/gemv.py (one kernel, no
split-K reduction after it), FP8 weights through engine/layers/fp8.py's paths, and everything else through
F.linear; deterministic mode's numerics keep the batch-invariant products. engine/models/decoder.py's layers call
it, and hand it to engine/layers/moe.py's router."""

from __future__ import annotations

from functools import cache
from types import ModuleType
from typing import cast

import torch
from torch import nn

from engine.layers import fp8
from engine.layers.context import current_context
from engine.layers.numerics import Numerics
from pdkernels import pdl


@cache
def _fused_ops() -> ModuleType | None:
    try:
        from pdkernels import fused_ops
    except ImportError:  # no triton
        return None
    return fused_ops


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """pdkernels.fused_ops when x is on CUDA and triton is there, else None (the torch code runs)."""
    return _fused_ops() if x.is_cuda else None


@cache
def _gemv_kernels() -> ModuleType | None:
    try:
        from pdkernels import gemv
    except ImportError:  # no triton
        return None
    return gemv


def _gemv_for(x: torch.Tensor) -> ModuleType | None:
    """pdkernels.gemv for a decode-sized x: CUDA, default numerics (deterministic mode's products stay
    batch-invariant), at most ForwardConfig.gemv_rows rows; else None (cuBLAS through F.linear), also
    outside a forward pass (a row function called on its own takes the products every mode shares)."""
    if not x.is_cuda or x.dim() != 2:
        return None
    ctx = current_context()
    if ctx is None or x.shape[0] > ctx.config.gemv_rows or ctx.numerics is not Numerics.DEFAULT:
        return None
    return _gemv_kernels()


def fp8_compute_path(x: torch.Tensor) -> str | None:
    """engine/layers/fp8.py compute_path's policy: "gemv", "cublas" or "triton" inside a forward pass with default
    numerics on a device with FP8 tensor cores (ForwardConfig.gemv_rows and fp8_gemm choose), else None."""
    ctx = current_context()
    if ctx is None or ctx.numerics is not Numerics.DEFAULT or ctx.config.fp8_gemm == "dequantize":
        return None
    if fp8.kernels_for(x) is None:
        return None
    if x.dim() == 2 and x.shape[0] <= ctx.config.gemv_rows:
        return "gemv"
    return "cublas" if ctx.config.fp8_gemm == "auto" and fp8.has_cublas_blockwise(x.device) else "triton"


fp8.set_compute_policy(fp8_compute_path)


def linear(lin: nn.Linear, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
    """lin(x): a decode step's few rows through pdkernels/gemv.py (one kernel, no split-K reduction after
    it), everything else through F.linear. act (CUDA): x is [gate | up] and the input is act(gate) * up
    (fused_ops.silu_mul; inside the GEMV's kernel when it takes x, inside the quantization of x for an FP8
    weight's GEMM)."""
    if isinstance(lin, fp8.Fp8Linear):  # FP8 weights choose their own products (fp8.compute_path)
        path = fp8.compute_path(x) if act is not None else None
        if path == "gemv":
            return lin.gemv(x, act)
        if path is not None:  # the activation computed as x is quantized: one pass, no bf16 product written
            return lin.gemm(x, path, act)
    else:
        g = _gemv_for(x)
        if g is not None:
            return g.gemv(x, lin.weight, lin.bias, act=act, pdl=pdl.active())
    if act is not None:
        x = cast(ModuleType, _fused_ops()).silu_mul(x, act)
    return lin(x)
