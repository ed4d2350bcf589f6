"""Block-scaled FP8 matrix product (Triton), as vLLM's and SGLang's `w8a8_block_fp8_matmul` compute it:
C = dequant(A8) @ dequant(W8).T, where

    W8 [N, K] float8_e4m3fn, w_scale_inv [ceil(N/128), ceil(K/128)]: W[n, k] = W8[n, k] * w_scale_inv[n/128, k/128]
    A8 [M, K] float8_e4m3fn, a_scale [M, ceil(K/128)]: A[m, k] = A8[m, k] * a_scale[m, k/128]

The activations are quantized on the fly, per token and group of 128 columns (`per_token_group_quant`:
scale = max(|group|, eps) / 448, values = clamp(x / scale) as e4m3, the "dynamic" activation scheme of
the FP8 releases). The product runs one 128-wide K block at a time: the FP8 tiles' product accumulates
exactly in float32 on the tensor cores, then is scaled by the row's activation scale and the column's
weight scale of that K block and added to a float32 accumulator:

    acc[m, n] = sum over k-blocks b of (A8[m, b] . W8[n, b]) * a_scale[m, b] * w_scale_inv[n / 128, b]

BLOCK_K is the quantization block (128) so each K step has one scale per row and column (a column's scale
is its block row's, loaded as a vector: BLOCK_N may span several block rows). Not batch-invariant (M decides nothing here, but the
launch's tile per shape is a plain heuristic, not a fixed function of (N, K) as pdkernels/bi_matmul.py's):
the engine's deterministic mode does not take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from pdkernels.fused_ops import ACTIVATIONS, act_mul, quant_buffers
from pdkernels.fused_ops import FP8_EPS as EPS
from pdkernels.fused_ops import FP8_GROUP as GROUP
from pdkernels.fused_ops import FP8_MAX as FP8_MAX


@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_sm, stride_sg, num_groups, eps, fp8_max,
    GROUP_SIZE: tl.constexpr, GROUPS: tl.constexpr, ACT: tl.constexpr, GELU_TANH: tl.constexpr,
):  # fmt: skip
    """GROUPS groups of one row per program, as a [GROUPS, GROUP_SIZE] tile (16-byte loads, one max per group).
    ACT: the row is [gate | up] (2K wide) and what is quantized is act(gate) * up in x's dtype
    (fused_ops.act_mul: the values fused_ops.silu_mul writes), in the same pass."""
    row = tl.program_id(0)
    gs = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = gs[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    mask = cols < K
    if ACT:
        g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * stride_x + K + cols, mask=mask, other=0.0)
        x = act_mul(g, u, x_ptr.dtype.element_ty, GELU_TANH).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), eps) / fp8_max
    q = tl.clamp(x / scale[:, None], -fp8_max, fp8_max)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + gs * stride_sg, scale, mask=gs < num_groups)


QUANT_GROUPS = 8  # groups of a row per program of _quant_kernel


def per_token_group_quant(
    x: torch.Tensor, rows_to: int = 1, act: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (x8 [M, K] float8_e4m3fn, scales [M, ceil(K/128)] float32).

    rows_to > 1 (cuBLAS's block-scaled product, scaled_mm_blockwise): both have M rounded up to a multiple
    of rows_to (the added rows unspecified) and the scales are stored column-major ([groups, M'] in
    memory, its transpose returned), as cuBLAS reads 1x128 scales.

    act ("silu" or "gelu_tanh", fused_ops.ACTIVATIONS): x is [M, 2K], [gate | up], and what is quantized
    is fused_ops.silu_mul(x, act), computed in the same pass (never written in x's dtype).

    NOTE: under TRITON_INTERPRET the kernel stores the scaled values in float32 and torch casts them: Triton
    3.6's interpreter rounds float32 to e4m3 wrongly where the rounding carries into the exponent (31.9 became
    16, not 32), which the GPU's conversion does not."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"per_token_group_quant takes [M, K] with unit column stride, got {tuple(x.shape)}")
    if act is not None and (act not in ACTIVATIONS or x.shape[1] % 2):
        raise ValueError(f"per_token_group_quant: activation {act!r} of a [gate | up] x, got {tuple(x.shape)}")
    m, k = x.shape[0], x.shape[1] // (2 if act is not None else 1)
    num_groups = triton.cdiv(k, GROUP)
    q, scales = quant_buffers(m, k, rows_to, x.device)
    if m:
        groups = min(QUANT_GROUPS, triton.next_power_of_2(num_groups))
        _quant_kernel[(m, triton.cdiv(num_groups, groups))](
            x, q, scales, k, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1), num_groups, EPS, FP8_MAX,
            GROUP, groups, ACT=act is not None, GELU_TANH=act == "gelu_tanh", num_warps=4,
        )  # fmt: skip
    return q.to(torch.float8_e4m3fn), scales


@triton.jit
def _block_fp8_matmul_kernel(
    a_ptr, w_ptr, c_ptr, a_s_ptr, w_s_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_wn, stride_cm,
    num_k_groups: tl.constexpr,  # a weight's shape: one compile per K (also what Triton's interpreter can loop over)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    w_s_rows = tl.minimum(cols, N - 1) // BLOCK_K  # each column's block row of W
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, num_k_groups):
        k = kb * BLOCK_K + ks
        k_ok = k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        a_s = tl.load(a_s_ptr + rows * num_k_groups + kb, mask=row_ok, other=0.0)
        w_s = tl.load(w_s_ptr + w_s_rows * num_k_groups + kb)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


TARGET_PROGRAMS = 132  # one program per multiprocessor of an H100 / H200 at least


@cache
def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """The tiles for an [M, K] x [N, K] product: BLOCK_M the next power of two of M from 16 up to 64 (a
    decode batch is one row tile, its weights read once); BLOCK_N 128, narrowed while the grid would leave
    multiprocessors idle (a batch-64 step's [4096, 4096] weight is 32 column tiles of 128, 128 of 32);
    4 warps. K is unused: one 128-wide K block per step, always."""
    # NOTE: 64 rows at most: at M = 8192 the sweep of bench/micro/fp8_gemm_probe.py on an H100 found 64x128
    # tiles, 4 warps, 3 stages fastest for 3 of llama8b's 4 shapes (0.43 against 0.54 ms for 128x128, 8 warps)
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 128
    while block_n > 32 and triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < TARGET_PROGRAMS:
        block_n //= 2
    return GemmConfig(block_m, block_n, 4, 3 if m >= 1024 else 4)


def block_fp8_matmul(
    a8: torch.Tensor,
    a_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """a8 [M, K] with a_scale [M, ceil(K/128)], w8 [N, K] with w_scale_inv [ceil(N/128), ceil(K/128)]
    -> [M, N] in out_dtype (+ bias [N]), as the module docstring computes it. The tile and launch
    settings left None come from gemm_config."""
    m, k = a8.shape
    n = w8.shape[0]
    groups = triton.cdiv(k, GROUP)
    if w8.shape[1] != k or a_scale.shape != (m, groups) or w_scale_inv.shape != (triton.cdiv(n, GROUP), groups):
        raise ValueError(
            f"block_fp8_matmul: a {tuple(a8.shape)} scales {tuple(a_scale.shape)}, w {tuple(w8.shape)} scales "
            f"{tuple(w_scale_inv.shape)} do not fit 128-blocks"
        )
    cfg = gemm_config(m, n, k)
    block_m, block_n = block_m or cfg.block_m, block_n or cfg.block_n
    num_warps, num_stages = num_warps or cfg.num_warps, num_stages or cfg.num_stages
    if block_n not in (16, 32, 64, 128, 256) or a8.stride(1) != 1 or w8.stride(1) != 1:
        raise ValueError("block_n must be a power of two from 16 to 256, and a8 and w8 need unit column strides")
    out = torch.empty(m, n, dtype=out_dtype, device=a8.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_fp8_matmul_kernel[grid](
        a8, w8, out, a_scale.contiguous(), w_scale_inv.contiguous(), bias if bias is not None else out,
        m, n, k, a8.stride(0), w8.stride(0), out.stride(0), groups,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def fp8_linear(
    x: torch.Tensor,
    w8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [..., K] through an FP8 weight: x quantized per token group of 128, block_fp8_matmul, in x's dtype.
    act: x is [..., 2K], [gate | up], and the input is act(gate) * up (per_token_group_quant's act).
    quantized: x's quantization made already (per_token_group_quant(x2)'s, x2 = x as [M, K]; a norm's
    kernel makes it in its pass: fused_ops.rms_norm_quant)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    a8, a_scale = quantized if quantized is not None else per_token_group_quant(x2, act=act)
    out = block_fp8_matmul(a8, a_scale, w8, w_scale_inv, bias, out_dtype=x.dtype)
    return out.view(*x.shape[:-1], w8.shape[0])


# ---- cuBLAS's block-scaled FP8 product (Hopper) -----------------------------------------------------
# torch's scaled_mm with BlockWise1x128 activations and BlockWise128x128 weights runs cuBLASLt's FP8 GEMM
# with these very scales (DeepSeek-V3's recipe) on sm_90: the same numbers as block_fp8_matmul, to its
# accumulation order, at cuBLAS's speed. It needs K and N whole 128-blocks, the activation scales
# column-major with M a multiple of 4, and the weight scales [K/128, N/128] with K/128 a multiple of 4
# (16-byte rows): prepare_weight_scales pads and transposes a weight's scales once, at load.

CUBLAS_ROWS_TO = 4  # the activations' rows (and their scales' leading dimension) a multiple of 4


def cublas_blockwise_supported(device: torch.device) -> bool:
    """Whether this torch has torch.nn.functional.scaled_mm's block recipes and device is sm_90 (cuBLAS's
    block-scaled FP8 GEMM exists for Hopper only)."""
    import torch.nn.functional as F

    return (
        device.type == "cuda"
        and hasattr(F, "scaled_mm")
        and hasattr(F, "ScalingType")
        and torch.cuda.get_device_capability(device) == (9, 0)
    )


def prepare_weight_scales(w_scale_inv: torch.Tensor) -> torch.Tensor:
    """A weight's block scales [N/128, K/128] as scaled_mm_blockwise takes them: K/128 padded to a multiple
    of 4 (padding never read: K is whole blocks), returned transposed, [K'/128, N/128]."""
    kb = w_scale_inv.shape[1]
    return torch.nn.functional.pad(w_scale_inv.float(), (0, -kb % CUBLAS_ROWS_TO)).contiguous().t()


def scaled_mm_blockwise(
    x: torch.Tensor,
    w8: torch.Tensor,
    w_scale_t: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [..., K] through an FP8 weight [N, K] (K and N multiples of 128) with prepare_weight_scales'
    scales, by cuBLAS: x quantized per token group of 128 (per_token_group_quant, column-major scales),
    torch.nn.functional.scaled_mm, the bias added after; in x's dtype. act: x is [..., 2K], [gate | up],
    and the input is act(gate) * up, computed in the quantizing pass. quantized: x's quantization made
    already (per_token_group_quant(x2, rows_to=CUBLAS_ROWS_TO)'s, as fp8_linear takes it)."""
    import torch.nn.functional as F

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m = x2.shape[0]
    if quantized is not None:
        a8, a_scale = quantized
    else:
        a8, a_scale = per_token_group_quant(x2, rows_to=CUBLAS_ROWS_TO, act=act)
    out = F.scaled_mm(
        a8, w8.t(), a_scale, F.ScalingType.BlockWise1x128, w_scale_t, F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )[:m]  # fmt: skip
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], w8.shape[0])
