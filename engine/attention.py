"""Attention over the paged KV pool and the SWA ring buffers.

`paged_attention` stores the step's new K/V and attends. On CUDA (with Triton) every chunk of the
step runs in one launch of kernels/prefill_attention.py, which reads keys in place from the pages and
rings; it is batch- and chunk-invariant by construction, so default and deterministic mode share it.
Elsewhere each sequence's visible keys are gathered in position order and handed to a backend:

- `sdpa_attend`: torch's scaled_dot_product_attention with an explicit mask (default mode).
- `tiled_attend`: deterministic mode. Queries in fixed tiles of QUERY_TILE rows, keys in fixed tiles
  aligned to absolute positions (multiples of the key tile), online softmax across key tiles. Every
  matmul has one fixed shape, and a key tile that a row cannot see is an exact no-op for that row
  (its probabilities are 0 and its running max unchanged), so a row's result does not depend on its
  neighbours, its batch, or how its prompt was chunked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.context import ForwardContext, SeqChunk, get_context
from engine.decode import decode_attention

QUERY_TILE = 16


@dataclass(frozen=True)
class AttnSpec:
    """Which cache a layer uses: index among the full layers or among the sliding layers."""

    is_sliding: bool
    cache_index: int
    window: int | None
    scale: float


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] for the new tokens. Returns [tokens, heads, dim].

    The chunks' tokens come first; a CUDA step's decode rows (ctx.decode), if any, are the last rows."""
    dec = get_context().decode
    if dec is None:
        return chunked_attention(q, k, v, spec)
    n = q.shape[0] - dec.num_rows
    out = decode_attention(q[n:], k[n:], v[n:], spec.is_sliding, spec.cache_index, spec.window, spec.scale,
                           get_context().kv, dec)
    return out if n == 0 else torch.cat([chunked_attention(q[:n], k[:n], v[:n], spec), out])


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> torch.Tensor:
    """Attention of the context's chunks (prefill, and decode on the CPU): same arguments as paged_attention."""
    ctx = get_context()
    if not spec.is_sliding:
        _store_pages(ctx, spec.cache_index, k, v)
    out = torch.empty_like(q)
    kern = _prefill_kernel() if q.is_cuda else None
    if kern is not None:
        _flash_chunks(kern, ctx, spec, q, k, v, out)
    else:
        for c in ctx.chunks:
            rows = slice(c.token_start, c.token_start + c.num_tokens)
            if spec.is_sliding:
                keys, values, k_pos0 = _sliding_keys(ctx, spec, c, k[rows], v[rows])
            else:
                keys, values, k_pos0 = _paged_keys(ctx, spec, c)
            attend = tiled_attend if ctx.numerics.is_deterministic else sdpa_attend
            out[rows] = attend(q[rows], keys, values, c.start_pos, k_pos0, spec.window, spec.scale, ctx.kv.block_size)
    if spec.is_sliding:
        for c in ctx.chunks:
            rows = slice(c.token_start, c.token_start + c.num_tokens)
            _store_state(ctx, spec, c, k[rows], v[rows])
    return out


@cache
def _prefill_kernel() -> ModuleType | None:
    try:
        from kernels import prefill_attention
    except ImportError:  # no triton
        return None
    return prefill_attention


# The current step's chunk metadata, built once and read by every layer: (context, tile tokens, meta).
# NOTE: holding the context itself (not its id) keeps a later step's context from matching by id reuse.
_step_meta: tuple[ForwardContext, int, object] | None = None


