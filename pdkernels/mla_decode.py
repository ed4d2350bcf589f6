"""Paged decode attention over latents (Triton): multi-head latent attention's absorbed decode (engine/layers/mla.py),
one query token per sequence, the latents read in place from the paged pool.

A latent-attention layer keeps one latent per token, `| c_kv (R) | k_rot (Dr) |`, in pages of the same pool
as the other families (`[blocks, layers, 1, block_size, 1, R + Dr]`, KVLayout.page_kind "latent"). Decode
absorbs the key and value up-projections (the query arrives as `| W_UK^T q_nope (R) | q_rot (Dr) |` per
head), so attention is multi-query: every head scores the same latents, and its output is the softmax's
mix of their c_kv parts, R wide (engine/layers/mla.py un-absorbs it with W_UV):

    score[h, j] = (q[h, :R] . c_kv[j] + q[h, R:] . k_rot[j]) * scale        out[h] = sum_j p[h, j] c_kv[j]

One program per (sequence, tile of BLOCK_H heads, split): each latent tile is loaded once and serves the
tile's heads through two tensor-core products (the c_kv and the k_rot parts), so a step reads each
sequence's latents once per head tile (DeepSeek-V3's 128 heads of a rank: 8 tiles of 16). The keys' splits
and their fold are decode_attention.py's (`_split_bounds`, `_decode_reduce_kernel`): a function of the
context length alone, so a row's output does not depend on its batch and deterministic mode uses the same
kernels. A row with context length 0 (a padded row of a CUDA graph) gets zeros. The new token's latent must
be in the pages already: `store_latents` writes a step's decode rows' latents through their block tables
(engine/layers/mla.py stores a prefill chunk's by page ids before it attends).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdkernels.decode_attention import MAX_SPLITS, MIN_SPLIT_TOKENS, _decode_reduce_kernel, _split_bounds

BLOCK_N = 32  # latents per tile (a [32, 512] bf16 c_kv tile is 32 KiB)
BLOCK_H = 16  # heads per program (tl.dot's smallest M)


@triton.jit
def _mla_split_kernel(
    Q, LAT, BT, CTX, ACC, ML,
    stride_qb, stride_qh, stride_unit, stride_tok, stride_btb,
    num_heads, scale,
    RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    UNIT_TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr,
    MIN_SPLIT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    ht = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(CTX + b)
    num_splits, start, end = _split_bounds(n, s, MAX_SPLITS, MIN_SPLIT, BLOCK_N)
    if (s < num_splits) & (start < end):
        heads = ht * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = heads < num_heads
        offs_r = tl.arange(0, BLOCK_R)
        offs_dr = tl.arange(0, BLOCK_DR)
        mask_r = offs_r < RANK
        mask_dr = offs_dr < ROPE_DIM
        q_row = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
        q_c = tl.load(q_row + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
        q_r = tl.load(q_row + RANK + offs_dr[None, :], mask=mask_h[:, None] & mask_dr[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
        row = BT + b.to(tl.int64) * stride_btb
        for j0 in range(start, end, BLOCK_N):
            offs_n = j0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            unit = tl.load(row + offs_n // UNIT_TOKENS, mask=mask_n, other=0).to(tl.int64)
            base = unit * stride_unit + (offs_n % UNIT_TOKENS) * stride_tok
            c = tl.load(LAT + base[:, None] + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
            k_rot = tl.load(LAT + base[:, None] + RANK + offs_dr[None, :], mask=mask_n[:, None] & mask_dr[None, :],
                            other=0.0)  # fmt: skip
            if IEEE:
                qk = tl.dot(q_c, tl.trans(c), input_precision="ieee")
                qk = tl.dot(q_r, tl.trans(k_rot), qk, input_precision="ieee")
            else:
                qk = tl.dot(q_c, tl.trans(c))
                qk = tl.dot(q_r, tl.trans(k_rot), qk)
            qk = tl.where(mask_n[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(c.dtype), c, input_precision="ieee")
            else:
                pv = tl.dot(p.to(c.dtype), c)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        # partials as decode_attention.py's reduce reads them: ACC [B, heads, MAX_SPLITS, BLOCK_R]
        part = (b.to(tl.int64) * num_heads + heads) * MAX_SPLITS + s
        tl.store(ACC + part[:, None] * BLOCK_R + offs_r[None, :], acc, mask=mask_h[:, None])
        tl.store(ML + part * 2, m_i, mask=mask_h)
        tl.store(ML + part * 2 + 1, l_i, mask=mask_h)


@triton.jit
def _store_latents_kernel(
    NEW, LAT, BT, CTX,
    stride_nb, stride_unit, stride_tok, stride_btb,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, UNIT_TOKENS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    n = tl.load(CTX + b)
    if n > 0:  # a padded row (context length 0) writes nothing
        pos = n - 1
        unit = tl.load(BT + b.to(tl.int64) * stride_btb + pos // UNIT_TOKENS).to(tl.int64)
        offs = tl.arange(0, BLOCK_W)
        mask = offs < WIDTH
        row = tl.load(NEW + b.to(tl.int64) * stride_nb + offs, mask=mask)
        tl.store(LAT + unit * stride_unit + (pos % UNIT_TOKENS) * stride_tok + offs, row, mask=mask)


def store_latents(
    latents: torch.Tensor, cache: torch.Tensor, layer: int, block_table: torch.Tensor, context_lens: torch.Tensor
) -> None:
    """Each decode row's new latent [B, width] into its page: position context_lens[b] - 1, page
    block_table[b, position // block_size]. A row with context length 0 (padding) is skipped, so it never
    writes into a page that a real row owns."""
    lat = cache[:, layer]
    if latents.shape[0] == 0:
        return
    if latents.shape[-1] != lat.shape[-1] or latents.stride(-1) != 1 or lat.stride(-1) != 1:
        raise ValueError(f"latents {tuple(latents.shape)} do not fit a pool {lat.shape[-1]} wide (unit stride both)")
    width = lat.shape[-1]
    _store_latents_kernel[(latents.shape[0],)](
        latents, lat, block_table, context_lens,
        latents.stride(0), lat.stride(0), lat.stride(2), block_table.stride(0),
        WIDTH=width, BLOCK_W=triton.next_power_of_2(width), UNIT_TOKENS=lat.shape[2], num_warps=1,
    )  # fmt: skip


def paged_latent_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    rank: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, heads, rank + rope_dim], the absorbed query of one token per sequence. cache: the latent pool
    `[blocks, layers, 1, block_size, 1, rank + rope_dim]`, indexed by `layer`; the new tokens' latents
    stored already. block_table [B, max_blocks] int32 page ids; context_lens [B] int32 (the new token's
    position + 1; 0: a padded row, zeros out). Returns [B, heads, rank] in q's dtype: each head's softmax
    mix of the latents' first `rank` values (c_kv)."""
    if cache.dim() != 6 or cache.shape[2] != 1 or cache.shape[4] != 1:
        raise ValueError(f"a latent cache is [blocks, layers, 1, block_size, 1, width], got {tuple(cache.shape)}")
    lat = cache[:, layer]
    width = lat.shape[-1]
    batch, num_heads, q_width = q.shape
    if q_width != width or not 0 < rank < width or q.stride(-1) != 1 or lat.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)} and rank {rank} do not fit latents {width} wide (unit stride both)")
    block_r, block_dr = triton.next_power_of_2(rank), max(16, triton.next_power_of_2(width - rank))
    if out is None:
        out = torch.empty((batch, num_heads, rank), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    acc = torch.empty((batch, num_heads, MAX_SPLITS, block_r), dtype=torch.float32, device=q.device)
    ml = torch.empty((batch, num_heads, MAX_SPLITS, 2), dtype=torch.float32, device=q.device)
    _mla_split_kernel[(batch, triton.cdiv(num_heads, BLOCK_H), MAX_SPLITS)](
        q, lat, block_table, context_lens, acc, ml,
        q.stride(0), q.stride(1), lat.stride(0), lat.stride(2), block_table.stride(0),
        num_heads, scale,
        RANK=rank, ROPE_DIM=width - rank, BLOCK_R=block_r, BLOCK_DR=block_dr, UNIT_TOKENS=lat.shape[2],
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, MAX_SPLITS=MAX_SPLITS, MIN_SPLIT=MIN_SPLIT_TOKENS,
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2,
    )  # fmt: skip
    _decode_reduce_kernel[(batch, num_heads)](
        acc, ml, context_lens, out, acc,
        out.stride(0), out.stride(1),
        num_heads,
        WINDOW=0, HEAD_DIM=rank, BLOCK_D=block_r,
        BLOCK_N=BLOCK_N, MAX_SPLITS=MAX_SPLITS, MIN_SPLIT=MIN_SPLIT_TOKENS, HAS_SINKS=False,
        PDL=False, num_warps=1,
    )  # fmt: skip
    return out
