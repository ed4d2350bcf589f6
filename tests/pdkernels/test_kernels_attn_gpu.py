"""pdkernels/decode_attention.py against a float64 torch reference (skipped without CUDA).

Inputs are random, outputs poisoned (NaN) before each run, pages a sequence does not own and page
slots past its context are NaN too (a read past the context would poison the result). Layouts: shuffled
block tables, partial last pages, one-token contexts, contexts that use several splits, padded rows
(context 0); rings not yet full, exactly full and wrapped; GQA ratios 1, 4 and 8; attention sinks.

Also runs on the CPU under Triton's interpreter (TRITON_INTERPRET=1, triton installed; float32, small
shapes), which is how the kernels were debugged without a GPU; CI has no triton and skips it.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)

from pdkernels.decode_attention import paged_decode_attention, store_decode_kv  # noqa: E402

pytestmark = pytest.mark.cuda
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# bf16 inputs: bf16 scores' products and bf16 probabilities in the PV product (flash-attention's choice)
TOL = 1e-2 if DTYPE == torch.bfloat16 else 1e-5
SCALE_CTX = 1 if DEVICE.type == "cuda" else 0  # the interpreter is slow: shorter contexts on the CPU


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % 2**31)


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(DEVICE, DTYPE)


def reference(q: torch.Tensor, cache: torch.Tensor, layer: int, table: torch.Tensor, ctx: torch.Tensor,
              scale: float, window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain float64 attention of each row over its visible keys (a sink: one more logit per head, no
    value); zeros for context 0."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    unit_tokens = cache.shape[3]
    group = q.shape[1] // cache.shape[4]
    for b in range(q.shape[0]):
        n = int(ctx[b])
        if n == 0:
            continue
        if window:
            kv = cache[int(table[b, 0]), layer, :, : min(n, window)]
        else:
            pages = table[b, : math.ceil(n / unit_tokens)].long()
            kv = cache[pages, layer].transpose(0, 1).reshape(2, -1, *cache.shape[4:])[:, :n]
        k = kv[0].double().cpu().repeat_interleave(group, dim=1)  # [n, heads, dim]
        v = kv[1].double().cpu().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].double().cpu(), k) * scale
        if sinks is not None:
            probs = torch.softmax(torch.cat([s, sinks.double().cpu()[:, None]], dim=1), -1)[:, :-1]
        else:
            probs = torch.softmax(s, -1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30))


def _paged_setup(gen: torch.Generator, ctx_lens: list[int], block_size: int, kv_heads: int, dim: int,
                 num_layers: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned pool with random K/V at every sequence's own positions, and shuffled tables."""
    need = [math.ceil(n / block_size) for n in ctx_lens]
    num_blocks = sum(need) + 5
    cache = torch.full((num_blocks, num_layers, 2, block_size, kv_heads, dim), float("nan"), dtype=DTYPE)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need + [1]) + 2
    table = torch.zeros((len(ctx_lens), width), dtype=torch.int32)
    for b, n in enumerate(ctx_lens):
        ids = [order.pop() for _ in range(need[b])]
        table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for j in range(n):
            cache[ids[j // block_size], :, :, j % block_size] = torch.randn((num_layers, 2, kv_heads, dim), generator=gen).to(DTYPE)
    return cache.to(DEVICE), table.to(DEVICE)


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 8, 64), (32, 8, 128), (16, 2, 128), (4, 1, 80)])
@pytest.mark.parametrize("block_size", [16, 64, 128])  # 64, 128: tiles inside one page (PAGE_TILES)
@pytest.mark.parametrize("min_split", [None, 256])  # 256: the wide splits of a large default-mode batch
def test_paged_decode_matches_reference(heads: int, kv_heads: int, dim: int, block_size: int,
                                        min_split: int | None) -> None:
    gen = _gen("paged", heads, kv_heads, dim, block_size)
    # one page, a full page, partial, splits, padded
    ctx_lens = [1, block_size, block_size + 1, 300, 0, 1 + 2100 * SCALE_CTX, 33]
    cache, table = _paged_setup(gen, ctx_lens, block_size, kv_heads, dim)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    q = _rand(gen, len(ctx_lens), heads, dim)
    scale = dim**-0.5
    for layer in (0, 1):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, cache, layer, table, ctx, scale, out=out, min_split=min_split)
        ref = reference(q, cache, layer, table.cpu(), ctx.cpu(), scale, 0)
        assert not out.isnan().any(), "an output element was not written (or a NaN key was read)"
        assert torch.equal(out[4].cpu(), torch.zeros_like(out[4].cpu())), "a padded row must come out as zeros"
        assert _rel_err(out, ref) < TOL, _rel_err(out, ref)


