"""FP8 weights, block-scaled, as DeepSeek-V3/R1 and the Qwen3 `*-FP8` releases ship them.

A quantized weight W [..., N, K] is stored as `float8_e4m3fn` values plus one float32 `weight_scale_inv`
per BLOCK x BLOCK block, [..., ceil(N / BLOCK), ceil(K / BLOCK)] (the last row and column of blocks may
be partial):

    W[n, k] = float(W8[n, k]) * scale_inv[n // BLOCK, k // BLOCK]

config.json says so with `quantization_config` = {"quant_method": "fp8", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]} (optionally "fmt": "e4m3" and "modules_to_not_convert"); `fp8_format`
accepts exactly that and refuses anything else, naming the field.

Which modules hold FP8 weights (`Fp8Plan`): for a pre-quantized checkpoint, those whose weight has a
`weight_scale_inv` in the checkpoint (the modules the config lists in modules_to_not_convert ship in
their float dtype and stay so); for `--quantization fp8` on a float checkpoint, or dummy weights, every
projection of the decoder layers (attention, dense MLP, experts, shared experts) except the MoE routers and
modules_to_not_convert; embeddings, norms and lm_head stay in the model's dtype.

Compute: `Fp8Linear` and a MoE layer's FP8 experts dequantize their weight block-wise to the activations'
dtype at every matmul (float32 products of the FP8 value and its scale, then one rounding to the compute
dtype), then run the float matmul the engine runs anyway. The dequantization is elementwise, so a row's
result does not depend on its batch: deterministic mode holds as for float weights.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.meta import on_meta
from engine.quantization import (  # the format's names, re-exported for the layer's users
    BLOCK as BLOCK,
)
from engine.quantization import (
    FP8_DTYPE as FP8_DTYPE,
)
from engine.quantization import (
    FP8_MAX as FP8_MAX,
)
from engine.quantization import (
    QUANTIZATIONS as QUANTIZATIONS,
)
from engine.quantization import (
    SCALE_SUFFIX as SCALE_SUFFIX,
)
from engine.quantization import (
    Fp8Format as Fp8Format,
)
from engine.quantization import (
    fp8_format as fp8_format,
)
from engine.quantization import (
    scale_shape as scale_shape,
)


def _blocked(w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """w [..., N, K] zero-padded to whole blocks and viewed [..., N/B, B, K/B, B]; with N and K."""
    n, k = w.shape[-2:]
    pad_n, pad_k = -n % BLOCK, -k % BLOCK
    if pad_n or pad_k:
        w = F.pad(w, (0, pad_k, 0, pad_n))
    return w.unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK)), n, k


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., N, K] -> (FP8 values [..., N, K], float32 scale_inv [..., N/B, K/B]), each block
    scaled so its largest magnitude maps to FP8_MAX (an all-zero block gets scale 1)."""
    blocks, n, k = _blocked(w.float())
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., N/B, K/B]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.flatten(-2).flatten(-3, -2)[..., :n, :k]
    return q.contiguous(), scale_inv