def _flash_chunks(
    kern: ModuleType, ctx: ForwardContext, spec: AttnSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Every chunk in one launch of kernels/prefill_attention.py, keys read in place."""
    global _step_meta
    if not ctx.chunks:
        return
    tile_tokens = kern.tile_config(q.shape[1], k.shape[1], q.shape[2]).tile_tokens
    if _step_meta is None or _step_meta[0] is not ctx or _step_meta[1] != tile_tokens:
        cs = ctx.chunks
        meta = kern.chunk_meta(
            [c.token_start for c in cs], [c.num_tokens for c in cs], [c.start_pos for c in cs],
            [c.block_ids for c in cs], [c.state_slot for c in cs], tile_tokens, ctx.kv.block_size, ctx.kv.device,
        )
        _step_meta = (ctx, tile_tokens, meta)
    cache = ctx.kv.swa if spec.is_sliding else ctx.kv.pages
    kern.prefill_attention(q, k, v, cache, spec.cache_index, _step_meta[2], spec.scale, spec.window or 0, out=out)


def _store_pages(ctx: ForwardContext, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    if ctx.page_ids.numel():
        ctx.kv.pages[ctx.page_ids, layer, 0, ctx.page_offsets] = k
        ctx.kv.pages[ctx.page_ids, layer, 1, ctx.page_offsets] = v


def _paged_keys(ctx: ForwardContext, spec: AttnSpec, c: SeqChunk) -> tuple[torch.Tensor, torch.Tensor, int]:
    bs = ctx.kv.block_size
    n_blocks = math.ceil(c.end_pos / bs)
    ids = torch.tensor(c.block_ids[:n_blocks], dtype=torch.long, device=ctx.kv.device)
    kv = ctx.kv.pages[ids, spec.cache_index]  # [n_blocks, 2, bs, kv_heads, dim]
    keys = kv[:, 0].reshape(-1, *kv.shape[-2:])[: c.end_pos]
    values = kv[:, 1].reshape(-1, *kv.shape[-2:])[: c.end_pos]
    return keys, values, 0


def _ring_indices(lo: int, hi: int, window: int, device: torch.device) -> torch.Tensor:
    return torch.arange(lo, hi, device=device) % window


def _sliding_keys(
    ctx: ForwardContext, spec: AttnSpec, c: SeqChunk, k_new: torch.Tensor, v_new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The ring's positions [start - window, start) in order, then the chunk's own keys."""
    assert spec.window is not None
    lo = max(0, c.start_pos - spec.window)
    state = ctx.kv.swa[c.state_slot, spec.cache_index]  # [2, window, kv_heads, dim]
    idx = _ring_indices(lo, c.start_pos, spec.window, ctx.kv.device)
    keys = torch.cat([state[0, idx], k_new])
    values = torch.cat([state[1, idx], v_new])
    return keys, values, lo


def _store_state(ctx: ForwardContext, spec: AttnSpec, c: SeqChunk, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
    # NOTE: only the last `window` new tokens go in: earlier ones would share ring indices with them.
    assert spec.window is not None
    keep = min(c.num_tokens, spec.window)
    idx = _ring_indices(c.end_pos - keep, c.end_pos, spec.window, ctx.kv.device)
    ctx.kv.swa[c.state_slot, spec.cache_index, 0, idx] = k_new[-keep:]
    ctx.kv.swa[c.state_slot, spec.cache_index, 1, idx] = v_new[-keep:]


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def sdpa_attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_pos0: int,
    k_pos0: int,
    window: int | None,
    scale: float,
    key_tile: int,
) -> torch.Tensor:
    """Plain masked attention. q: [n, heads, dim]; keys/values: [L, kv_heads, dim] at positions k_pos0.."""
    n, L = q.shape[0], keys.shape[0]
    q_pos = torch.arange(q_pos0, q_pos0 + n, device=q.device)
    k_pos = torch.arange(k_pos0, k_pos0 + L, device=q.device)
    mask = _visible(q_pos, k_pos, window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=None if bool(mask.all()) else mask,
        scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out[0].transpose(0, 1)


def tiled_attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_pos0: int,
    k_pos0: int,
    window: int | None,
    scale: float,
    key_tile: int,
) -> torch.Tensor:
    """Batch-invariant attention (see the module docstring). Same arguments as sdpa_attend."""
    n, num_heads, dim = q.shape
    num_kv = keys.shape[1]
    group = num_heads // num_kv
    tq, tk = QUERY_TILE, key_tile
    dev = q.device
    #   key buffer: | pad_front | keys (positions k_pos0 .. k_pos0+L) | pad_back |, tiles start at a0
    a0 = (k_pos0 // tk) * tk
    pad_front = k_pos0 - a0
    num_kt = math.ceil((pad_front + keys.shape[0]) / tk)
    pad_back = num_kt * tk - pad_front - keys.shape[0]
    # NOTE: float32 throughout: bf16 scores (values ~10-30) would be rounded by ~0.1 before softmax.
    kt = F.pad(keys.float(), (0, 0, 0, 0, pad_front, pad_back)).view(num_kt, tk, num_kv, dim).permute(0, 2, 3, 1)
    vt = F.pad(values.float(), (0, 0, 0, 0, pad_front, pad_back)).view(num_kt, tk, num_kv, dim).transpose(1, 2)
    k_pos = torch.arange(a0, a0 + num_kt * tk, device=dev)
    k_pos = torch.where((k_pos >= k_pos0) & (k_pos < k_pos0 + keys.shape[0]), k_pos, torch.iinfo(torch.long).max)
    k_pos = k_pos.view(num_kt, tk)

    num_qt = math.ceil(n / tq)
    # [tiles, tq, kv_heads, group, dim] -> [tiles, kv_heads, group * tq, dim]; row = g * tq + t
    qt = F.pad(q.float(), (0, 0, 0, 0, 0, num_qt * tq - n)).view(num_qt, tq, num_kv, group, dim).permute(0, 2, 3, 1, 4)
    qt = qt.reshape(num_qt, num_kv, group * tq, dim)
    out = torch.empty((num_qt, num_kv, group * tq, dim), dtype=q.dtype, device=dev)
    neg_inf = torch.tensor(float("-inf"), device=dev)
    for qi in range(num_qt):
        q_pos = (q_pos0 + qi * tq + torch.arange(tq, device=dev)).repeat(group)
        lo = q_pos0 + qi * tq - (window or 10**18)
        hi = q_pos0 + qi * tq + tq - 1
        m = torch.full((num_kv, group * tq), float("-inf"), device=dev)
        denom = torch.zeros((num_kv, group * tq), device=dev)
        acc = torch.zeros((num_kv, group * tq, dim), device=dev)
        for ki in range(num_kt):
            first, last = a0 + ki * tk, a0 + ki * tk + tk - 1
            if first > hi or last <= lo:  # invisible to every row of this query tile: an exact no-op
                continue
            s = torch.matmul(qt[qi], kt[ki]) * scale  # [kv_heads, group*tq, tk]
            s = torch.where(_visible(q_pos, k_pos[ki], window)[None], s, neg_inf)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe[..., None])
            denom = denom * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(p, vt[ki])
            m = m_new
        out[qi] = (acc / denom[..., None]).to(q.dtype)
    # back to [n, heads, dim]
    out = out.view(num_qt, num_kv, group, tq, dim).permute(0, 3, 1, 2, 4).reshape(num_qt * tq, num_heads, dim)
    return out[:n]