def test_min_split_must_be_whole_tiles() -> None:
    from pdkernels.decode_attention import BLOCK_N

    q = torch.zeros(1, 4, 64, device=DEVICE, dtype=DTYPE)
    cache = torch.zeros(2, 1, 2, 16, 1, 64, device=DEVICE, dtype=DTYPE)
    one = torch.ones(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="min_split"):
        paged_decode_attention(q, cache, 0, one, one.view(1), 1.0, min_split=BLOCK_N + 1)


@pytest.mark.parametrize("fill", ["partial", "full", "wrapped"])
@pytest.mark.parametrize("window", [48, 128])  # 128: tiles inside the ring (PAGE_TILES)
def test_ring_decode_matches_reference(fill: str, window: int) -> None:
    gen = _gen("ring", fill, window)
    heads, kv_heads, dim, slots = 8, 2, 64, 6
    w = window
    ctx_lens = {"partial": [1, 5, w - 1], "full": [w, w, w], "wrapped": [w + 1, 2 * w, 2 * w + 34]}[fill] + [0]
    ring = _rand(gen, slots, 3, 2, window, kv_heads, dim)
    for b, n in enumerate(ctx_lens):  # indices a sequence has not written yet are NaN
        if 0 < n < window:
            ring[b + 1, :, :, n:] = float("nan")
    table = torch.tensor([[b + 1] for b in range(len(ctx_lens))], dtype=torch.int32, device=DEVICE)
    table[-1, 0] = -1  # a padded row's dummy slot is never touched
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    q = _rand(gen, len(ctx_lens), heads, dim)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, ring, 2, table, ctx, 0.1, window=window, out=out)
    ref = reference(q, ring, 2, table.clamp_min(0).cpu(), ctx.cpu(), 0.1, window)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < TOL


