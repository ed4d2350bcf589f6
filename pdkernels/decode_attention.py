"""Paged decode attention (Triton): one query token per sequence, K/V read in place.

Full-attention layers read a sequence's keys through its block table from the paged pool; sliding
layers read its SWA ring slot. Both caches have the same shape after the layer index,
[units, 2 (k, v), unit_tokens, kv_heads, head_dim], so one kernel serves both: a ring is a "page" of
`window` tokens whose block table is the sequence's state slot.

    full layer, key j:  page = block_table[b, j // block_size], token j % block_size,  j < context_len
    ring,       key j:  slot = block_table[b, 0],               index j,               j < min(context_len, window)

(The ring holds positions [context_len - window, context_len) at index p % window; attention does not
care about key order, only about which keys are visible, and after the new token is stored the ring
holds exactly the window's visible keys.)

One program per (sequence, kv head, split): the query heads of one KV head (GQA) are one tile of
rows, softmax in float32. A sequence's keys are cut into splits that depend on its context length
alone (never on the batch: see `split_bounds`), and a second kernel folds the splits in a fixed order,
so a row's output is bit-identical whether it runs alone or in any batch; deterministic mode uses the
same kernels. A row with context length 0 (a padded row of a CUDA graph) reads and stores nothing
and gets zeros.

Attention sinks (gpt-oss; `sinks` [heads], one logit per query head, in the units of the scaled
scores) join the denominator once: the reduce kernel folds the splits starting from the sink (running
max sink, denominator 1, accumulator 0); the split kernels do not see them. A padded row still gets zeros.

The new token's K/V (position context_len - 1) go into the cache in the same launch: the one program
whose split holds that key stores them and uses them in place of the cache's stale entry, and no other
program reads that key, so nothing races (`store_decode_kv` does the same store as a kernel of its own).

With `rope` (`Rope`) q and the new k arrive straight from the projection: every program norms its
query heads (Qwen 3's and Gemma 3's per-head RMSNorm) and rotates them, and the new key likewise
before it is stored, with fused_ops.qk_rope_'s arithmetic (fused_ops.rope_rows). A few hundred values
per program, against a kernel launch per layer (and for a qk-norm model the norm kernels and their
copies) that a decode step no longer makes.

With PDL (pdkernels/pdl.py) both kernels wait for the kernels before them first thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdkernels import pdl
from pdkernels.fused_ops import pdl_start, rope_rows

MAX_SPLITS = 16  # splits of one sequence's keys, at most
MIN_SPLIT_TOKENS = 128  # a split gets at least this many keys (fewer splits for short contexts)
# A large batch has parallelism enough without short splits: fewer, longer programs pay there, and
# cost at batch 1 (bench/figures/code-choices.md, decode splits). Callers that may let the split depend on the
# batch (not deterministic mode) pass it as min_split.
WIDE_SPLIT_TOKENS = 256
BLOCK_N = 64  # keys per tile
NUM_WARPS, NUM_STAGES = 4, 2  # the split kernel's launch (bench/micro/decode_attn.py sweeps these)
# A tile of keys inside one page (or ring) reads its page id once and addresses its rows from that one
# base; off: the page id is looked up per key (any BLOCK_N). Used only where BLOCK_N divides the page.
PAGE_TILES = True


@dataclass(frozen=True)
class Rope:
    """What the split kernel applies to the rows' q and new k before attending (and storing k): the
    per-head RMSNorm (q_weight / k_weight, None for none) and rotary with the rows' cos / sin ([B, dim])."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0
    is_gemma: bool = False


