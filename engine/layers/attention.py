"""Attention over the paged KV pool and the SWA ring buffers.

`paged_attention` stores the step's new K/V and attends. On CUDA (with Triton) every chunk of the
step runs in one launch of pdkernels/prefill_attention.py, which reads keys in place from the pages and
rings; it is batch- and chunk-invariant by construction, so default and deterministic mode share it.
In default mode only, a chunk may go through torch's SDPA instead (`_sdpa_chunk`); the step's other
chunks still run in one Triton launch. By default ("fresh") that is a long chunk with nothing cached
before it: its own keys, plain causal, which torch runs on cuDNN (measured on the H200, llama8b:
a 32k prompt in one chunk 1,245 ms against the Triton kernel's 1,603; 8k 220 against 237; 1k slower,
hence ForwardConfig.prefill_sdpa_fresh_min_tokens). prefill_sdpa flash|cudnn (`--prefill-sdpa`) also
sends chunks after a prefix (keys gathered from the pages, causal aligned to the lower right: flash
only), no faster end to end (32k in 8k chunks: 1,576 ms against 1,545); off: the Triton kernel for
every chunk. The setting travels in the step's context (ctx.config, engine/config.py ForwardConfig).
Elsewhere each sequence's visible keys are gathered in position order and handed to a backend:

- `sdpa_attend`: torch's scaled_dot_product_attention with an explicit mask (default mode).
- `tiled_attend`: deterministic mode. Queries in fixed tiles of QUERY_TILE rows, keys in fixed tiles
  aligned to absolute positions (multiples of the key tile), online softmax across key tiles. Every
  matmul has one fixed shape, and a key tile that a row cannot see is an exact no-op for that row
  (its probabilities are 0 and its running max unchanged), so a row's result does not depend on its
  neighbours, its batch, or how its prompt was chunked.

Attention sinks (gpt-oss): `sinks` [heads], one learned logit per query head that joins every row's
softmax denominator and has no value: out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)), s_j the
scaled scores. Every path takes them: the Triton kernels and tiled_attend start the online softmax
from the sink (running max = sink, denominator = 1), sdpa_attend appends a zero key and value whose
mask entry is the sink. torch's flash/cuDNN SDPA (`_sdpa_chunk`) cannot, so a layer with sinks never
sends a chunk there: all its chunks run in the Triton launch. None: no sink, nothing changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.config import ForwardConfig
from engine.layers.context import ForwardContext, SeqChunk, get_context
from engine.layers.decode import decode_attention

if TYPE_CHECKING:  # the kernel module imports triton
    from pdkernels.decode_attention import Rope

QUERY_TILE = 16

# The SDPA prefill path (default mode, CUDA), ForwardConfig.prefill_sdpa: "fresh" (the default: cuDNN
# for a chunk of at least prefill_sdpa_fresh_min_tokens with no cached prefix, the Triton kernel for
# the rest), "off" (every chunk on the Triton kernel), "flash" or "cudnn" (large chunks with or without
# a prefix; cuDNN first where torch can run it, flash otherwise).
# "fresh"'s threshold, 4,096 tokens: H200, llama8b: 8,192 tokens 220 ms against the kernel's 237, 1,024
# tokens 26.7 against 24.7; in between not measured.
# flash|cudnn: a chunk takes SDPA when queries x visible keys >= prefill_sdpa_min_pairs and it has
# prefill_sdpa_min_queries queries or more: below that the one Triton launch for the whole step (no key
# gather, no extra launch) is as good. 2^20 is a 1,024-token prompt, so every row of
# bench/device/prefill_sdpa_check.sh compares the two; to be tuned on the H200 (--prefill-sdpa-min-pairs).
_SDPA_BACKENDS = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
    "fresh": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
}


@dataclass(frozen=True)
class AttnSpec:
    """Which cache a layer uses: index among the full layers or among the sliding layers."""

    is_sliding: bool
    cache_index: int
    window: int | None
    scale: float


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, sinks: torch.Tensor | None = None,
    rope: Rope | None = None,
) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] for the new tokens; sinks: [heads] attention
    sink logits or None (see the module docstring). Returns [tokens, heads, dim].

    The chunks' tokens come first; a CUDA step's decode rows (ctx.decode), if any, are the last rows.
    rope: the decode rows' q and k are still raw and the decode kernel norms and rotates them
    (pdkernels/decode_attention.py Rope); None: they arrive rotated."""
    dec = get_context().decode
    if dec is None:
        return chunked_attention(q, k, v, spec, sinks)
    n = q.shape[0] - dec.num_rows
    ctx = get_context()
    out = decode_attention(q[n:], k[n:], v[n:], spec.is_sliding, spec.cache_index, spec.window, spec.scale,
                           ctx.kv, dec, batch_invariant=ctx.numerics.is_deterministic, sinks=sinks, rope=rope)
    return out if n == 0 else torch.cat([chunked_attention(q[:n], k[:n], v[:n], spec, sinks), out])


def chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of the context's chunks (prefill, and decode on the CPU): same arguments as paged_attention."""
    ctx = get_context()
    if not spec.is_sliding:
        _store_pages(ctx, spec.cache_index, k, v)
    kern = _prefill_kernel() if q.is_cuda else None
    if kern is not None:
        out = _flash_chunks(kern, ctx, spec, q, k, v, sinks)
    else:
        out = torch.empty_like(q)
        for c in ctx.chunks:
            rows = slice(c.token_start, c.token_start + c.num_tokens)
            if spec.is_sliding:
                keys, values, k_pos0 = _sliding_keys(ctx, spec, c, k[rows], v[rows])
            else:
                keys, values, k_pos0 = _paged_keys(ctx, spec, c)
            attend = tiled_attend if ctx.numerics.is_deterministic else sdpa_attend
            out[rows] = attend(q[rows], keys, values, c.start_pos, k_pos0, spec.window, spec.scale, ctx.kv.block_size,
                               sinks)
    if spec.is_sliding:
        # NOTE: after the attention: the SDPA path reads the ring's [0, start) before the chunk lands in it.
        for c in ctx.chunks:
            rows = slice(c.token_start, c.token_start + c.num_tokens)
            _store_state(ctx, spec, c, k[rows], v[rows])
    return out


@cache
def _prefill_kernel() -> ModuleType | None:
    try:
        from pdkernels import prefill_attention
    except ImportError:  # no triton
        return None
    return prefill_attention


@dataclass
class _StepCache:
    """What every layer of one step reuses: the Triton kernel's chunk metadata per (tile tokens, indices
    of the chunks it runs) and, per SDPA chunk of a full layer, its page ids on the device."""

    ctx: ForwardContext
    metas: dict[tuple[int, tuple[int, ...]], Any] = field(default_factory=dict)
    page_ids: dict[int, torch.Tensor] = field(default_factory=dict)


# NOTE: holding the context itself (not its id) keeps a later step's context from matching by id reuse.
_step: _StepCache | None = None


def _step_cache(ctx: ForwardContext) -> _StepCache:
    global _step
    if _step is None or _step.ctx is not ctx:
        _step = _StepCache(ctx)
    return _step