@pytest.mark.parametrize("is_ring", [False, True])
def test_store_decode_kv(is_ring: bool) -> None:
    gen = _gen("store", is_ring)
    kv_heads, dim, unit_tokens, units = 2, 64, 16, 9
    cache = _rand(gen, units, 3, 2, unit_tokens, kv_heads, dim)
    before = cache.clone()
    ctx_lens = [5, 0, 16, 17, 40]
    table = torch.tensor([[3, 1, 4], [8, 8, 8], [2, 0, 0], [6, 5, 0], [0, 1, 7]], dtype=torch.int32)
    if is_ring:
        table = table[:, :1].contiguous()
    qkv = _rand(gen, len(ctx_lens), 4 + 2 * kv_heads, dim)  # a packed projection: k, v are strided views
    k, v = qkv[:, 4 : 4 + kv_heads], qkv[:, 4 + kv_heads :]
    store_decode_kv(k, v, cache, 1, table.to(DEVICE), torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), is_ring)
    expect = before.clone()
    for b, n in enumerate(ctx_lens):
        if n == 0:
            continue
        pos = n - 1
        unit = int(table[b, 0]) if is_ring else int(table[b, pos // unit_tokens])
        expect[unit, 1, 0, pos % unit_tokens] = k[b]
        expect[unit, 1, 1, pos % unit_tokens] = v[b]
    assert torch.equal(cache, expect)


def test_row_is_batch_invariant() -> None:
    """A row's output is bit-identical alone, in a batch of 64, and at another index of the batch."""
    gen = _gen("invariance")
    heads, kv_heads, dim, block_size = 32, 8, 128, 16
    batch = 64 if DEVICE.type == "cuda" else 8
    ctx_lens = torch.randint(1, 1 + 1500 * SCALE_CTX + 200, (batch,), generator=gen).tolist()
    cache, table = _paged_setup(gen, ctx_lens, block_size, kv_heads, dim, num_layers=1)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    q = _rand(gen, batch, heads, dim)
    full = paged_decode_attention(q, cache, 0, table, ctx, 0.09)
    for i in (0, 5, batch - 1):
        alone = paged_decode_attention(q[i : i + 1], cache, 0, table[i : i + 1], ctx[i : i + 1], 0.09)
        assert torch.equal(alone[0], full[i])
    perm = torch.randperm(batch, generator=gen).to(DEVICE)
    shuffled = paged_decode_attention(q[perm], cache, 0, table[perm], ctx[perm], 0.09)
    assert torch.equal(shuffled, full[perm])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="timing needs the GPU")
def test_decode_bandwidth_report() -> None:
    """Not a bar: prints the GB/s the kernel reaches at llama-8B shapes (one layer's KV at 1k context)."""
    from triton.testing import do_bench

    gen = _gen("bench")
    heads, kv_heads, dim, block_size = 32, 8, 128, 128
    for batch, n in ((1, 1024), (64, 1024), (8, 8192)):
        need = math.ceil(n / block_size)
        cache = _rand(gen, batch * need + 1, 1, 2, block_size, kv_heads, dim)
        table = torch.randperm(batch * need, generator=gen).view(batch, need).to(torch.int32).to(DEVICE)
        ctx = torch.full((batch,), n, dtype=torch.int32, device=DEVICE)
        q = _rand(gen, batch, heads, dim)
        args = (q, cache, 0, table, ctx, 0.09)
        ms = do_bench(lambda a=args: paged_decode_attention(*a), warmup=25, rep=100, return_mode="median")
        kv_bytes = batch * n * 2 * kv_heads * dim * 2
        print(f"decode attention b={batch} ctx={n}: {ms * 1e3:.1f} us, {kv_bytes / ms / 1e6:,.0f} GB/s of KV read")


@pytest.mark.parametrize("window,block_size", [(0, 16), (48, 16), (0, 128), (128, 16)])
def test_attention_stores_the_new_token(window: int, block_size: int) -> None:
    """With k_new/v_new the kernel stores them (the cache's entry there was stale: NaN) and attends with
    them: the same output as storing first with store_decode_kv, and the same cache afterwards."""
    gen = _gen("fused-store", window, block_size)
    heads, kv_heads, dim = 8, 2, 64
    ctx_lens = [1, 17, 300, 0, window + 1, 2 * window] if window else [1, 17, 300, 0, 33, 160]
    if window:
        cache = _rand(gen, len(ctx_lens) + 1, 2, 2, window, kv_heads, dim)
        table = torch.arange(1, len(ctx_lens) + 1, dtype=torch.int32, device=DEVICE).view(-1, 1)
    else:
        cache, table = _paged_setup(gen, ctx_lens, block_size, kv_heads, dim)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    k_new, v_new = _rand(gen, len(ctx_lens), kv_heads, dim), _rand(gen, len(ctx_lens), kv_heads, dim)
    stored = cache.clone()
    store_decode_kv(k_new, v_new, stored, 1, table, ctx, is_ring=bool(window))
    for b, n in enumerate(ctx_lens):  # poison each new token's slot in the cache the kernel gets
        if n:
            unit = int(table[b, 0]) if window else int(table[b, (n - 1) // block_size])
            cache[unit, 1, :, (n - 1) % (window or block_size)] = float("nan")
    q = _rand(gen, len(ctx_lens), heads, dim)
    expect = paged_decode_attention(q, stored, 1, table, ctx, 0.125, window=window)
    got = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, 1, table, ctx, 0.125, window=window, out=got, k_new=k_new, v_new=v_new)
    assert torch.equal(got, expect)
    assert torch.equal(cache.nan_to_num(7.0), stored.nan_to_num(7.0))


def _one_layer_setup(gen: torch.Generator, window: int, kv_heads: int, dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's cache, table and context lengths for five rows (one key, 17, three splits of 300, a
    padded row, and a wrapped ring or a few pages): rings of `window` tokens, else 16-token pages."""
    ctx_lens = [1, 17, 300, 0, 2 * 48 + 5] if window else [1, 17, 300, 0, 129]
    if window:
        cache = _rand(gen, len(ctx_lens) + 1, 1, 2, window, kv_heads, dim)
        table = torch.arange(1, len(ctx_lens) + 1, dtype=torch.int32, device=DEVICE).view(-1, 1)
    else:
        cache, table = _paged_setup(gen, ctx_lens, 16, kv_heads, dim, num_layers=1)
    return cache, table, torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("window", [0, 48])
def test_sinks_match_reference(window: int) -> None:
    """Attention sinks join each head's denominator once, however many splits the keys take (300 keys:
    three); a padded row still comes out as zeros; a row alone equals its row in the batch."""
    gen = _gen("sinks", window)
    heads, kv_heads, dim = 8, 2, 64
    sinks = torch.tensor([-4.0, 0.0, 1.5, 3.0, 6.0, -1.0, 2.0, 0.5]).to(DEVICE, DTYPE)
    cache, table, ctx = _one_layer_setup(gen, window, kv_heads, dim)
    q = _rand(gen, ctx.numel(), heads, dim)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, 0, table, ctx, 0.125, window=window, out=out, sinks=sinks)
    ref = reference(q, cache, 0, table.cpu(), ctx.cpu(), 0.125, window, sinks)
    assert not out.isnan().any()
    assert torch.equal(out[3].cpu(), torch.zeros_like(out[3].cpu())), "a padded row must come out as zeros"
    assert _rel_err(out, ref) < TOL, _rel_err(out, ref)
    plain = paged_decode_attention(q, cache, 0, table, ctx, 0.125, window=window)
    assert (out - plain).abs().max() > 0.05
    alone = paged_decode_attention(q[2:3], cache, 0, table[2:3], ctx[2:3], 0.125, window=window, sinks=sinks)
    assert torch.equal(alone[0], out[2])
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(q, cache, 0, table, ctx, 0.125, window=window, sinks=sinks[:4])


@pytest.mark.parametrize("qk_norm,is_gemma", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("window", [0, 48])
def test_rope_in_the_kernel_equals_rotating_first(window: int, qk_norm: bool, is_gemma: bool) -> None:
    """With rope the kernel norms (qk-norm models) and rotates the raw q and new k itself: the output and
    the stored key equal those of fused_ops.qk_rope_ applied first and the kernel run without rope."""
    from pdkernels.decode_attention import Rope
    from pdkernels.fused_ops import qk_rope_

    gen = _gen("rope", window, qk_norm, is_gemma)
    heads, kv_heads, dim = 8, 2, 64
    cache, table, ctx = _one_layer_setup(gen, window, kv_heads, dim)
    qkv = _rand(gen, ctx.numel(), heads + 2 * kv_heads, dim)
    cos, sin = _rand(gen, ctx.numel(), dim), _rand(gen, ctx.numel(), dim)
    qw = kw = None
    if qk_norm:
        qw, kw = _rand(gen, dim) * 0.3 + (0.0 if is_gemma else 1.0), _rand(gen, dim) * 0.3 + (0.0 if is_gemma else 1.0)
    rotated = qkv.clone()
    qk_rope_(rotated[:, : heads + kv_heads], heads, cos, sin, qw, kw, 1e-6, is_gemma)
    q, k, v = rotated.split([heads, kv_heads, kv_heads], dim=1)
    expect_cache = cache.clone()
    expect = paged_decode_attention(q, expect_cache, 0, table, ctx, 0.125, window=window, k_new=k, v_new=v)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    got = torch.full_like(q, float("nan"))
    rope = Rope(cos, sin, qw, kw, 1e-6, is_gemma)
    paged_decode_attention(q, cache, 0, table, ctx, 0.125, window=window, out=got, k_new=k, v_new=v, rope=rope)
    assert torch.equal(got, expect)
    assert torch.equal(cache.nan_to_num(7.0), expect_cache.nan_to_num(7.0))
    assert not torch.equal(qkv, rotated)
    with pytest.raises(ValueError, match="rope"):
        paged_decode_attention(q, cache, 0, table, ctx, 0.125, window=window, rope=rope)
