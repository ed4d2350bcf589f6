"""Flash-style attention for prefill chunks (Triton): every chunk of a step in one launch, keys read in
place from the paged pool or the SWA ring, no attention matrix in memory.

A chunk is queries at positions [pos0, pos0 + n) of one sequence, rows [q_start, q_start + n) of q.

    full layer:    key p (p < pos0 + n) at page block_table[s, p // block_size], slot p % block_size;
                   the chunk's own K/V are stored in the pages before this runs.
    sliding layer: key p < pos0 from the ring, slot state_slot[s], index p % window (it holds
                   [pos0 - window, pos0)); key p >= pos0 from the chunk's own k, v (row q_start + p - pos0).

One program per (query tile, kv head). A query tile is the tokens of one chunk at positions
[a * TILE_TOKENS, (a + 1) * TILE_TOKENS) times the query heads of one kv head (GQA), one row per (token,
head), so each K/V tile is loaded once for the whole group. Rows are `(p % TILE_TOKENS) * GROUP_PAD + g`;
padded heads and positions outside the chunk are masked.

Batch and chunk invariance (deterministic mode uses this same kernel): a row's result depends only on
its query, its position and the keys it may see, never on the other rows of its tile, its batch or how
its prompt was chunked:
- key tiles are aligned to absolute positions (multiples of BLOCK_N) and visited in ascending order;
- the launch configuration (tile sizes, warps, stages) is a function of the model's head layout and
  dtype alone, and no integer that varies per step is specialized on, so every step runs the same code;
- softmax statistics and the accumulator are float32, every tile runs the same masked code path, and a
  key tile that a row cannot see is an exact no-op for it: its scores are -inf, so the running max is
  unchanged, the rescale factor is exp2(0) = 1 and its probabilities are exactly 0.
- query tiles are aligned to absolute positions too, so a row sits at the same place of its tile
  however the prompt was chunked (a matmul unit may round a row differently at another row offset:
  numpy's BLAS under the Triton interpreter does);
- the query tile decides only which key tiles are visited; the extra ones are no-ops for the rows that
  cannot see them.
tests/pdkernels/test_kernels_prefill_gpu.py checks chunked against whole bit for bit.

Attention sinks (gpt-oss; `sinks` [heads], one logit per query head, in the units of the scaled scores):
a row's online softmax starts from its head's sink, running max sink * log2(e) and denominator 1, so
the sink joins the denominator and adds nothing to the accumulator. The same start for every row and
tile: invariance holds as above.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TileConfig:
    """Launch configuration: a function of the head layout and dtype only (see the module docstring)."""

    group: int  # query heads per kv head
    group_pad: int  # next power of two
    tile_tokens: int  # tokens per query tile
    head_dim_pad: int
    block_n: int  # keys per tile; key tiles start at multiples of it
    num_warps: int
    num_stages: int

    @property
    def block_rows(self) -> int:
        return self.tile_tokens * self.group_pad


def tile_config(num_heads: int, num_kv_heads: int, head_dim: int) -> TileConfig:
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # 128 x 128 tiles, 8 warps, 2 stages: the fastest at Llama-3-8B head shapes on the H200
    # (bench/micro/prefill_kernels.py sweeps them; bench/figures/code-choices.md).
    small = head_dim_pad <= 128  # a 128 x 256 float32 accumulator would spill
    rows = 128 if small else 64
    tile_tokens = max(1, rows // group_pad)
    return TileConfig(group, group_pad, tile_tokens, head_dim_pad, block_n=128 if small else 64,
                      num_warps=8 if small else 4, num_stages=2)


@dataclass(frozen=True)
class ChunkMeta:
    """Device-side description of a step's chunks for `prefill_attention` (int32 tensors)."""

    tile_seq: torch.Tensor  # [num_tiles] chunk index of each query tile
    tile_t0: torch.Tensor  # [num_tiles] first token of the tile within its chunk (< 0: starts before it)
    q_start: torch.Tensor  # [B] first row of the chunk in q
    q_len: torch.Tensor  # [B] tokens in the chunk (0: nothing to do)
    pos0: torch.Tensor  # [B] position of the chunk's first token
    block_table: torch.Tensor  # [B, max_blocks] page ids (full layers)
    state_slot: torch.Tensor  # [B] ring slot (sliding layers)
    tile_tokens: int

    @property
    def num_tiles(self) -> int:
        return self.tile_seq.shape[0]


