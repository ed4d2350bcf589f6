"""How row-local math runs, and the probe that picks it in deterministic mode.

Batch invariance needs every row's result to be independent of how many rows share the call.
`TILED` guarantees it by construction: fixed tiles of ROW_TILE rows, one call each. That is slow
(on the 2-core CPU here a 512-row projection takes ~16x longer as 32 tile calls). Many BLAS
libraries compute a row identically for every row count past a small threshold, so `PADDED` pads
the rows to a multiple of ROW_TILE (M >= 16 always) and makes one call. The engine uses PADDED only
after `probe_padded_is_invariant` has shown, on this machine and this model's own layer functions,
that it gives bit-identical rows to TILED over a range of row counts; otherwise TILED.

On CUDA (with Triton) deterministic mode is `BATCH_INVARIANT`: one call over the whole batch, with
every matrix product routed to pdkernels/bi_matmul.py, whose arithmetic depends on the weight's shape
alone, never on the number of rows. The norms, rotary and activation there are one-program-per-row
Triton kernels (pdkernels/fused_ops.py) and elementwise torch ops: invariant by construction. Any other
reduction inside a row function (a sum, a softmax) is refused rather than silently batch-dependent.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_TILE = 16
PROBE_ROWS = (16, 32, 48, 80, 128, 208)


class Numerics(enum.Enum):
    DEFAULT = "default"  # one call over the whole batch: fastest, not batch-invariant
    TILED = "tiled"  # fixed ROW_TILE-row calls: batch-invariant by construction
    PADDED = "padded"  # rows padded to a ROW_TILE multiple, one call: invariant where probed
    BATCH_INVARIANT = "batch_invariant"  # CUDA: one call, matrix products through pdkernels/bi_matmul.py

    @property
    def is_deterministic(self) -> bool:
        return self is not Numerics.DEFAULT


def run_rows(fn: Callable[..., torch.Tensor], xs: tuple[torch.Tensor, ...], mode: Numerics) -> torch.Tensor:
    """fn(*xs) for a row-local fn under the given numerics."""
    if mode is Numerics.DEFAULT:
        return fn(*xs)
    if mode is Numerics.BATCH_INVARIANT:
        with BatchInvariantOps():
            return fn(*xs)
    n = xs[0].shape[0]
    pad = (-n) % ROW_TILE
    padded = [F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x for x in xs]
    if mode is Numerics.PADDED:
        return fn(*padded)[:n]
    outs = [fn(*(x[i : i + ROW_TILE] for x in padded)) for i in range(0, n + pad, ROW_TILE)]
    return torch.cat(outs)[:n]


@torch.inference_mode()
def probe_padded_is_invariant(
    fns: list[tuple[Callable[..., torch.Tensor], list[int]]], dtype: torch.dtype, device: torch.device
) -> bool:
    """fns: (row-local function, widths of its inputs). True if PADDED equals TILED bit for bit for
    every function and every probed row count, on random inputs."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    for fn, widths in fns:
        xs = tuple(torch.randn(max(PROBE_ROWS), w, generator=gen).to(device, dtype) for w in widths)
        for rows in PROBE_ROWS:
            part = tuple(x[:rows] for x in xs)
            if not torch.equal(run_rows(fn, part, Numerics.PADDED), run_rows(fn, part, Numerics.TILED)):
                return False
    return True


@cache
def _bi_kernels() -> Any | None:
    try:
        from pdkernels import bi_matmul, fused_ops
    except ImportError:  # no triton
        return None
    return bi_matmul, fused_ops


def batch_invariant_available(device: torch.device) -> bool:
    """BATCH_INVARIANT needs CUDA and Triton."""
    return device.type == "cuda" and _bi_kernels() is not None


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if b.dim() != 2 or a.dim() < 1:
        raise NotImplementedError(f"batch-invariant matmul of {tuple(a.shape)} by {tuple(b.shape)}")
    bi = _bi_kernels()[0]  # type: ignore[index]
    out = bi.bi_matmul(a.reshape(-1, a.shape[-1]), b)
    return out.view(*a.shape[:-1], b.shape[1])


# Reductions whose CUDA kernels choose their split by the tensor's shape (so by the row count).
_REFUSED = {
    torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean, torch.softmax, torch.Tensor.softmax,
    F.softmax, F.log_softmax, torch.bmm, torch.baddbmm, torch.addmm, torch.einsum, torch.var, torch.Tensor.var,
    torch.norm, torch.Tensor.norm, F.layer_norm, F.rms_norm, F.scaled_dot_product_attention,
}


class BatchInvariantOps(TorchFunctionMode):
    """While active: F.linear and 2-D-weight matmuls run through pdkernels/bi_matmul.py; the reductions
    in _REFUSED raise. Everything else (elementwise ops, views, the Triton row kernels) runs as is."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            bi = _bi_kernels()[0]  # type: ignore[index]
            return bi.bi_linear(*args, **kwargs)
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm):
            return _matmul(*args, **kwargs)
        if func in _REFUSED:
            raise NotImplementedError(f"{getattr(func, '__name__', func)} is not batch-invariant on CUDA")
        return func(*args, **kwargs)


def pick_numerics(
    is_deterministic: bool,
    row_functions: Callable[[], list[tuple[Callable[..., torch.Tensor], list[int]]]],
    dtype: torch.dtype,
    device: torch.device,
    agree: Callable[[int], int] | None = None,
) -> Numerics:
    """The step's numerics: DEFAULT, or with is_deterministic the fastest batch-invariant kind this device
    has (PADDED where the probe of the model's row_functions() finds padding invariant, else TILED);
    agree: a group's minimum over its ranks, so that every rank runs the same numerics."""
    if not is_deterministic:
        return Numerics.DEFAULT
    if batch_invariant_available(device):
        return Numerics.BATCH_INVARIANT
    fast = probe_padded_is_invariant(row_functions(), dtype, device)
    if agree is not None:
        fast = bool(agree(int(fast)))
    return Numerics.PADDED if fast else Numerics.TILED
