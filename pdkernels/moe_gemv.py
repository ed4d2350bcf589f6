"""Expert products for a decode step's few tokens (Triton): one matrix-vector product per (token, slot)
assignment, straight from the routing, without sorting the assignments by expert.

At batch 1 a MoE layer reads k experts' weights once each. The grouped GEMM (moe_gemm.py) first sorts
the assignments (one more launch), then pads each expert's one row to a 16-row tl.dot tile and stages
every weight tile through shared memory; neither is needed here. Measured on an H100 (bench/figures/moe-h200.md,
"MoE models"): 1-11% faster per layer at 1 to 4 tokens, equal at 8. Here program (r, j) owns
assignment r (token r // k, slot r % k) and BLOCK_N output columns of its expert's weight, and walks K
with gemv.py's register layout: elementwise FMAs, each thread one 16-byte run of K in each of the tile's
weight rows, the matching piece of x one 16-byte load, the sum across threads once after the K loop.

    assignments r   | t0 s0 | t0 s1 | ... | t0 s(k-1) | t1 s0 | ...     (rows of h and y)
    program (r, j)  expert ids[r]'s weight rows [j BLOCK_N, (j + 1) BLOCK_N), times x[r // x_div]

An expert picked by two tokens of the step is read twice, so fused_moe takes this path only up to a few
tokens (moe_gemm.MAX_GEMV_TOKENS), where the picks rarely meet. Assignments to experts outside the local
range (another rank's, or a padding slot's -1) exit at once and store nothing: the combine skips them.

"swiglu" / "swiglu_oai" (the gate/up projection): the weight holds gate rows [0, N) then up rows
[N, 2N); a program keeps one float32 accumulator for each and stores the activation of (gate + bias,
up + bias) rounded to x's dtype, as the grouped kernel's epilogue does. FP8 weights (float8_e4m3fn with
128x128 block scales): each thread's 16-element run lies in one block, so its partial sum is scaled once
in float32 (weights-only FP8, x stays in its dtype). Not batch-invariant (a row's sum follows the tile
shape): deterministic mode keeps the grouped GEMM's batch-invariant tiles. Launched with programmatic
dependent launch when the forward's kernels are (pdkernels/pdl.py); K is compiled in (a runtime loop
bound does not run under Triton's interpreter with numpy 2.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from pdkernels import pdl
from pdkernels.fused_ops import pdl_start
from pdkernels.gemv import _load_k

ACTIVATIONS = {None: 0, "swiglu": 1, "swiglu_oai": 2}
SCALE_BLOCK = 128  # FP8 expert weights' scale block (engine/layers/fp8.py BLOCK)
TARGET_PROGRAMS = 264  # two programs per multiprocessor of an H200 at least


@dataclass(frozen=True)
class MoeGemvConfig:
    block_n: int  # output columns per program (a GLU's gate and up columns each), a power of two
    block_k: int  # one 16-byte run per thread and weight row: 16 bytes * 32 * num_warps
    num_warps: int


@cache
def moe_gemv_config(n: int, k: int, num_rows: int, is_glu: bool, elem_bytes: int) -> MoeGemvConfig:
    """The launch configuration for [N, K] expert weights (a GLU's gate and up: N each) of elem_bytes-wide
    elements and num_rows assignments. gemv.gemv_config's reasoning: BLOCK_N 16 weight rows per program
    (a GLU's 8 gate + 8 up rows), half that for FP8 (16 elements a run: twice the products), halved while
    the grid would leave multiprocessors without a second program."""
    vec = 16 // elem_bytes
    num_warps = min(4, triton.next_power_of_2(triton.cdiv(k, vec * 32)))
    block_n = max(1, (8 if is_glu else 16) * elem_bytes // 2)
    while block_n > 1 and num_rows * triton.cdiv(n, block_n) < TARGET_PROGRAMS:
        block_n //= 2
    return MoeGemvConfig(block_n, vec * 32 * num_warps, num_warps)


@triton.jit
def _dot_rows(w_ptrs, x, k_ok, s_ptrs, s_ok, EVEN_K: tl.constexpr, HAS_SCALE: tl.constexpr):
    """[BLOCK_K // VEC, BLOCK_N] partial sums: each thread's VEC products of a weight row and x, summed
    in registers (then scaled by its run's FP8 block scale, read at s_ptrs)."""
    w = _load_k(w_ptrs, k_ok[:, None, :], EVEN_K)
    part = tl.sum(w * x[:, None, :], axis=2)
    if HAS_SCALE:
        part = part * tl.load(s_ptrs, mask=s_ok, other=0.0)
    return part


@triton.jit
def _moe_gemv_kernel(
    X, IDS, W, BIAS, OUT, SCALE, first_expert, num_experts, N, alpha, limit,
    stride_x, stride_we, stride_wn, stride_be, stride_o, stride_se, stride_sn,
    K: tl.constexpr, X_DIV: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    row = tl.program_id(0)
    expert = tl.load(IDS + row) - first_expert
    if (expert < 0) | (expert >= num_experts):  # another rank's expert, or a padding slot
        return
    expert = expert.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = tl.minimum(offs_n, N - 1)  # columns past N read row N - 1 again and are never stored
    kk = tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    w_rows = W + expert * stride_we + n_rows.to(tl.int64) * stride_wn
    w_ptrs = kk[:, None, :] + w_rows[None, :, None]
    up_ptrs = w_ptrs + N * stride_wn  # a GLU's up rows follow its N gate rows
    x_row = X + (row // X_DIV).to(tl.int64) * stride_x
    # a weight row's row of block scales (FP8), and each thread's run's block column within the K step
    chunks = tl.arange(0, BLOCK_K // VEC) * VEC
    s_rows = SCALE + expert * stride_se + (n_rows // SCALE_BLOCK) * stride_sn
    s_up_rows = SCALE + expert * stride_se + ((n_rows + N) // SCALE_BLOCK) * stride_sn
    acc = tl.zeros((BLOCK_K // VEC, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_K // VEC, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + kk < K
        x = _load_k(x_row + k0 + kk, k_ok, EVEN_K)
        s_cols = ((k0 + chunks) // SCALE_BLOCK)[:, None]
        s_ok = (k0 + chunks < K)[:, None]
        acc += _dot_rows(w_ptrs + k0, x, k_ok, s_rows[None, :] + s_cols, s_ok, EVEN_K, HAS_SCALE)
        if ACT != 0:
            acc_up += _dot_rows(up_ptrs + k0, x, k_ok, s_up_rows[None, :] + s_cols, s_ok, EVEN_K, HAS_SCALE)
    y = tl.sum(acc, axis=0)
    n_ok = offs_n < N
    if HAS_BIAS:  # added in float32, before the activation
        b_expert = BIAS + expert * stride_be
        y += tl.load(b_expert + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if ACT != 0:
        up = tl.sum(acc_up, axis=0)
        if HAS_BIAS:
            up += tl.load(b_expert + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if ACT == 1:  # silu(gate) * up
            y = y * tl.sigmoid(y) * up
        else:  # gpt-oss: clamped gate and up, (up + 1) * gate * sigmoid(alpha * gate)
            gate = tl.minimum(y, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            y = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    tl.store(OUT + row.to(tl.int64) * stride_o + offs_n, y.to(OUT.dtype.element_ty), mask=n_ok)


def expert_gemv(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w: torch.Tensor,
    x_div: int,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    first_expert: int = 0,
    alpha: float = 1.702,
    limit: float = 7.0,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """topk_ids [T, k] (global expert ids), w [E_local, N, K] (float8_e4m3fn with w_scale [E_local, N/128,
    K/128]), x [R, K] with R * x_div = T * k -> [T * k, N'] (N' = N / 2 for a GLU): row r is x[r // x_div]
    times w[ids[r] - first_expert].T (+ bias, then the activation, as moe_gemm.grouped_matmul's are
    defined). Rows whose expert is not local are left unspecified. One launch, no host sync."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}: one of {sorted(map(str, ACTIVATIONS))}")
    num_experts, n, k = w.shape
    num_rows = topk_ids.numel()
    if x.dim() != 2 or x.shape[1] != k or x.shape[0] * x_div != num_rows:
        raise ValueError(f"rows {tuple(x.shape)} (each for {x_div} assignments) do not fit experts "
                         f"{tuple(w.shape)} and {num_rows} assignments")  # fmt: skip
    if not w.is_contiguous():
        raise ValueError("expert_gemv needs contiguous [E, N, K] expert weights")
    is_glu = activation is not None
    n_out = n // 2 if is_glu else n
    if bias is not None and (bias.shape != (num_experts, n) or bias.stride(1) != 1):
        raise ValueError(f"bias must be [{num_experts}, {n}] with unit column stride, got {tuple(bias.shape)}")
    if w_scale is not None:
        blocks = (num_experts, triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK))
        if w.dtype != torch.float8_e4m3fn or w_scale.shape != blocks or w_scale.stride(2) != 1:
            raise ValueError(f"FP8 experts need float8_e4m3fn weights and block scales {blocks}")
    elif w.dtype != x.dtype:
        raise ValueError(f"expert weights {w.dtype} and rows {x.dtype} differ (FP8 weights need their scales)")
    out = torch.empty((num_rows, n_out), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n_out == 0:
        return out
    cfg = moe_gemv_config(n_out, k, num_rows, is_glu, w.element_size())
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1)
    _moe_gemv_kernel[(num_rows, triton.cdiv(n_out, cfg.block_n))](
        x, ids, w, bias if bias is not None else w, out, w_scale if w_scale is not None else w,
        first_expert, num_experts, n_out, float(alpha), float(limit),
        x.stride(0), w.stride(0), w.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0),
        *(w_scale.stride()[:2] if w_scale is not None else (0, 0)),
        K=k, X_DIV=x_div, ACT=ACTIVATIONS[activation], HAS_BIAS=bias is not None, HAS_SCALE=w_scale is not None,
        EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=16 // w.element_size(),
        SCALE_BLOCK=SCALE_BLOCK, PDL=pdl.active(), num_warps=cfg.num_warps, launch_pdl=pdl.active(),
    )
    return out