def chunk_meta(
    q_starts: Sequence[int],
    q_lens: Sequence[int],
    pos0s: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    state_slots: Sequence[int],
    tile_tokens: int,
    block_size: int,
    device: torch.device,
) -> ChunkMeta:
    """Built on the host, copied to the device in one transfer. Tiles are ordered heaviest first (most
    keys), which shortens the tail of a causal launch; the order does not change any result."""
    tiles = [
        (p0 + t0, i, t0)
        for i, (n, p0) in enumerate(zip(q_lens, pos0s))
        for t0 in range(-(p0 % tile_tokens), n, tile_tokens)  # aligned to absolute positions
    ]
    tiles.sort(reverse=True)
    batch = len(q_lens)
    num_blocks = max([math.ceil((p0 + n) / block_size) for n, p0 in zip(q_lens, pos0s)] + [1])
    table = [list(bt[:num_blocks]) + [0] * (num_blocks - min(len(bt), num_blocks)) for bt in block_tables]
    flat = [t[1] for t in tiles] + [t[2] for t in tiles] + list(q_starts) + list(q_lens) + list(pos0s)
    flat += list(state_slots) + [x for row in table for x in row]
    data = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
    nt = len(tiles)
    parts = data.split([nt, nt, batch, batch, batch, batch, batch * num_blocks])
    return ChunkMeta(
        tile_seq=parts[0], tile_t0=parts[1], q_start=parts[2], q_len=parts[3], pos0=parts[4],
        state_slot=parts[5], block_table=parts[6].view(batch, num_blocks), tile_tokens=tile_tokens,
    )