@triton.jit
def _split_bounds(n, s, MAX_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split s of n keys: [start, end); start >= end means the split is empty. A function of n only."""
    num_splits = tl.minimum(MAX_SPLITS, tl.cdiv(n, MIN_SPLIT))
    split_len = tl.cdiv(tl.cdiv(n, tl.maximum(num_splits, 1)), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(n, start + split_len)
    return num_splits, start, end


@triton.jit
def _num_keys(CTX, b, WINDOW: tl.constexpr):
    n = tl.load(CTX + b)
    if WINDOW > 0:
        n = tl.minimum(n, WINDOW)
    return n


@triton.jit
def _decode_split_kernel(
    Q, K_NEW, V_NEW, KV, BT, CTX, ACC, ML, COS, SIN, QW, KW,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_unit, stride_kv, stride_tok, stride_head,
    stride_btb, stride_c,
    scale, eps,
    WINDOW: tl.constexpr,  # 0: full layer (paged); > 0: ring of this many tokens
    UNIT_TOKENS: tl.constexpr,  # tokens per page (block_size) or per ring (window)
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, IEEE: tl.constexpr,
    HAS_NEW: tl.constexpr, PAGE_TILE: tl.constexpr,  # BLOCK_N divides UNIT_TOKENS: a tile is in one unit
    ROPE: tl.constexpr, QK_NORM: tl.constexpr, IS_GEMMA: tl.constexpr,  # q and k_new arrive before rotary
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    n = _num_keys(CTX, b, WINDOW)
    num_splits, start, end = _split_bounds(n, s, MAX_SPLITS, MIN_SPLIT, BLOCK_N)
    if (s < num_splits) & (start < end):
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_h
        q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        if ROPE:  # every split of the row rotates its own copy of the query heads (a few hundred values)
            q = rope_rows(q_ptrs, offs_d[None, :], mask_h[:, None] & mask_d[None, :], COS + b * stride_c,
                          SIN + b * stride_c, QW, eps, HEAD_DIM, QK_NORM, IS_GEMMA, Q.dtype.element_ty)
        else:
            q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        row = BT + b.to(tl.int64) * stride_btb
        ctx = tl.load(CTX + b)
        j_new = ctx - 1  # the new token's key index
        if WINDOW > 0:
            j_new = j_new % UNIT_TOKENS
        if HAS_NEW:  # [BLOCK_D] each, broadcast per tile below
            k_ptrs = K_NEW + b * stride_kb + kvh * stride_kh + offs_d
            if ROPE:
                k_new = tl.reshape(rope_rows(k_ptrs[None, :], offs_d[None, :], mask_d[None, :], COS + b * stride_c,
                                             SIN + b * stride_c, KW, eps, HEAD_DIM, QK_NORM, IS_GEMMA,
                                             K_NEW.dtype.element_ty), (BLOCK_D,))
            else:
                k_new = tl.load(k_ptrs, mask=mask_d, other=0.0)
            v_new = tl.load(V_NEW + b * stride_vb + kvh * stride_vh + offs_d, mask=mask_d, other=0.0)
            if (start <= j_new) & (j_new < end):  # this program owns the new key: it stores it
                unit_new = tl.load(row + j_new // UNIT_TOKENS)  # a ring's j_new < window: its slot
                dst = KV + unit_new.to(tl.int64) * stride_unit + (j_new % UNIT_TOKENS) * stride_tok + kvh * stride_head
                tl.store(dst + offs_d, k_new, mask=mask_d)
                tl.store(dst + stride_kv + offs_d, v_new, mask=mask_d)
        for j0 in range(start, end, BLOCK_N):
            offs_n = j0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            if PAGE_TILE:  # split starts and tiles are multiples of BLOCK_N, which divides the unit
                unit0 = tl.load(row + j0 // UNIT_TOKENS).to(tl.int64)
                tile = KV + (unit0 * stride_unit + (j0 % UNIT_TOKENS) * stride_tok + kvh * stride_head)
                base = tl.arange(0, BLOCK_N) * stride_tok
                kv_mask = mask_n[:, None] & mask_d[None, :]
                k = tl.load(tile + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            else:
                if WINDOW > 0:
                    unit = tl.load(row + offs_n * 0, mask=mask_n, other=0)
                else:
                    unit = tl.load(row + offs_n // UNIT_TOKENS, mask=mask_n, other=0)
                tile = KV
                base = unit.to(tl.int64) * stride_unit + (offs_n % UNIT_TOKENS) * stride_tok + kvh * stride_head
                kv_mask = mask_n[:, None] & mask_d[None, :]
                k = tl.load(KV + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if HAS_NEW:
                k = tl.where((offs_n == j_new)[:, None], k_new[None, :], k)
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = tl.where(mask_n[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(tile + stride_kv + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if HAS_NEW:
                v = tl.where((offs_n == j_new)[:, None], v_new[None, :], v)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        # partials: ACC [B, heads, MAX_SPLITS, BLOCK_D], ML [B, heads, MAX_SPLITS, 2]
        part = (b.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * MAX_SPLITS + s
        tl.store(ACC + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_h[:, None])
        tl.store(ML + part * 2, m_i, mask=mask_h)
        tl.store(ML + part * 2 + 1, l_i, mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    ACC, ML, CTX, OUT, SINKS,
    stride_ob, stride_oh,
    num_heads,
    WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    n = _num_keys(CTX, b, WINDOW)
    num_splits, _, _ = _split_bounds(n, 0, MAX_SPLITS, MIN_SPLIT, BLOCK_N)
    part0 = (b.to(tl.int64) * num_heads + h) * MAX_SPLITS
    if HAS_SINKS:  # the sink first: max sink, denominator exp(0) = 1, no value
        m = tl.load(SINKS + h).to(tl.float32)
        l_sum = tl.full([], 1.0, dtype=tl.float32)
    else:
        m = tl.full([], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # NOTE: splits fold in index order, always: the sum's order is a function of n alone.
    for s in range(0, num_splits):
        _, start, end = _split_bounds(n, s, MAX_SPLITS, MIN_SPLIT, BLOCK_N)
        if start < end:
            m_s = tl.load(ML + (part0 + s) * 2)
            l_s = tl.load(ML + (part0 + s) * 2 + 1)
            a_s = tl.load(ACC + (part0 + s) * BLOCK_D + offs_d)
            m_new = tl.maximum(m, m_s)
            alpha = tl.exp(m - m_new)
            beta = tl.exp(m_s - m_new)
            l_sum = l_sum * alpha + l_s * beta
            acc = acc * alpha + a_s * beta
            m = m_new
    out = tl.where(l_sum > 0, acc / l_sum, 0.0)  # n == 0 (a padded row): zeros (acc is 0 with a sink)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=mask_d)


def _check_cache(cache: torch.Tensor, layer: int) -> torch.Tensor:
    if cache.dim() != 6:
        raise ValueError(f"cache must be [units, layers, 2, tokens, kv_heads, head_dim], got {tuple(cache.shape)}")
    kv = cache[:, layer]
    if kv.stride(-1) != 1:
        raise ValueError("the cache's head_dim must be contiguous")
    return kv


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    min_split: int | None = None,
    sinks: torch.Tensor | None = None,
    rope: Rope | None = None,
) -> torch.Tensor:
    """q: [B, heads, head_dim], one token per sequence. k_new, v_new ([B, kv_heads, head_dim]): its
    K/V, stored into the cache by this call; without them they must be stored already (store_decode_kv).
    cache: the paged pool (window 0) or the SWA ring pool (window > 0), indexed by `layer`.
    block_table: [B, max_blocks] int32 page ids, or [B, 1] state slots for a ring.
    context_lens: [B] int32, the new token's position + 1; 0 marks a padded row (output zeros).
    min_split: fewest keys per split (default MIN_SPLIT_TOKENS; a multiple of BLOCK_N). A row's output
    depends on it (the splits' float sums), so a batch-invariant caller keeps the default.
    sinks: [heads] attention sink logits (scaled-score units), or None.
    rope: q and k_new are the projection's raw heads; the kernel norms (qk-norm models) and rotates
    them as fused_ops.qk_rope_ would, and stores the rotated k (one launch fewer per layer).
    Returns [B, heads, head_dim] in q's dtype."""
    kv = _check_cache(cache, layer)
    min_split = MIN_SPLIT_TOKENS if min_split is None else min_split
    if min_split < BLOCK_N or min_split % BLOCK_N:
        raise ValueError(f"min_split {min_split} must be a multiple of BLOCK_N {BLOCK_N}")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv.shape[3]
    if num_heads % num_kv_heads or kv.shape[4] != head_dim or q.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache's {num_kv_heads} kv heads x {kv.shape[4]}")
    if window and kv.shape[2] != window:
        raise ValueError(f"ring of {kv.shape[2]} tokens, window {window}")
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.stride(0) != 1):
        raise ValueError(f"sinks must be [{num_heads}] contiguous, got {tuple(sinks.shape)}")
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    has_new = k_new is not None and v_new is not None
    if has_new:
        assert k_new is not None and v_new is not None
        if k_new.shape != (batch, num_kv_heads, head_dim) or k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
            raise ValueError(f"k_new {tuple(k_new.shape)} does not fit q {tuple(q.shape)} and the cache")
    else:
        k_new = v_new = q  # unused
    if rope is not None:
        if not has_new:
            raise ValueError("rope needs k_new: the kernel rotates the new key it stores")
        if rope.cos.shape != (batch, head_dim) or rope.cos.stride() != rope.sin.stride() or rope.cos.stride(-1) != 1:
            raise ValueError(f"rope's cos/sin must be [{batch}, {head_dim}] laid out alike")
    has_norm = rope is not None and rope.q_weight is not None and rope.k_weight is not None
    acc = torch.empty((batch, num_heads, MAX_SPLITS, block_d), dtype=torch.float32, device=q.device)
    ml = torch.empty((batch, num_heads, MAX_SPLITS, 2), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, MAX_SPLITS)](
        q, k_new, v_new, kv, block_table, context_lens, acc, ml,
        rope.cos if rope else q, rope.sin if rope else q,
        rope.q_weight if has_norm else q, rope.k_weight if has_norm else q,  # type: ignore[union-attr]
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        block_table.stride(0), rope.cos.stride(0) if rope else 0,
        scale, rope.eps if rope else 0.0,
        WINDOW=window, UNIT_TOKENS=kv.shape[2],
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=BLOCK_N, MAX_SPLITS=MAX_SPLITS, MIN_SPLIT=min_split, IEEE=q.dtype == torch.float32,
        HAS_NEW=has_new, PAGE_TILE=PAGE_TILES and kv.shape[2] % BLOCK_N == 0,
        ROPE=rope is not None, QK_NORM=has_norm, IS_GEMMA=rope is not None and rope.is_gemma,
        PDL=pdl.active(), num_warps=NUM_WARPS, num_stages=NUM_STAGES, launch_pdl=pdl.active(),
    )
    _decode_reduce_kernel[(batch, num_heads)](
        acc, ml, context_lens, out, sinks if sinks is not None else acc,
        out.stride(0), out.stride(1),
        num_heads,
        WINDOW=window, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=BLOCK_N, MAX_SPLITS=MAX_SPLITS, MIN_SPLIT=min_split, HAS_SINKS=sinks is not None,
        PDL=pdl.active(), num_warps=1, launch_pdl=pdl.active(),
    )
    return out


