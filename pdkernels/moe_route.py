"""A MoE layer's routing after its router's logits, in two launches (Triton) instead of torch's ~20
small kernels (softmax, top-k and its sort, the renormalization, the casts, the expert counters, the
stable sort of the assignments and its searchsorted), which at batch 1 took about a quarter of a
Qwen3-30B-A3B-shaped decode step on an H100 (bench/micro/profile_decode.py):

    route(logits, top_k, norm_topk_prob, softmax_first, counts)
        one program per token: Qwen3-MoE's softmax over every expert then top-k (renormalized when
        norm_topk_prob), or gpt-oss's top-k of the logits then softmax over those k; float32 inside,
        the weights in the logits' dtype, ids int64, in descending order of weight; `counts`
        [num_experts] int64 gets each chosen expert's assignments added (atomics of integers: exact)
    align(topk_ids, first_expert, num_local)
        moe_gemm.py's _sort_assignments for up to MAX_ALIGN assignments in one program: the stable
        sort of the flattened (token, slot) assignments by local expert (other experts' after them)
        and each local expert's first row, by counting: an assignment's place is the number of
        assignments with a smaller id plus those with its id before it

Both are the torch path's results: align's bit for bit (integers), route's up to the rounding of
float32 exp and sums, with the same experts in the same order where no two scores tie (ties go to the
lower expert id; torch.topk's order among equals is its own). A token's routing is one program's and
depends on no other row: batch-invariant by construction, so deterministic mode takes it at every
batch size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdkernels import pdl
from pdkernels.fused_ops import pdl_start

MAX_ALIGN = 256  # assignments align() sorts in one program (its compares grow as the square); beyond, torch.sort
_ALIGN_CHUNK = 32  # assignments compared against all others per step of align's loop


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, counts_ptr, num_experts, stride,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    SOFTMAX_FIRST: tl.constexpr, NORM: tl.constexpr, COUNT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    live = e < num_experts
    x = tl.load(logits_ptr + t * stride + e, mask=live, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("inf"))  # a NaN ranks first, as torch.topk ranks it (never an id past E)
    if SOFTMAX_FIRST:
        ex = tl.where(live, tl.exp(x - tl.max(x, axis=0)), 0.0)
        cur = ex / tl.sum(ex, axis=0)
    else:
        cur = x
    cur = tl.where(cur == cur, cur, float("inf"))  # (a softmax over a NaN or infinite logit is all NaN)
    slot = tl.arange(0, BLOCK_K)
    vals = tl.full([BLOCK_K], float("-inf"), tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    free = live
    for s in tl.static_range(TOP_K):  # the largest not yet taken, the lowest id among equals
        best = tl.max(tl.where(free, cur, float("-inf")), axis=0)
        pick = tl.min(tl.where(free & (cur == best), e, BLOCK_E), axis=0)
        vals = tl.where(slot == s, best, vals)
        ids = tl.where(slot == s, pick, ids)
        free = free & (e != pick)
    chosen = slot < TOP_K
    if SOFTMAX_FIRST:
        if NORM:
            vals = vals / tl.sum(tl.where(chosen, vals, 0.0), axis=0)
    else:
        ex = tl.where(chosen, tl.exp(vals - tl.max(vals, axis=0)), 0.0)
        vals = ex / tl.sum(ex, axis=0)
    tl.store(weights_ptr + t * TOP_K + slot, vals.to(weights_ptr.dtype.element_ty), mask=chosen)
    tl.store(ids_ptr + t * TOP_K + slot, ids.to(tl.int64), mask=chosen)
    if COUNT:
        tl.atomic_add(counts_ptr + ids, tl.full([BLOCK_K], 1, tl.int64), mask=chosen)


def route(
    logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    softmax_first: bool,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] in logits' dtype, expert ids [T, top_k] int64): softmax_first,
    engine/layers/moe.py's route_softmax_topk (norm_topk_prob: renormalized over the k); else its
    route_topk_softmax. counts [E] int64: each chosen expert's count grows by its assignments. Queued
    only (no host sync)."""
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if counts is not None and (counts.shape != (num_experts,) or counts.dtype != torch.int64):
        raise ValueError(f"counts must be int64 [{num_experts}], got {counts.dtype} {tuple(counts.shape)}")
    logits = logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, weights, ids, counts if counts is not None else ids, num_experts, logits.stride(0),
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(num_experts),
            SOFTMAX_FIRST=softmax_first, NORM=norm_topk_prob, COUNT=counts is not None, PDL=pdl.active(),
            num_warps=1, launch_pdl=pdl.active(),
        )  # fmt: skip
    return weights, ids


@triton.jit
def _align_kernel(
    ids_ptr, order_ptr, offsets_ptr, n, first_expert, num_local,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(PDL)
    i = tl.arange(0, BLOCK_N)
    live = i < n
    mine = tl.load(ids_ptr + i, mask=live, other=0) - first_expert
    # other experts' (and -1, padding) to num_local, after the local ones; past n: never counted
    mine = tl.where((mine >= 0) & (mine < num_local), mine, num_local)
    mine = tl.where(live, mine, num_local + 1)
    e = tl.arange(0, BLOCK_E)
    place = tl.zeros([BLOCK_N], dtype=tl.int32)  # assignments before mine in the sorted order
    below = tl.zeros([BLOCK_E], dtype=tl.int32)  # assignments whose id is below e
    for c in range(0, BLOCK_N, CHUNK):  # (past n: masked)
        j = c + tl.arange(0, CHUNK)
        theirs = tl.load(ids_ptr + j, mask=j < n, other=0) - first_expert
        theirs = tl.where((theirs >= 0) & (theirs < num_local), theirs, num_local)
        theirs = tl.where(j < n, theirs, num_local + 1)
        before = (theirs[None, :] < mine[:, None]) | ((theirs[None, :] == mine[:, None]) & (j[None, :] < i[:, None]))
        place += tl.sum(before.to(tl.int32), axis=1)
        below += tl.sum((theirs[None, :] < e[:, None]).to(tl.int32), axis=1)
    tl.store(order_ptr + place, i.to(tl.int64), mask=live)
    tl.store(offsets_ptr + e, below, mask=e <= num_local)


def align(topk_ids: torch.Tensor, first_expert: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """moe_gemm.py's _sort_assignments in one launch: (order [T*k] int64, expert_offsets [num_local + 1]
    int32), or None for more than MAX_ALIGN assignments (the caller sorts with torch). No host sync."""
    ids = topk_ids.reshape(-1)
    n = ids.numel()
    if n > MAX_ALIGN:
        return None
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    offsets = torch.empty(num_local + 1, dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](
        ids.contiguous(), order, offsets, n, first_expert, num_local,
        BLOCK_N=max(16, triton.next_power_of_2(n)), BLOCK_E=max(16, triton.next_power_of_2(num_local + 1)),
        CHUNK=_ALIGN_CHUNK, PDL=pdl.active(), num_warps=4, launch_pdl=pdl.active(),
    )  # fmt: skip
    return order, offsets