@triton.jit
def _prefill_attn_kernel(
    Q, K_NEW, V_NEW, OUT, KV, SINKS,
    TILE_SEQ, TILE_T0, Q_START, Q_LEN, POS0, BT, SLOT,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_unit, stride_kv, stride_tok, stride_head,
    stride_btb,
    qk_scale,
    WINDOW: tl.constexpr, UNIT_TOKENS: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILE_TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    BLOCK_M: tl.constexpr = TILE_TOKENS * GROUP_PAD
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.load(TILE_SEQ + tile)
    t0 = tl.load(TILE_T0 + tile)
    n = tl.load(Q_LEN + s)
    q0 = tl.load(Q_START + s)
    pos0 = tl.load(POS0 + s)

    rows = tl.arange(0, BLOCK_M)
    t = t0 + rows // GROUP_PAD
    g = rows % GROUP_PAD
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    row_ok = (t >= 0) & (t < n) & (g < GROUP)
    q_pos = pos0 + t
    head = kvh * GROUP + g
    q = tl.load(Q + (q0 + t)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & mask_d[None, :], other=0.0)

    # Keys this tile's rows may see: [lo, hi). Visible keys of any row lie inside; keys inside that a
    # row cannot see are masked to -inf below.
    hi = pos0 + tl.minimum(t0 + TILE_TOKENS, n)
    lo = pos0 * 0
    if WINDOW > 0:
        lo = tl.maximum(lo, pos0 + tl.maximum(t0, 0) - WINDOW + 1)
    if HAS_SINKS:  # start from the head's sink (base-2 units, as the scores): max sink, denominator 1
        m_i = tl.load(SINKS + head, mask=g < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WINDOW > 0:
        slot = tl.load(SLOT + s).to(tl.int64)
    else:
        bt_row = BT + s.to(tl.int64) * stride_btb
    for j in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        k_pos = j + tl.arange(0, BLOCK_N)
        k_ok = (k_pos >= lo) & (k_pos < hi)
        kv_mask = k_ok[:, None] & mask_d[None, :]
        if WINDOW > 0:
            in_ring = k_pos < pos0
            ring = slot * stride_unit + (k_pos % UNIT_TOKENS) * stride_tok + kvh * stride_head
            new_row = (q0 + k_pos - pos0).to(tl.int64)
            ring_mask = kv_mask & in_ring[:, None]
            new_mask = kv_mask & (k_pos >= pos0)[:, None]
            k = tl.where(in_ring[:, None],
                         tl.load(KV + ring[:, None] + offs_d[None, :], mask=ring_mask, other=0.0),
                         tl.load(K_NEW + new_row[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                                 mask=new_mask, other=0.0))
            v = tl.where(in_ring[:, None],
                         tl.load(KV + stride_kv + ring[:, None] + offs_d[None, :], mask=ring_mask, other=0.0),
                         tl.load(V_NEW + new_row[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                                 mask=new_mask, other=0.0))
        else:
            unit = tl.load(bt_row + k_pos // UNIT_TOKENS, mask=k_ok, other=0).to(tl.int64)
            page = unit * stride_unit + (k_pos % UNIT_TOKENS) * stride_tok + kvh * stride_head
            k = tl.load(KV + page[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(KV + stride_kv + page[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        visible = k_pos[None, :] <= q_pos[:, None]
        if WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        sc = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(OUT + (q0 + t)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    meta: ChunkMeta,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim], the step's new keys (read only for a
    sliding layer: a full layer's are already in the pages). cache: the paged pool (window 0) or the SWA
    ring pool (window > 0), [units, layers, 2, unit_tokens, kv_heads, head_dim]. Returns [T, heads,
    head_dim] in q's dtype (`out` if given); rows that no chunk covers are left unwritten. `config`
    overrides tile_config (benchmarks only: another configuration rounds differently). sinks: [heads]
    attention sink logits (scaled-score units), or None."""
    if cache.dim() != 6:
        raise ValueError(f"cache must be [units, layers, 2, tokens, kv_heads, head_dim], got {tuple(cache.shape)}")
    kv = cache[:, layer]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv.shape[3]
    if num_heads % num_kv_heads or kv.shape[4] != head_dim or k.shape[1:] != kv.shape[3:]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} do not fit the cache's {tuple(kv.shape[3:])}")
    if min(q.stride(-1), k.stride(-1), v.stride(-1), kv.stride(-1)) != 1:
        raise ValueError("head_dim must be contiguous")
    if window and kv.shape[2] != window:
        raise ValueError(f"ring of {kv.shape[2]} tokens, window {window}")
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.stride(0) != 1):
        raise ValueError(f"sinks must be [{num_heads}] contiguous, got {tuple(sinks.shape)}")
    cfg = config or tile_config(num_heads, num_kv_heads, head_dim)
    if meta.tile_tokens != cfg.tile_tokens:
        raise ValueError(f"meta built for {meta.tile_tokens}-token tiles, this layer needs {cfg.tile_tokens}")
    if out is None:
        out = torch.empty_like(q)
    if meta.num_tiles == 0:
        return out
    _prefill_attn_kernel[(meta.num_tiles, num_kv_heads)](
        q, k, v, out, kv, sinks if sinks is not None else q,
        meta.tile_seq, meta.tile_t0, meta.q_start, meta.q_len, meta.pos0, meta.block_table, meta.state_slot,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        meta.block_table.stride(0),
        scale * LOG2E,
        WINDOW=window, UNIT_TOKENS=kv.shape[2],
        GROUP=cfg.group, GROUP_PAD=cfg.group_pad, TILE_TOKENS=cfg.tile_tokens,
        HEAD_DIM=head_dim, BLOCK_D=cfg.head_dim_pad, BLOCK_N=cfg.block_n, IEEE=q.dtype == torch.float32,
        HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
