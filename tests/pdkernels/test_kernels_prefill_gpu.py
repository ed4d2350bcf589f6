"""Prefill attention kernel (pdkernels/prefill_attention.py) against a float64 torch reference, and its
batch and chunk invariance, bit for bit, without and with attention sinks. Skipped without CUDA (with TRITON_INTERPRET=1 and triton
installed it runs on the CPU in float32, slowly: a debugging aid, not part of the suite)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.gpu_support import DEVICE, DTYPE, require_triton

require_triton()

from pdkernels.prefill_attention import chunk_meta, prefill_attention, tile_config  # noqa: E402

pytestmark = pytest.mark.cuda


class Seq:
    """One sequence's true K/V over positions [0, pos0 + n) and the chunk [pos0, pos0 + n) to run."""

    def __init__(self, gen: torch.Generator, pos0: int, n: int, kv_heads: int, head_dim: int) -> None:
        self.pos0, self.n = pos0, n
        self.k = torch.randn(pos0 + n, kv_heads, head_dim, generator=gen).to(DTYPE)
        self.v = torch.randn(pos0 + n, kv_heads, head_dim, generator=gen).to(DTYPE)


def reference(q: torch.Tensor, s: Seq, window: int, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[n, heads, dim] in float64: row i at position pos0 + i sees keys (p - window, p]; a sink joins
    each head's softmax as one more logit without a value."""
    heads, kvh = q.shape[1], s.k.shape[1]
    k = s.k.double().repeat_interleave(heads // kvh, dim=1)
    v = s.v.double().repeat_interleave(heads // kvh, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(s.n):
        p = s.pos0 + i
        lo = max(0, p - window + 1) if window else 0
        att = torch.einsum("hd,khd->hk", q[i].double(), k[lo : p + 1]) * scale
        if sinks is not None:
            probs = torch.cat([att, sinks.double()[:, None]], dim=1).softmax(-1)[:, :-1]
        else:
            probs = att.softmax(-1)
        out[i] = torch.einsum("hk,khd->hd", probs, v[lo : p + 1])
    return out


def build_pages(seqs: list[Seq], block_size: int, num_layers: int, layer: int, gen: torch.Generator):
    """A NaN-poisoned paged pool holding each sequence's K/V [0, pos0 + n) in shuffled pages."""
    kvh, dim = seqs[0].k.shape[1:]
    need = [math.ceil((s.pos0 + s.n) / block_size) for s in seqs]
    pool = torch.full((sum(need) + 5, num_layers, 2, block_size, kvh, dim), float("nan"), dtype=DTYPE)
    perm = torch.randperm(pool.shape[0], generator=gen).tolist()
    tables = []
    for s, nb in zip(seqs, need):
        ids, perm = perm[:nb], perm[nb:]
        tables.append(ids + perm[:3])  # a few spare entries past the end, as an engine's table may have
        for p in range(s.pos0 + s.n):
            pool[ids[p // block_size], layer, 0, p % block_size] = s.k[p]
            pool[ids[p // block_size], layer, 1, p % block_size] = s.v[p]
    return pool.to(DEVICE), tables


def build_rings(seqs: list[Seq], window: int, num_layers: int, layer: int, gen: torch.Generator):
    """A NaN-poisoned ring pool: each sequence's slot holds positions [pos0 - window, pos0) at p % window."""
    kvh, dim = seqs[0].k.shape[1:]
    pool = torch.full((len(seqs) + 3, num_layers, 2, window, kvh, dim), float("nan"), dtype=DTYPE)
    slots = torch.randperm(pool.shape[0], generator=gen)[: len(seqs)].tolist()
    for s, slot in zip(seqs, slots):
        for p in range(max(0, s.pos0 - window), s.pos0):
            pool[slot, layer, 0, p % window] = s.k[p]
            pool[slot, layer, 1, p % window] = s.v[p]
    return pool.to(DEVICE), slots


def run_kernel(seqs, q, cache, layer, tables, slots, block_size, window, scale, heads, sinks=None):
    kvh, dim = seqs[0].k.shape[1:]
    starts = [sum(s.n for s in seqs[:i]) for i in range(len(seqs))]
    k_new = torch.cat([s.k[s.pos0 :] for s in seqs]).to(DEVICE)
    v_new = torch.cat([s.v[s.pos0 :] for s in seqs]).to(DEVICE)
    cfg = tile_config(heads, kvh, dim)
    meta = chunk_meta(starts, [s.n for s in seqs], [s.pos0 for s in seqs], tables or [[]] * len(seqs),
                      slots or [0] * len(seqs), cfg.tile_tokens, block_size, DEVICE)
    sinks = sinks.to(DEVICE, DTYPE) if sinks is not None else None
    return prefill_attention(q.to(DEVICE), k_new, v_new, cache, layer, meta, scale, window, sinks=sinks)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


TOL = 1e-2 if DTYPE == torch.bfloat16 else 1e-5
LAYOUTS = [(4, 2, 64), (6, 2, 128), (4, 4, 32), (8, 1, 80)]  # heads, kv_heads, head_dim: GQA 2, 3, 1, 8


@pytest.mark.parametrize("heads,kv_heads,dim", LAYOUTS)
def test_full_layer_matches_reference(heads: int, kv_heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    block_size, layer, scale = 16, 1, dim**-0.5
    # (cached prefix, chunk): fresh prompt, partial pages, prefix + chunk, one token, long chunk
    shapes = [(0, 37), (20, 5), (48, 70), (131, 1), (0, 16), (7, 200)]
    seqs = [Seq(gen, p0, n, kv_heads, dim) for p0, n in shapes]
    pages, tables = build_pages(seqs, block_size, 3, layer, gen)
    q = torch.randn(sum(s.n for s in seqs), heads, dim, generator=gen).to(DTYPE)
    out = run_kernel(seqs, q, pages, layer, tables, None, block_size, 0, scale, heads).cpu()
    assert not out.isnan().any()
    row = 0
    for s in seqs:
        ref = reference(q[row : row + s.n], s, 0, scale)
        assert rel_err(out[row : row + s.n], ref) < TOL, (s.pos0, s.n)
        row += s.n


@pytest.mark.parametrize("heads,kv_heads,dim", LAYOUTS[:2])
@pytest.mark.parametrize("window", [16, 40])
def test_sliding_layer_matches_reference(heads: int, kv_heads: int, dim: int, window: int) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + dim + window)
    layer, scale = 0, dim**-0.5
    # fresh, ring not full, ring exactly full, wrapped, wrapped with a chunk longer than the window
    shapes = [(0, 29), (5, 9), (window, 3), (3 * window + 7, 11), (window + 3, 2 * window + 5), (100, 1)]
    seqs = [Seq(gen, p0, n, kv_heads, dim) for p0, n in shapes]
    rings, slots = build_rings(seqs, window, 2, layer, gen)
    q = torch.randn(sum(s.n for s in seqs), heads, dim, generator=gen).to(DTYPE)
    out = run_kernel(seqs, q, rings, layer, None, slots, 1, window, scale, heads).cpu()
    assert not out.isnan().any()
    row = 0
    for s in seqs:
        ref = reference(q[row : row + s.n], s, window, scale)
        assert rel_err(out[row : row + s.n], ref) < TOL, (s.pos0, s.n)
        row += s.n


def test_unwritten_rows_stay_poisoned() -> None:
    """Rows between chunks that no chunk covers are not written; every chunk row is."""
    gen = torch.Generator().manual_seed(7)
    seqs = [Seq(gen, 3, 10, 2, 64), Seq(gen, 0, 20, 2, 64)]
    pages, tables = build_pages(seqs, 16, 1, 0, gen)
    q = torch.randn(40, 4, 64, generator=gen).to(DTYPE).to(DEVICE)
    k_new = torch.randn(40, 2, 64, generator=gen).to(DTYPE).to(DEVICE)
    cfg = tile_config(4, 2, 64)
    meta = chunk_meta([5, 20], [10, 20], [3, 0], tables, [0, 0], cfg.tile_tokens, 16, DEVICE)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k_new, k_new, pages, 0, meta, 0.125, out=out)
    out = out.cpu()
    written = torch.zeros(40, dtype=torch.bool)
    written[5:15] = written[20:40] = True
    assert not out[written].isnan().any()
    assert out[~written].isnan().all()


def _invariance_case(window: int, sinks: torch.Tensor | None = None) -> None:
    """One sequence's rows, computed whole, in chunks, and in batches with other sequences."""
    gen = torch.Generator().manual_seed(11 + window)
    heads, kvh, dim, block_size, scale = 8, 2, 64, 16, 0.125
    total = 300
    target = Seq(gen, 0, total, kvh, dim)
    q_all = torch.randn(total, heads, dim, generator=gen).to(DTYPE)

    def run(chunks: list[int], others: list[tuple[int, int]], first: bool) -> torch.Tensor:
        rows, pos = [], 0
        for n in chunks:
            part = Seq(gen, 0, 0, kvh, dim)
            part.pos0, part.n, part.k, part.v = pos, n, target.k[: pos + n], target.v[: pos + n]
            batch = [Seq(gen, p0, m, kvh, dim) for p0, m in others]
            batch = [part, *batch] if first else [*batch, part]
            q = torch.cat([torch.randn(s.n, heads, dim, generator=gen).to(DTYPE) if s is not part
                           else q_all[pos : pos + n] for s in batch])
            if window:
                cache, slots = build_rings(batch, window, 1, 0, gen)
                out = run_kernel(batch, q, cache, 0, None, slots, 1, window, scale, heads, sinks).cpu()
            else:
                cache, tables = build_pages(batch, block_size, 1, 0, gen)
                out = run_kernel(batch, q, cache, 0, tables, None, block_size, 0, scale, heads, sinks).cpu()
            start = 0 if first else sum(s.n for s in batch[:-1])
            rows.append(out[start : start + n])
            pos += n
        return torch.cat(rows)

    whole = run([total], [], True)
    assert rel_err(whole, reference(q_all, target, window, scale, sinks)) < TOL
    for chunks, others, first in [
        ([37, 1, 100, 162], [], True),
        ([5, 290, 5], [(0, 70), (13, 1)], False),
        ([1] * 20 + [280], [(40, 33)], True),
        ([150, 150], [(0, 1), (2, 129), (64, 64)], False),
    ]:
        got = run(chunks, others, first)
        assert torch.equal(got, whole), (chunks, (got.double() - whole.double()).abs().max())


def test_full_layer_chunk_and_batch_invariant() -> None:
    _invariance_case(window=0)


def test_sliding_layer_chunk_and_batch_invariant() -> None:
    _invariance_case(window=48)


# gpt-oss-like sinks: from negligible to dominant next to scores of a few units
SINKS = torch.tensor([-4.0, 0.0, 1.5, 3.0, 6.0, -1.0, 2.0, 0.5])


@pytest.mark.parametrize("heads,kv_heads,dim", LAYOUTS[:2])
@pytest.mark.parametrize("window", [0, 16])
def test_sinks_match_reference(heads: int, kv_heads: int, dim: int, window: int) -> None:
    """Attention sinks on full and sliding layers (fresh chunks, cached prefixes, wrapped rings, one
    token); the sink changes the output (it is not ignored)."""
    gen = torch.Generator().manual_seed(heads * 1000 + dim + window + 1)
    layer, scale, block_size = 0, dim**-0.5, 16
    sinks = SINKS[:heads]
    shapes = [(0, 29), (5, 9), (3 * 16 + 7, 11), (100, 1), (20, 40)]
    seqs = [Seq(gen, p0, n, kv_heads, dim) for p0, n in shapes]
    if window:
        cache, slots = build_rings(seqs, window, 1, layer, gen)
        args: tuple = (None, slots, 1)
    else:
        cache, tables = build_pages(seqs, block_size, 1, layer, gen)
        args = (tables, None, block_size)
    q = torch.randn(sum(s.n for s in seqs), heads, dim, generator=gen).to(DTYPE)
    out = run_kernel(seqs, q, cache, layer, *args, window, scale, heads, sinks).cpu()
    plain = run_kernel(seqs, q, cache, layer, *args, window, scale, heads).cpu()
    assert not out.isnan().any()
    row = 0
    for s in seqs:
        ref = reference(q[row : row + s.n], s, window, scale, sinks)
        assert rel_err(out[row : row + s.n], ref) < TOL, (s.pos0, s.n)
        row += s.n
    assert (out - plain).abs().max() > 0.05
    with pytest.raises(ValueError, match="sinks"):
        run_kernel(seqs, q, cache, layer, *args, window, scale, heads, sinks[:-1])


@pytest.mark.parametrize("window", [0, 48])
def test_sinks_chunk_and_batch_invariant(window: int) -> None:
    _invariance_case(window, sinks=SINKS)