def _flash_chunks(
    kern: ModuleType, ctx: ForwardContext, spec: AttnSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The chunks that pay for it through torch's SDPA (`_sdpa_chunk`), the rest in one launch of
    pdkernels/prefill_attention.py with keys read in place. Returns [tokens, heads, dim]."""
    chunks = ctx.chunks
    if not chunks:
        return torch.empty_like(q)
    usable = sinks is None and _sdpa_usable(ctx, q, k)  # torch's SDPA has no sinks: the kernel takes them
    fast = [i for i, c in enumerate(chunks) if _takes_sdpa(ctx.config, spec, c)] if usable else []
    if fast == [0] and len(chunks) == 1 and chunks[0].token_start == 0 and chunks[0].num_tokens == q.shape[0]:
        return _sdpa_chunk(ctx, spec, chunks[0], 0, q, k, v)  # the whole step: no copy into `out`
    out = torch.empty_like(q)
    for i in fast:
        c = chunks[i]
        out[c.token_start : c.token_start + c.num_tokens] = _sdpa_chunk(ctx, spec, c, i, q, k, v)
    rest = tuple(i for i in range(len(chunks)) if i not in fast)
    if not rest:
        return out
    step = _step_cache(ctx)
    tile_tokens = kern.tile_config(q.shape[1], k.shape[1], q.shape[2]).tile_tokens
    meta = step.metas.get((tile_tokens, rest))
    if meta is None:
        cs = [chunks[i] for i in rest]
        meta = kern.chunk_meta(
            [c.token_start for c in cs], [c.num_tokens for c in cs], [c.start_pos for c in cs],
            [c.block_ids for c in cs], [c.state_slot for c in cs], tile_tokens, ctx.kv.block_size, ctx.kv.device,
        )
        step.metas[(tile_tokens, rest)] = meta
    cache = ctx.kv.swa if spec.is_sliding else ctx.kv.pages
    kern.prefill_attention(q, k, v, cache, spec.cache_index, meta, spec.scale, spec.window or 0, out=out, sinks=sinks)
    return out


def _sdpa_usable(ctx: ForwardContext, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether this layer may send chunks to SDPA at all. Never in deterministic mode: flash SDPA is
    neither batch- nor chunk-invariant, and the token-identity checks rely on the Triton kernel's being."""
    if ctx.config.prefill_sdpa == "off" or ctx.numerics.is_deterministic:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    return _flash_supports(q.dtype, q.shape[1], k.shape[1], q.shape[2], q.device)


def _takes_sdpa(cfg: ForwardConfig, spec: AttnSpec, c: SeqChunk) -> bool:
    """A chunk large enough to pay ("fresh": and nothing cached before it); on a sliding layer only while
    the window covers every key the chunk sees (start + n <= window: sliding is then plain causal)."""
    if spec.is_sliding and c.end_pos > (spec.window or 0):
        return False
    if cfg.prefill_sdpa == "fresh":
        return c.start_pos == 0 and c.num_tokens >= cfg.prefill_sdpa_fresh_min_tokens
    return c.num_tokens >= cfg.prefill_sdpa_min_queries and c.num_tokens * c.end_pos >= cfg.prefill_sdpa_min_pairs


def _lower_right() -> Any:
    """torch's causal_lower_right, imported on first use: its module pulls in torch._dynamo, a second of
    import in every engine process, where only a GPU's SDPA path needs it (preload_sdpa: at the start)."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right


def preload_sdpa(config: ForwardConfig, device: torch.device) -> None:
    """At an engine's start: imports what a prefill through torch's SDPA needs (a CUDA engine in default
    mode), so its first prefix-cached prefill pays no import."""
    if device.type == "cuda" and config.prefill_sdpa != "off":
        _lower_right()


@cache
def _flash_supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> bool:
    """Whether torch's flash kernel takes this head layout (GQA included) on this device. A chunk after a
    cached prefix needs it: torch runs a lower-right causal mask through flash only, else it would fall
    back to a dense mask. NOTE: cached, so disabling flash globally later is not seen here."""
    q = torch.empty((1, num_heads, 2, head_dim), dtype=dtype, device=device)
    kv = torch.empty((1, num_kv_heads, 4, head_dim), dtype=dtype, device=device)
    try:
        params = torch.backends.cuda.SDPAParams(q, kv, kv, None, 0.0, False, num_heads != num_kv_heads)
        return bool(torch.backends.cuda.can_use_flash_attention(params))
    except (TypeError, RuntimeError):  # a torch without GQA in SDPAParams, or without flash
        return False


def _sdpa_chunk(
    ctx: ForwardContext, spec: AttnSpec, c: SeqChunk, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """One chunk's attention through torch's SDPA, [n, heads, dim]: its visible keys [0, end) contiguous
    in position order, the queries the last n positions of them.

        keys:    0 ........ start ........ end       causal_lower_right(n, L): query i sees keys
        queries:            start ........ end       [0, start + i], i.e. the mask's lower-right corner
    """
    rows = slice(c.token_start, c.token_start + c.num_tokens)
    if c.start_pos == 0:  # nothing cached: the chunk's own keys are all it sees
        keys, values = k[rows], v[rows]
    elif spec.is_sliding:
        # end <= window (_takes_sdpa): the ring holds positions [0, start) at their own index, unwrapped.
        ring = ctx.kv.swa[c.state_slot, spec.cache_index]
        keys, values = torch.cat([ring[0, : c.start_pos], k[rows]]), torch.cat([ring[1, : c.start_pos], v[rows]])
    else:
        keys, values = _gather_pages(ctx, spec.cache_index, c, index)
    n, num_keys = c.num_tokens, c.end_pos
    mask = None if n == num_keys else _lower_right()(n, num_keys)
    with sdpa_kernel(_SDPA_BACKENDS[ctx.config.prefill_sdpa], set_priority=True):
        out = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=spec.scale,
            enable_gqa=q.shape[1] != keys.shape[1],
        )
    return out[0].transpose(0, 1)


def _gather_pages(ctx: ForwardContext, layer: int, c: SeqChunk, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, end) of a full layer, [end, kv_heads, dim] each: the chunk's own
    were stored in the pages before attention. One gather each; the page ids go to the device once a step."""
    step = _step_cache(ctx)
    ids = step.page_ids.get(index)
    if ids is None:
        ids = torch.tensor(c.block_ids[: math.ceil(c.end_pos / ctx.kv.block_size)], dtype=torch.long)
        ids = step.page_ids[index] = ids.to(ctx.kv.device, non_blocking=True)
    pages = ctx.kv.pages
    keys = pages[ids, layer, 0].flatten(0, 1)[: c.end_pos]
    values = pages[ids, layer, 1].flatten(0, 1)[: c.end_pos]
    return keys, values


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain masked attention. q: [n, heads, dim]; keys: [L, kv_heads, dim], values: [L, kv_heads, value dim]
    (MLA: the values' width may differ) at positions k_pos0..; sinks: [heads] or None. Returns [n, heads,
    value dim]."""
    n, L = q.shape[0], keys.shape[0]
    q_pos = torch.arange(q_pos0, q_pos0 + n, device=q.device)
    k_pos = torch.arange(k_pos0, k_pos0 + L, device=q.device)
    mask = _visible(q_pos, k_pos, window)
    attn_mask: torch.Tensor | None = None if bool(mask.all()) else mask
    if sinks is not None:
        # the sink as one more key: zero key and value, its score (0) plus its mask entry is the sink logit
        keys = torch.cat([keys, keys.new_zeros(1, *keys.shape[1:])])
        values = torch.cat([values, values.new_zeros(1, *values.shape[1:])])
        attn_mask = torch.zeros(q.shape[1], n, L + 1, dtype=q.dtype, device=q.device)
        attn_mask[:, :, :L].masked_fill_(~mask, float("-inf"))
        attn_mask[:, :, L] = sinks.to(q.dtype)[:, None]
        attn_mask = attn_mask[None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=attn_mask,
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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batch-invariant attention (see the module docstring). Same arguments and result as sdpa_attend."""
    n, num_heads, dim = q.shape
    num_kv, vdim = keys.shape[1], values.shape[2]
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
    vt = F.pad(values.float(), (0, 0, 0, 0, pad_front, pad_back)).view(num_kt, tk, num_kv, vdim).transpose(1, 2)
    k_pos = torch.arange(a0, a0 + num_kt * tk, device=dev)
    k_pos = torch.where((k_pos >= k_pos0) & (k_pos < k_pos0 + keys.shape[0]), k_pos, torch.iinfo(torch.long).max)
    k_pos = k_pos.view(num_kt, tk)

    num_qt = math.ceil(n / tq)
    # [tiles, tq, kv_heads, group, dim] -> [tiles, kv_heads, group * tq, dim]; row = g * tq + t
    qt = F.pad(q.float(), (0, 0, 0, 0, 0, num_qt * tq - n)).view(num_qt, tq, num_kv, group, dim).permute(0, 2, 3, 1, 4)
    qt = qt.reshape(num_qt, num_kv, group * tq, dim)
    out = torch.empty((num_qt, num_kv, group * tq, vdim), dtype=q.dtype, device=dev)
    neg_inf = torch.tensor(float("-inf"), device=dev)
    # the online softmax starts empty, or from the sink: running max = sink, denominator exp(0) = 1
    m0 = torch.full((num_kv, group * tq), float("-inf"), device=dev)
    denom0 = torch.zeros((num_kv, group * tq), device=dev)
    if sinks is not None:  # row g * tq + t of kv head j is query head j * group + g
        m0 = sinks.float().view(num_kv, group).repeat_interleave(tq, dim=1)
        denom0 = torch.ones_like(denom0)
    for qi in range(num_qt):
        q_pos = (q_pos0 + qi * tq + torch.arange(tq, device=dev)).repeat(group)
        lo = q_pos0 + qi * tq - (window or 10**18)
        hi = q_pos0 + qi * tq + tq - 1
        m, denom = m0, denom0
        acc = torch.zeros((num_kv, group * tq, vdim), device=dev)
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
    out = out.view(num_qt, num_kv, group, tq, vdim).permute(0, 3, 1, 2, 4).reshape(num_qt * tq, num_heads, vdim)
    return out[:n]