def dequantize(w8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 values [..., N, K] and their block scales -> the weight in dtype: float32(W8) * scale, then cast."""
    n, k = w8.shape[-2:]
    *lead, rows, cols = scale_inv.shape
    scale = scale_inv.float()[..., None, :].expand(*lead, rows, BLOCK, cols).flatten(-3, -2)[..., :n, :]  # [..., N, K/B]
    w = w8.float()
    full, rem = divmod(k, BLOCK)
    if full:
        w[..., : full * BLOCK].unflatten(-1, (full, BLOCK)).mul_(scale[..., :full, None])
    if rem:
        w[..., full * BLOCK :].mul_(scale[..., full:])
    return w.to(dtype)


@cache
def _fp8_tensor_cores(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)  # Ada and Hopper have FP8 tensor cores


@cache
def _kernel_module() -> ModuleType | None:
    try:
        from pdkernels import fp8_gemm
    except ImportError:  # no triton
        return None
    return fp8_gemm


def _no_fp8_compute(x: torch.Tensor) -> str | None:
    return None


# How an FP8 weight multiplies x (see compute_path): engine/models/decoder.py installs the policy, which reads the
# step's forward context; this module sits below engine.context in the layers (tests/test_layers.py), so it
# asks through this hook. Until then (an Fp8Linear outside the engine's model) the weight is dequantized.
_compute_policy: Callable[[torch.Tensor], str | None] = _no_fp8_compute


def set_compute_policy(policy: Callable[[torch.Tensor], str | None]) -> None:
    global _compute_policy
    _compute_policy = policy


def compute_path(x: torch.Tensor) -> str | None:
    """How an FP8 weight multiplies x: "gemv" (pdkernels/gemv.py with the FP8 weight and its scales) for a
    2-D x of at most ForwardConfig.gemv_rows rows, else "triton" or "cublas" (ForwardConfig.fp8_gemm), where
    FP8 runs on the tensor cores: x on a CUDA device with them (sm_89 and later), triton there, inside a
    forward pass with default numerics. None elsewhere: the CPU, older GPUs, `--deterministic`
    (batch-invariant products), fp8_gemm "dequantize" and calls outside a step; the weight is then
    dequantized to x's dtype and F.linear runs. (The policy: engine/layers/linear.py fp8_compute_path.)"""
    return _compute_policy(x)


def kernels_for(x: torch.Tensor) -> ModuleType | None:
    """pdkernels.fp8_gemm where x's device has FP8 tensor cores (sm_89 and later) and triton is there."""
    if not x.is_cuda or not _fp8_tensor_cores(x.device.index if x.device.index is not None else 0):
        return None
    return _kernel_module()


def has_cublas_blockwise(device: torch.device) -> bool:
    """Whether cuBLAS's block-scaled FP8 GEMM runs on device (pdkernels/fp8_gemm.py)."""
    return _has_cublas_blockwise(device)


@cache
def _has_cublas_blockwise(device: torch.device) -> bool:
    kernels = _kernel_module()
    return kernels is not None and bool(kernels.cublas_blockwise_supported(device))


class Fp8Linear(nn.Linear):
    """nn.Linear with an FP8 weight [out, in] and its block scales `weight_scale_inv` (bias, if any, in the
    model's dtype). forward(): on FP8 tensor cores (compute_path) the block-scaled FP8 GEMM with x
    quantized per token group of 128; elsewhere the weight dequantized to x's dtype and F.linear. A
    decode step's few rows take the FP8 GEMV instead (engine/models/decoder.py `linear`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device | None = None) -> None:
        with on_meta():
            super().__init__(in_features, out_features, bias=bias)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)  # fmt: skip
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_shape((out_features, in_features)), dtype=torch.float32, device=device),
            requires_grad=False,
        )
        self.cublas_scales: torch.Tensor | None = None  # prepare_kernels

    @classmethod
    def like(cls, lin: nn.Linear) -> Fp8Linear:
        """An empty Fp8Linear of lin's shape on lin's device; lin's bias (already loaded or not) kept."""
        out = cls(lin.in_features, lin.out_features, False, lin.weight.device)
        out.bias = lin.bias
        return out

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = compute_path(x)
        if path is None:
            return F.linear(x, self.dense_weight(x.dtype), self.bias)
        if path == "gemv":
            return self.gemv(x)
        return self.gemm(x, path)

    def gemm(self, x: torch.Tensor, path: str, act: str | None = None) -> torch.Tensor:
        """x through the block-scaled FP8 GEMM of path ("cublas" or "triton", compute_path), x quantized on
        the fly; act (fused_ops.ACTIVATIONS): x is [gate | up] and the input is act(gate) * up, computed
        in the quantizing pass."""
        kernels = cast(ModuleType, _kernel_module())
        rows_to = self.input_rows_to(path)
        quantized = None if act is not None else quantized_input(x, rows_to)
        if rows_to > 1:
            if self.cublas_scales is None:  # prepared at load (prepare_kernels); a module built later: here
                self.prepare_kernels()
            return kernels.scaled_mm_blockwise(x, self.weight, self.cublas_scales, self.bias, act=act, quantized=quantized)
        return kernels.fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, act=act, quantized=quantized)

    def input_rows_to(self, path: str) -> int:
        """How gemm(x, path) lays out x's quantization: rows rounded up to this many (cuBLAS's layout: 4;
        the Triton GEMM's: 1), as pdkernels/fp8_gemm.py per_token_group_quant's rows_to."""
        cublas = path == "cublas" and self.in_features % BLOCK == 0 and self.out_features % BLOCK == 0
        return CUBLAS_ROWS_TO if cublas else 1

    def gemv(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """x's few rows through the GEMV reading the FP8 weight (act: x is [gate | up], as gemv takes it)."""
        from pdkernels import gemv, pdl

        return gemv.gemv(x, self.weight, self.bias, act=act, pdl=pdl.active(), scale=self.weight_scale_inv)

    def prepare_kernels(self) -> None:
        """The block scales as cuBLAS's block-scaled GEMM reads them (pdkernels/fp8_gemm.py
        prepare_weight_scales), on a device that has it; once the weights are loaded and fused."""
        kernels = _kernel_module()
        if self.weight.is_cuda and kernels is not None and _has_cublas_blockwise(self.weight.device):
            self.cublas_scales = kernels.prepare_weight_scales(self.weight_scale_inv)


CUBLAS_ROWS_TO = 4  # pdkernels/fp8_gemm.py CUBLAS_ROWS_TO (not imported here: that module needs triton)
_QUANTIZED = "fp8_quantized"  # the attribute a tensor carries its FP8 quantization in (with_quantized)


def with_quantized(
    x: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor] | None, rows_to: int
) -> torch.Tensor:
    """x, carrying quantized: its FP8 values and scales as per_token_group_quant(x, rows_to) makes them,
    made in the pass that wrote x (a norm: pdkernels/fused_ops.py rms_norm_quant), which an Fp8Linear's
    GEMM then takes instead of quantizing x again."""
    if quantized is not None:
        setattr(x, _QUANTIZED, (rows_to, quantized))
    return x


