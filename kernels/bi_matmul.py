"""Batch-invariant matrix product (Triton): C = A @ B (+ bias), where a row of C is bit-identical
whatever the number of rows M of A.

cuBLAS picks its kernel, tile shape and split-K per problem shape, M included, so a row's rounding
changes with the batch it is in. Here everything that decides a row's arithmetic is a function of
(N, K) alone (`matmul_config`): the tile shape, the K step and its order (ascending, one float32
accumulator per output, no split-K), the launch's warps and stages. M only decides how many row tiles
run, and M is never specialized on, so every M runs the same compiled code. A row sits at a varying
offset inside its row tile; the matmul units round each output element from its own row and column
alone (tests/test_kernels_bi_gpu.py checks rows bit for bit across M).

The price is speed: one configuration must serve a decode step (M of 1 to a few hundred, bound by
reading B) and a prefill chunk (M in the thousands, bound by arithmetic), where cuBLAS would pick
differently for each. bench/bench_prefill_kernels.py measures both against cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # rows per tile: every M runs the same tile, so this is fixed


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles swept per column band (L2 reuse; the order changes no result)


@cache
def matmul_config(n: int, k: int) -> MatmulConfig:
    """The launch configuration for B of shape [K, N]: a function of (N, K) only, never of M.
    Narrow outputs get narrower column tiles, so that a decode step still spreads B's bytes over
    most of the GPU's multiprocessors."""
    block_n = 128 if n >= 16384 else 64
    return MatmulConfig(BLOCK_M, block_n, 64, num_warps=4, num_stages=4)


@triton.jit(do_not_specialize=["M"])
def _bi_matmul_kernel(
    A, B, C, BIAS, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
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
    # Rows past M and columns past N read valid rows/columns again (wrapped); they are never stored.
    rows = offs_m % M
    cols = offs_n % N
    a_ptrs = A + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + offs_k[:, None] * stride_bk + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(BIAS + cols).to(tl.float32)[None, :]
    c_ptrs = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def bi_matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, config: MatmulConfig | None = None
) -> torch.Tensor:
    """a: [M, K]; b: [K, N] (any strides: a linear layer passes weight.t()); bias: [N]. Returns [M, N]
    in a's dtype. `config` overrides matmul_config (benchmarks only: it gives up the invariance
    across calls with different configs)."""
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
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _bi_matmul_kernel[grid](
        a, b, c, bias if bias is not None else c, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, IEEE=a.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) through bi_matmul; x: [..., K], weight: [N, K]."""
    out = bi_matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias)
    return out.view(*x.shape[:-1], weight.shape[0])
