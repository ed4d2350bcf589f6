"""Batch-invariant matrix product (Triton): C = A @ B (+ bias), where a row of C is bit-identical
whatever the number of rows M of A.

cuBLAS picks its kernel, tile shape and split-K per problem shape, M included, so a row's rounding
changes with the batch it is in. Here everything that decides a row's arithmetic is a function of
(N, K) alone (`matmul_config`): the tile shape, the K step, the split of K into SPLIT_K ranges, the
order of the K loop (ascending, one float32 accumulator per output and range) and of the reduction of
the ranges (a second kernel adds them in index order), the launch's warps and stages. M only decides
how many row tiles run, and M is never specialized on, so every M runs the same compiled code. A row
sits at a varying offset inside its row tile; the matmul units round each output element from its own
row and column alone (tests/pdkernels/test_kernels_bi_gpu.py checks rows bit for bit across M).

One configuration must serve a decode step (M of 1 to a few hundred, bound by reading B) and a
prefill chunk (M in the thousands, bound by arithmetic), where cuBLAS would pick differently for each.
Narrow weights (q/k/v, o, down projections of an 8B model: 32-48 column tiles) would leave most of the
GPU idle in a decode step, so they split K: more programs read B at once, for the price of a float32
partial per range and output (bench/micro/prefill_kernels.py measures both regimes against cuBLAS).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from pdkernels import pdl
from pdkernels.fused_ops import pdl_start

BLOCK_M = 64  # rows per tile: every M runs the same tile, so this is fixed
TARGET_PROGRAMS = 264  # about two programs per multiprocessor of an H100/H200 (132)
MIN_SPLIT_STEPS = 16  # K steps per range at least: shorter loops do not pipeline


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    group_m: int = 8  # row tiles swept per column band (L2 reuse; the order changes no result)


@cache
def matmul_config(n: int, k: int) -> MatmulConfig:
    """The launch configuration for B of shape [K, N]: a function of (N, K) only, never of M."""
    block_n, block_k = 128, 64
    tiles_n = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    split = 1
    while split < 8 and tiles_n * split * 2 <= TARGET_PROGRAMS and steps // (split * 2) >= MIN_SPLIT_STEPS:
        split *= 2
    return MatmulConfig(BLOCK_M, block_n, block_k, num_warps=4, num_stages=4, split_k=split)


@triton.jit(do_not_specialize=["M"])
def _bi_matmul_kernel(
    A, B, C, BIAS, M, N, K, k_per_split,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cs, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * num_n
    first_m = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % rows_in_band
    pid_n = (pid % band) // rows_in_band

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M  # rows past M are neither read nor stored
    cols = offs_n % N  # columns past N read valid columns again (wrapped) and are never stored
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + (k_lo + offs_k)[None, :] * stride_ak
    b_ptrs = B + (k_lo + offs_k)[:, None] * stride_bk + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_ok = k0 + offs_k < k_hi
            a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = C + split * stride_cs + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    c_mask = mask_m[:, None] & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + cols).to(tl.float32)[None, :]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)
    else:  # a float32 partial per range; _reduce_splits_kernel adds them
        tl.store(c_ptrs, acc, mask=c_mask)


@triton.jit
def _reduce_splits_kernel(P, C, BIAS, N, stride_ps, stride_pm, stride_cm,
                          HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.load(P + row * stride_pm + offs, mask=mask, other=0.0)
    # NOTE: ranges add in index order, always: the sum's order is a function of (N, K) alone.
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(P + s * stride_ps + row * stride_pm + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(C + row * stride_cm + offs, acc.to(C.dtype.element_ty), mask=mask)


def bi_matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, config: MatmulConfig | None = None
) -> torch.Tensor:
    """a: [M, K]; b: [K, N] (any strides: a linear layer passes weight.t()); bias: [N]. Returns [M, N]
    in a's dtype. `config` overrides matmul_config (benchmarks and tests only: another configuration
    rounds differently)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_() if bias is None else c.copy_(bias.expand(m, n))
    cfg = config or matmul_config(n, k)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    split = cfg.split_k
    dst = c if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    _bi_matmul_kernel[grid](
        a, b, dst, bias if bias is not None else c, m, n, k, k_per_split,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        dst.stride(0) if split > 1 else 0, dst.stride(-2), dst.stride(-1),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0 and k_per_split * split == k,
        IEEE=a.dtype == torch.float32, SPLIT_K=split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PDL=pdl.active(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl.active(),
    )
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _reduce_splits_kernel[(m, triton.cdiv(n, block))](
            dst, c, bias if bias is not None else c, n, dst.stride(0), dst.stride(1), c.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=block, PDL=pdl.active(), num_warps=4,
            launch_pdl=pdl.active(),
        )
    return c


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) through bi_matmul; x: [..., K], weight: [N, K]."""
    out = bi_matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias)
    return out.view(*x.shape[:-1], weight.shape[0])
