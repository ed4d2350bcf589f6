"""Grouped GEMM for mixture-of-experts layers (Triton): every expert's rows in one launch, with the
SwiGLU of the gate/up projection computed in the epilogue, and a deterministic combine.

    moe_align       the T*k (token, slot) assignments sorted (stably) by local expert, and each
                    expert's row range in that order (pdkernels/moe_route.py's align in decode)
    grouped_matmul  rows expert_offsets[e]:expert_offsets[e+1] of x times w[e].T (+ bias[e]), one
                    launch over all experts; "swiglu"/"swiglu_oai" fuse the activation
    fused_moe       align; gate/up, the token gather fused into its loads; down, each row stored at
                    its assignment's (token, slot) place; the weighted sum over a token's slots (up to
                    MAX_GEMV_TOKENS tokens: both products as moe_gemv.py's GEMVs, no align)

Row tiles never straddle two experts: expert e owns ceil(rows_e / BLOCK_M) consecutive row tiles,
starting at its first row, so a row's place in its tile is its rank among the expert's rows.

  sorted rows    | e0 e0 e0 e0 e0 | e2 | e5 e5 |        (BLOCK_M = 4; experts 1, 3, 4 got no row)
  row tiles      [ t0    ][t1     ][t2 ][t3    ][t4 ... (t4 onwards: past the last tile, exit)

The grid is a host-side upper bound on that tile count, M // BLOCK_M + min(E, M), times the column
tiles; each program finds its expert from the offsets on the device (a cumulative sum over the E
tile counts), so no step of grouped_matmul or fused_moe waits on the host and both can be captured
in a CUDA graph. fused_moe sizes its buffers for all T*k assignments for the same reason: with a
local expert subset (expert parallelism) the rows of other ranks' experts are allocated, not computed.

Batch invariance (batch_invariant=True): the tile shape, K step, loop order and launch configuration
are a function of (N, K) alone (`bi_config`), the K loop runs in one program in ascending order with
one float32 accumulator per output (no split-K), and the only argument that varies with M (the tile
bound) is never specialized on. The combine adds a token's k slots in slot order in float32. So a
token's output is bit-identical whatever else is in the batch, as bi_matmul.py argues for one matrix.
The default path picks its tiles from the average rows per expert (small BLOCK_M in decode).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdkernels import moe_gemv, moe_route, pdl
from pdkernels.fused_ops import pdl_start

ACTIVATIONS = {None: 0, "swiglu": 1, "swiglu_oai": 2}
SCALE_BLOCK = 128  # FP8 expert weights' scale block (engine/layers/fp8.py BLOCK): BLOCK_K never exceeds it
MAX_GEMV_TOKENS = 4  # fused_moe's default: up to this many tokens, one GEMV per assignment (moe_gemv.py)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int  # output columns per program (for a GLU: gate and up tiles of this width each)
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles swept per column band (L2 reuse; the order changes no result)


def _fit(block: int, size: int) -> int:
    """A tile edge no wider than the dimension needs, 16 at least (tl.dot's minimum)."""
    return max(16, min(block, triton.next_power_of_2(max(size, 1))))


@cache
def bi_config(n: int, k: int, is_glu: bool) -> GemmConfig:
    """The batch-invariant configuration for output width n and reduction depth k: never a function of M."""
    block_n = 64 if is_glu else 128  # a GLU program holds two accumulators
    return GemmConfig(64, _fit(block_n, n), _fit(64, k), num_warps=4, num_stages=4)


def gemm_config(
    m: int, num_experts: int, n: int, k: int, is_glu: bool, batch_invariant: bool, fp8_x: bool = False
) -> GemmConfig:
    """The launch configuration for m rows over num_experts experts; by shape unless batch_invariant.
    fp8_x (FP8 x FP8 products, BLOCK_K 128): prefill takes 64-row tiles 128 columns wide, the fastest of
    bench/micro/moe_layer.py --w8a8-sweep at 8,192 tokens of Qwen3-30B-A3B's layer (bench/figures/fp8-h100.md)."""
    if batch_invariant:
        return bi_config(n, k, is_glu)
    rows_per_expert = m / max(1, min(num_experts, m))
    if fp8_x and rows_per_expert > 160:
        cfg = GemmConfig(64, 128, 128, num_warps=8, num_stages=3) if is_glu else GemmConfig(64, 128, 128, 4, 4)
        return replace(cfg, block_n=_fit(cfg.block_n, n), block_k=_fit(cfg.block_k, k))
    if rows_per_expert <= 16:  # decode: bound by reading the weights, so many narrow programs, long K steps
        cfg = GemmConfig(16, 32 if is_glu else 64, 128, num_warps=4, num_stages=4)
    elif rows_per_expert <= 48:
        cfg = GemmConfig(32, 64, 64, num_warps=4, num_stages=4)
    elif rows_per_expert <= 160:
        cfg = GemmConfig(64, 64 if is_glu else 128, 64, num_warps=4, num_stages=4)
    else:  # prefill: bound by arithmetic
        cfg = GemmConfig(128, 64 if is_glu else 128, 64, num_warps=8, num_stages=3)
    return GemmConfig(cfg.block_m, _fit(cfg.block_n, n), _fit(cfg.block_k, k), cfg.num_warps, cfg.num_stages)


@triton.jit(do_not_specialize=["num_row_tiles"])
def _grouped_gemm_kernel(
    X, ROWS, W, BIAS, OUT, OFFS, W_SCALE, X_SCALE, num_row_tiles, num_experts, N, alpha, limit,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om, stride_on,
    stride_se, stride_sn, stride_sk, stride_xsm, stride_xsk,
    K: tl.constexpr, ACT: tl.constexpr, HAS_ROWS: tl.constexpr, GATHER_DIV: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, FP8_X: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * num_n
    first_m = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(num_row_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % rows_in_band
    pid_n = (pid % band) // rows_in_band

    # this row tile's expert: experts own consecutive tiles, ceil(rows / BLOCK_M) each
    e_ids = tl.arange(0, E_POW2)
    e_ok = e_ids < num_experts
    starts = tl.load(OFFS + e_ids, mask=e_ok, other=0)
    ends = tl.load(OFFS + e_ids + 1, mask=e_ok, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    if pid_m >= tl.sum(tiles, 0):
        return
    is_mine = e_ids == tl.sum((tile_ends <= pid_m).to(tl.int32), 0)
    expert = tl.sum(tl.where(is_mine, e_ids, 0), 0)
    row_lo = tl.sum(tl.where(is_mine, starts + (pid_m - tile_ends + tiles) * BLOCK_M, 0), 0)
    row_hi = tl.sum(tl.where(is_mine, ends, 0), 0)

    offs_m = row_lo + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_hi  # rows of the next expert are neither read nor stored
    if HAS_ROWS:
        row_ids = tl.load(ROWS + offs_m, mask=mask_m, other=0).to(tl.int64)
    if GATHER_DIV > 0:  # a gather fused into the loads: row r reads x[ROWS[r] // GATHER_DIV]
        src = row_ids // GATHER_DIV
    else:
        src = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N  # columns past N read valid columns again (wrapped) and are never stored
    offs_k = tl.arange(0, BLOCK_K)
    w_expert = W + expert.to(tl.int64) * stride_we
    a_ptrs = X + src[:, None] * stride_xm + offs_k[None, :] * stride_xk
    b_ptrs = w_expert + offs_k[:, None] * stride_wk + cols[None, :].to(tl.int64) * stride_wn
    up_ptrs = b_ptrs + N * stride_wn  # a GLU's up rows follow its N gate rows
    if HAS_SCALE:  # FP8 weights: each column's row of 128x128 block scales (gate's, then up's)
        s_ptrs = W_SCALE + expert.to(tl.int64) * stride_se + (cols // SCALE_BLOCK) * stride_sn
        s_up_ptrs = W_SCALE + expert.to(tl.int64) * stride_se + ((cols + N) // SCALE_BLOCK) * stride_sn
    if FP8_X:  # FP8 rows too (BLOCK_K is the scale block): each row's scale of each 128-column group
        xs_ptrs = X_SCALE + src * stride_xsm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_ok = k0 + offs_k < K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if FP8_X:  # FP8 x FP8 on the tensor cores, exact in float32, then the row's and the column's scales
            a_s = tl.load(xs_ptrs + (k0 // SCALE_BLOCK) * stride_xsk, mask=mask_m, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * tl.load(s_ptrs + (k0 // SCALE_BLOCK) * stride_sk)[None, :]
        else:
            if HAS_SCALE:  # dequantized in registers to x's dtype (BLOCK_K divides the scale block)
                b = (b.to(tl.float32) * tl.load(s_ptrs + (k0 // SCALE_BLOCK) * stride_sk)[None, :]).to(a.dtype)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if ACT != 0:
            if EVEN_K:
                b_up = tl.load(up_ptrs)
            else:
                b_up = tl.load(up_ptrs, mask=k_ok[:, None], other=0.0)
            if FP8_X:
                s_up = tl.load(s_up_ptrs + (k0 // SCALE_BLOCK) * stride_sk)
                acc_up += tl.dot(a, b_up) * a_s[:, None] * s_up[None, :]
            else:
                if HAS_SCALE:
                    s_up = tl.load(s_up_ptrs + (k0 // SCALE_BLOCK) * stride_sk)
                    b_up = (b_up.to(tl.float32) * s_up[None, :]).to(a.dtype)
                if IEEE:
                    acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K * stride_xk
        b_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:  # added in float32, before the activation
        b_expert = BIAS + expert.to(tl.int64) * stride_be
        acc += tl.load(b_expert + cols * stride_bn).to(tl.float32)[None, :]
        if ACT != 0:
            acc_up += tl.load(b_expert + (cols + N) * stride_bn).to(tl.float32)[None, :]
    if ACT == 1:  # silu(gate) * up
        acc = acc * tl.sigmoid(acc) * acc_up
    elif ACT == 2:  # gpt-oss: clamped gate and up, (up + 1) * gate * sigmoid(alpha * gate)
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    dst = offs_m.to(tl.int64)
    if HAS_ROWS:
        if GATHER_DIV == 0:  # a scatter: row r is stored at row ROWS[r]
            dst = row_ids
    out_ptrs = OUT + dst[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask_m[:, None] & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_kernel(Y, IDS, WTS, OUT, num_tokens, first_expert, num_experts, H, stride_y, stride_o,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    # NOTE: slots add in slot order, always: a token's sum never depends on the batch
    for slot in tl.static_range(TOP_K):
        row = token * TOP_K + slot
        expert = tl.load(IDS + row) - first_expert
        is_local = (expert >= 0) & (expert < num_experts)  # other rows were not computed
        weight = tl.load(WTS + row).to(tl.float32)
        y = tl.load(Y + row * stride_y + offs, mask=mask & is_local, other=0.0).to(tl.float32)
        acc += (y * weight).to(OUT.dtype.element_ty).to(tl.float32)  # the product rounds as torch's does
    tl.store(OUT + token * stride_o + offs, acc.to(OUT.dtype.element_ty), mask=mask)


def _sort_assignments(
    topk_ids: torch.Tensor, first_expert: int, num_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """All T*k assignments sorted by local expert, other experts' after them (token order kept):
    (order [T*k] int64, expert_offsets [num_local + 1] int32). No host sync. Up to moe_route.MAX_ALIGN
    assignments (small decode batches) in one launch of moe_route.align; more with torch's sort (the same
    result)."""
    counted = moe_route.align(topk_ids, first_expert, num_local)
    if counted is not None:
        return counted
    ids = topk_ids.reshape(-1)
    if first_expert:
        ids = ids - first_expert
    # others to num_local, a sentinel that sorts after the local ids: -1 and num_local, mod num_local + 1
    ids = torch.remainder(ids.clamp(-1, num_local), num_local + 1)
    sorted_ids, order = torch.sort(ids, stable=True)
    bounds = torch.arange(num_local + 1, device=ids.device, dtype=ids.dtype)
    return order, torch.searchsorted(sorted_ids, bounds, out_int32=True)  # rows of experts < e


def _local_range(num_experts: int, first_expert: int, num_local: int | None) -> int:
    num_local = num_experts - first_expert if num_local is None else num_local
    if first_expert < 0 or num_local < 1 or first_expert + num_local > num_experts:
        raise ValueError(f"experts [{first_expert}, +{num_local}) are not within {num_experts}")
    return num_local


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, first_expert: int = 0, num_local: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (order [M] int64, expert_offsets [num_local + 1] int32): the flattened
    (token * k + slot) indices of the assignments to experts [first_expert, first_expert + num_local),
    sorted by expert and, within an expert, in token order; local expert e's are
    order[expert_offsets[e]:expert_offsets[e + 1]].
    NOTE: with a local subset, M is known only on the device: one host sync (fused_moe does not call
    this). With every expert local there is none, and M = T * k: an id outside [0, num_experts) (a
    padding slot's -1) then sorts after expert_offsets[-1] instead of being dropped."""
    num_local = _local_range(num_experts, first_expert, num_local)
    order, offsets = _sort_assignments(topk_ids, first_expert, num_local)
    if first_expert == 0 and num_local == num_experts:
        return order, offsets
    return order[: int(offsets[-1])], offsets


def _check_config(config: GemmConfig, batch_invariant: bool, has_scale: bool, fp8_x: bool) -> None:
    """Refuses a given launch configuration that the kernel cannot honour."""
    if batch_invariant:
        raise ValueError("a batch-invariant launch takes bi_config's tiles, not a given config")
    tiles = (config.block_m, config.block_n, config.block_k)
    # a K step never straddles two weight scale blocks; with FP8 rows it is one (one row scale per step)
    fits_scales = not has_scale or (config.block_k == SCALE_BLOCK if fp8_x else SCALE_BLOCK % config.block_k == 0)
    if any(t < 16 or t & (t - 1) for t in tiles) or not fits_scales:
        raise ValueError(f"tiles {tiles}: powers of two from 16, BLOCK_K dividing {SCALE_BLOCK} with FP8 weights "
                         f"and equal to it with FP8 rows")


def _launch_grouped(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    num_rows: int,
    rows: torch.Tensor | None,
    gather_div: int,
    bias: torch.Tensor | None,
    activation: str | None,
    alpha: float,
    limit: float,
    batch_invariant: bool,
    w_scale: torch.Tensor | None = None,
    fp8_x: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """grouped_matmul over num_rows rows. With rows: row r reads x[rows[r] // gather_div] if gather_div,
    else x[r] and its result is stored at row rows[r] (rows: a permutation of range(num_rows)). fp8_x (FP8
    weights, K a multiple of 128): x quantized per row and 128-column group first (fp8_gemm's
    per_token_group_quant), the products in FP8. config: the launch configuration instead of
    gemm_config's (not batch_invariant; with FP8 weights BLOCK_K divides 128, with fp8_x it is 128)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}: one of {sorted(map(str, ACTIVATIONS))}")
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"cannot multiply rows of {tuple(x.shape)} by experts {tuple(w.shape)}")
    num_experts, n, k = w.shape
    if expert_offsets.shape != (num_experts + 1,) or expert_offsets.dtype != torch.int32:
        raise ValueError(f"expert_offsets must be int32 [{num_experts + 1}], got {expert_offsets.dtype} "
                         f"{tuple(expert_offsets.shape)}")
    is_glu = activation is not None
    if is_glu and n % 2:
        raise ValueError(f"a GLU needs gate and up rows: an even N, got {n}")
    n_out = n // 2 if is_glu else n
    if bias is not None and bias.shape != (num_experts, n):
        raise ValueError(f"bias must be [{num_experts}, {n}], got {tuple(bias.shape)}")
    if w_scale is not None:
        blocks = (num_experts, triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK))
        if w.dtype != torch.float8_e4m3fn or w_scale.shape != blocks or (is_glu and n_out % SCALE_BLOCK):
            raise ValueError(f"FP8 experts {tuple(w.shape)} {w.dtype} need float8_e4m3fn weights, block scales "
                             f"{blocks} (got {tuple(w_scale.shape)}) and, for a GLU, gate rows a whole number "
                             f"of {SCALE_BLOCK}-blocks")  # fmt: skip
    elif w.dtype != x.dtype:
        raise ValueError(f"expert weights {w.dtype} and rows {x.dtype} differ (FP8 weights need their scales)")
    if fp8_x and (w_scale is None or k % SCALE_BLOCK or x.stride(1) != 1):
        raise ValueError(f"FP8 rows need FP8 weights with scales and K a multiple of {SCALE_BLOCK} (got K = {k})")
    if config is not None:
        _check_config(config, batch_invariant, w_scale is not None, fp8_x)
    out = torch.empty((num_rows, n_out), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n_out == 0:
        return out
    cfg = config or gemm_config(num_rows, num_experts, n_out, k, is_glu, batch_invariant, fp8_x)
    x_scale = None
    if fp8_x:  # one scale per K step: BLOCK_K is the scale block
        from pdkernels.fp8_gemm import per_token_group_quant

        x, x_scale = per_token_group_quant(x)
        cfg = replace(cfg, block_k=SCALE_BLOCK)
    # each expert's tiles start at its first row: at most one partial tile per expert with rows
    num_row_tiles = num_rows // cfg.block_m + min(num_experts, num_rows)
    grid = (num_row_tiles * triton.cdiv(n_out, cfg.block_n),)
    _grouped_gemm_kernel[grid](
        x, rows if rows is not None else expert_offsets, w, bias if bias is not None else w, out,
        expert_offsets, w_scale if w_scale is not None else w, x_scale if x_scale is not None else w,
        num_row_tiles, num_experts, n_out, float(alpha),
        float(limit), x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        out.stride(0), out.stride(1), *(w_scale.stride() if w_scale is not None else (0, 0, 0)),
        *(x_scale.stride() if x_scale is not None else (0, 0)), K=k,
        ACT=ACTIVATIONS[activation], HAS_ROWS=rows is not None, GATHER_DIV=gather_div,
        HAS_BIAS=bias is not None, HAS_SCALE=w_scale is not None, FP8_X=fp8_x, SCALE_BLOCK=SCALE_BLOCK,
        EVEN_K=k % cfg.block_k == 0, IEEE=x.dtype == torch.float32 and not fp8_x,
        E_POW2=max(2, triton.next_power_of_2(num_experts)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PDL=pdl.active(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl.active(),
    )
    return out


def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    batch_invariant: bool = False,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (rows sorted by expert), w [E, N, K] (float8_e4m3fn with w_scale [E, N/128, K/128]: each
    weight tile dequantized to x's dtype in registers before its product), expert_offsets [E + 1] int32 (non-decreasing, on
    x's device, expert_offsets[E] <= M), bias [E, N]. Rows expert_offsets[e]:expert_offsets[e + 1] of
    the result are x's rows times w[e].T (+ bias[e]); rows past expert_offsets[E] are left unspecified.
    activation None: [M, N]. "swiglu" / "swiglu_oai": w[e] holds gate rows [0, N/2) then up rows
    [N/2, N); the result is [M, N/2], the activation of (gate, up) taken from float32 accumulators
    after the bias. One launch, no host sync."""
    return _launch_grouped(x, w, expert_offsets, x.shape[0], None, 0, bias, activation, alpha, limit,
                           batch_invariant, w_scale)


def _check_moe_shapes(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
    w_down: torch.Tensor, activation: str,
) -> None:
    if activation not in ("swiglu", "swiglu_oai"):
        raise ValueError(f"an MoE layer's activation is 'swiglu' or 'swiglu_oai', got {activation!r}")
    t, h = x.shape
    e, two_i, h_gu = w_gate_up.shape
    if h_gu != h or w_down.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"expert weights {tuple(w_gate_up.shape)} and {tuple(w_down.shape)} do not fit "
                         f"hidden size {h}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"routing {tuple(topk_ids.shape)} / {tuple(topk_weights.shape)} for {t} tokens")


def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "swiglu",
    first_expert: int = 0,
    batch_invariant: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    fp8_activations: bool = False,
    gemv_tokens: int = MAX_GEMV_TOKENS,
    configs: tuple[GemmConfig, GemmConfig] | None = None,
) -> torch.Tensor:
    """x [T, H], topk_ids / topk_weights [T, k] (global expert ids), w_gate_up [E_local, 2I, H] (gate
    rows, then up rows), w_down [E_local, H, I], biases [E_local, 2I] / [E_local, H] (FP8 weights with
    their 128x128 block scales w_*_scale, as grouped_matmul takes them) -> [T, H]: each
    token's sum over its slots of weight * expert(x), for the slots whose expert is in [first_expert,
    first_expert + E_local); other slots (and ids < 0: padding) add nothing, and a token with none gets
    zeros. No host sync: a CUDA graph can capture it.

    fp8_activations (FP8 weights; H and I multiples of 128): x and the activation h quantized per row and
    128-column group (two more launches) and both projections multiplied in FP8 (the anchors' w8a8 block
    scheme), instead of each FP8 weight tile dequantized to x's dtype: faster once an expert has many
    rows (bench/micro/moe_layer.py --fp8; the engine takes it where its dense FP8 products quantize x).

    gemv_tokens: up to this many tokens (not batch_invariant, not fp8_activations) each assignment's two
    products run as matrix-vector products straight from the routing (moe_gemv.py: no sort, no tensor-core
    tiles padded to 16 rows); 0 keeps the grouped GEMM at every size.

    configs: the gate/up and the down grouped GEMMs' launch configurations instead of gemm_config's (a
    tile sweep's, bench/micro/moe_layer.py --w8a8-sweep): the grouped GEMM at every size, not with
    batch_invariant; with fp8_activations BLOCK_K is 128."""
    _check_moe_shapes(x, topk_ids, topk_weights, w_gate_up, w_down, activation)
    num_tokens, hidden = x.shape
    top_k, num_local = topk_ids.shape[1], w_gate_up.shape[0]
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    if num_tokens <= gemv_tokens and not (batch_invariant or fp8_activations or configs):
        # row r = token * k + slot: gate/up reads token r // k, down reads h's row r
        h = moe_gemv.expert_gemv(x, topk_ids, w_gate_up, top_k, b_gate_up, activation, first_expert, alpha,
                                 limit, w_gate_up_scale)  # fmt: skip
        y = moe_gemv.expert_gemv(h, topk_ids, w_down, 1, b_down, None, first_expert, alpha, limit, w_down_scale)
    else:
        order, offsets = _sort_assignments(topk_ids, first_expert, num_local)
        num_rows = order.shape[0]
        # gate/up reads token order[r] // k; down stores row r at order[r], the (token, slot) it belongs to
        gate_up_config, down_config = configs or (None, None)
        h = _launch_grouped(x, w_gate_up, offsets, num_rows, order, top_k, b_gate_up, activation, alpha, limit,
                            batch_invariant, w_gate_up_scale, fp8_activations, gate_up_config)
        y = _launch_grouped(h, w_down, offsets, num_rows, order, 0, b_down, None, alpha, limit, batch_invariant,
                            w_down_scale, fp8_activations, down_config)
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, topk_ids.contiguous(), topk_weights.contiguous(), out, num_tokens, first_expert, num_local, hidden,
        y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block, PDL=pdl.active(), num_warps=4,
        launch_pdl=pdl.active(),
    )
    return out


def _fp8_round_trip(t: torch.Tensor) -> torch.Tensor:
    """t [rows, K] quantized as fp8_gemm.per_token_group_quant does (per row and 128-column group: scale
    max(|group|, eps) / 448, values rounded to e4m3), then dequantized to float32."""
    from pdkernels.fp8_gemm import EPS, FP8_MAX, GROUP

    groups = t.float().view(t.shape[0], -1, GROUP)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(EPS) / FP8_MAX
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).view(t.shape)


def _glu(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "swiglu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def fused_moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "swiglu",
    first_expert: int = 0,
    batch_invariant: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """fused_moe in plain torch, a loop over the experts that have tokens (one host sync), with the
    kernels' roundings: float32 products and biases, the activation rounded to x's dtype, the down
    projection rounded, times the weight rounded, slots added in slot order in float32 (fp8_activations:
    x and the activation quantized to FP8 per row and 128-column group first, as fused_moe does; the
    weights given dequantized). batch_invariant is accepted for the signature's sake: torch's own matmul
    picks its kernel by shape."""
    _check_moe_shapes(x, topk_ids, topk_weights, w_gate_up, w_down, activation)
    num_tokens, hidden = x.shape
    top_k, num_local = topk_ids.shape[1], w_gate_up.shape[0]
    ids = topk_ids.reshape(-1).to(torch.int64) - first_expert
    weights = topk_weights.reshape(-1)
    per_slot = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    is_local = (ids >= 0) & (ids < num_local)
    qdq = _fp8_round_trip if fp8_activations else (lambda t: t.float())
    for e in torch.unique(ids[is_local]).tolist():  # NOTE: a host sync
        idx = torch.nonzero(ids == e).squeeze(1)
        gate_up = qdq(x[idx // top_k]) @ w_gate_up[e].float().t()
        if b_gate_up is not None:
            gate_up = gate_up + b_gate_up[e].float()
        gate, up = gate_up.chunk(2, dim=-1)
        h = _glu(gate, up, activation, alpha, limit).to(x.dtype)
        y = qdq(h) @ w_down[e].float().t()
        if b_down is not None:
            y = y + b_down[e].float()
        y = y.to(x.dtype).float() * weights[idx, None].float()
        per_slot[idx] = y.to(x.dtype).float()
    slots = per_slot.view(num_tokens, top_k, hidden)
    total = slots[:, 0]
    for slot in range(1, top_k):
        total = total + slots[:, slot]
    return total.to(x.dtype)