@triton.jit
def _store_kv_kernel(
    K, V, KV, BT, CTX,
    stride_kb, stride_kh, stride_vb, stride_vh,
    stride_unit, stride_kv, stride_tok, stride_head,
    stride_btb,
    IS_RING: tl.constexpr, UNIT_TOKENS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_KVH: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    ctx = tl.load(CTX + b)
    if ctx > 0:
        pos = ctx - 1
        row = BT + b.to(tl.int64) * stride_btb
        if IS_RING:
            unit = tl.load(row)
        else:
            unit = tl.load(row + pos // UNIT_TOKENS)
        offs_h = tl.arange(0, BLOCK_KVH)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        dst = KV + unit.to(tl.int64) * stride_unit + (pos % UNIT_TOKENS) * stride_tok
        dst = dst + offs_h[:, None] * stride_head + offs_d[None, :]
        k = tl.load(K + b * stride_kb + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(V + b * stride_vb + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        tl.store(dst, k, mask=mask)
        tl.store(dst + stride_kv, v, mask=mask)


def store_decode_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    is_ring: bool,
) -> None:
    """Writes each row's k, v ([B, kv_heads, head_dim]) at position context_lens - 1: into its page
    (block_table[b, pos // block_size], slot pos % block_size) or its ring (slot block_table[b, 0],
    index pos % window). Rows with context length 0 are skipped."""
    kv = _check_cache(cache, layer)
    batch, num_kv_heads, head_dim = k.shape
    if batch == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv.shape[3:] != k.shape[1:]:
        raise ValueError(f"k {tuple(k.shape)} does not fit the cache's {tuple(kv.shape[3:])}")
    _store_kv_kernel[(batch,)](
        k, v, kv, block_table, context_lens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        block_table.stride(0),
        IS_RING=is_ring, UNIT_TOKENS=kv.shape[2], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_KVH=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1,
    )