def quantized_input(x: torch.Tensor, rows_to: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The quantization x carries (with_quantized) if it has that layout, else None."""
    got = getattr(x, _QUANTIZED, None)
    return got[1] if got is not None and got[0] == rows_to else None


def input_rows_to(lin: nn.Linear | None, x: torch.Tensor) -> int:
    """For a norm whose output (like x: [rows, n]) goes into lin: the rows_to of the quantization lin's
    GEMM would make of it, so the norm can make it in its own pass; 0 where lin will not quantize it
    (not FP8, a GEMV's few rows, no FP8 compute here, n not whole groups)."""
    if not isinstance(lin, Fp8Linear) or x.dim() != 2 or x.shape[1] % BLOCK:
        return 0
    path = compute_path(x)
    return lin.input_rows_to(path) if path in ("cublas", "triton") else 0


def dense_weight(lin: nn.Linear, dtype: torch.dtype) -> torch.Tensor:
    """lin's weight as a float tensor of dtype (dequantized for an Fp8Linear; as stored otherwise)."""
    return lin.dense_weight(dtype) if isinstance(lin, Fp8Linear) else lin.weight


def dequantized(lin: Fp8Linear, dtype: torch.dtype) -> nn.Linear:
    """A float nn.Linear holding lin's weight dequantized to dtype once (its bias kept), for a weight that
    the layer reads whole every step rather than through the FP8 GEMM or GEMV."""
    with on_meta():
        out = nn.Linear(lin.in_features, lin.out_features, bias=False)
    out.weight = nn.Parameter(lin.dense_weight(dtype), requires_grad=False)
    out.bias = lin.bias
    return out


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def can_concat(linears: list[nn.Linear]) -> bool:
    """Whether these linears' weights can be stacked along the output rows (engine/models/decoder.py fuse_linears):
    all float, or all FP8 with every output width but the last a whole number of blocks (so the scale rows
    stack too)."""
    kinds = {isinstance(lin, Fp8Linear) for lin in linears}
    if kinds == {False}:
        return True
    return kinds == {True} and all(lin.out_features % BLOCK == 0 for lin in linears[:-1])


def concat(linears: list[nn.Linear]) -> Fp8Linear:
    """One Fp8Linear whose output is the given FP8 linears' outputs side by side (can_concat holds)."""
    first = linears[0]
    out = Fp8Linear(first.in_features, sum(lin.out_features for lin in linears), False, first.weight.device)
    out.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]), requires_grad=False)
    scales: list[torch.Tensor] = [lin.weight_scale_inv for lin in linears if isinstance(lin, Fp8Linear)]
    out.weight_scale_inv = nn.Parameter(torch.cat(scales), requires_grad=False)
    if first.bias is not None:
        out.bias = nn.Parameter(torch.cat([lin.bias for lin in linears if lin.bias is not None]), requires_grad=False)
    return out
