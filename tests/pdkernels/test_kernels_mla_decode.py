"""The paged latent decode kernel (pdkernels/mla_decode.py) against attention written out in float64:
latents in scattered pages, several splits of a long context, a padded row, heads that do not fill a tile,
widths that are not powers of two; a row's output the same alone and in a batch, bit for bit; decode rows'
new latents stored through their block tables, a padded row writing nothing. Skipped
without CUDA; TRITON_INTERPRET=1 runs it on the CPU in float32 at small shapes."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_support import DEVICE, DTYPE, require_triton

require_triton()

from pdkernels.mla_decode import paged_latent_decode, store_latents  # noqa: E402

pytestmark = pytest.mark.cuda
IS_CUDA = DEVICE.type == "cuda"
TOL = 2e-2 if DTYPE == torch.bfloat16 else 1e-5
BLOCK = 16
# (heads, rank, rope_dim): a tiny model's; on CUDA also DeepSeek-V3's (512 + 64) with 16 heads
SHAPES = [(4, 32, 16), (20, 48, 8)] + ([(16, 512, 64), (128, 512, 64)] if IS_CUDA else [])


def _setup(gen: torch.Generator, lens: list[int], heads: int, rank: int, rope: int):  # type: ignore[no-untyped-def]
    width = rank + rope
    pages = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(pages) + 3
    cache = (torch.randn(num_blocks, 2, 1, BLOCK, 1, width, generator=gen)).to(DEVICE, DTYPE)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered pages
    table = torch.zeros(len(lens), max(max(pages), 1), dtype=torch.int32)
    at = 0
    for i, count in enumerate(pages):
        table[i, :count] = torch.tensor(perm[at : at + count])
        at += count
    q = (torch.randn(len(lens), heads, width, generator=gen) * 0.3).to(DEVICE, DTYPE)
    return q, cache, table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _reference(q, cache, table, lens, rank, scale):  # type: ignore[no-untyped-def]
    out = torch.zeros(q.shape[0], q.shape[1], rank, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        blocks = table[b, : -(-n // BLOCK)].long()
        lat = cache[blocks, 1, 0, :, 0, :].reshape(-1, cache.shape[-1])[:n].double().cpu()
        p = torch.softmax(q[b].double().cpu() @ lat.t() * scale, dim=-1)
        out[b] = p @ lat[:, :rank]
    return out


@pytest.mark.parametrize("heads,rank,rope", SHAPES)
def test_matches_float64(heads: int, rank: int, rope: int) -> None:
    gen = torch.Generator().manual_seed(heads + rank)
    lens = [1, 37, 0, 300] + ([1500] if IS_CUDA else [])  # one page, a ragged page, padded, several splits
    q, cache, table, ctx = _setup(gen, lens, heads, rank, rope)
    scale = (rank + rope) ** -0.5
    out = paged_latent_decode(q, cache, 1, table, ctx, rank, scale)
    assert out.shape == (len(lens), heads, rank) and out.dtype == DTYPE
    ref = _reference(q, cache, table, ctx, rank, scale)
    assert torch.equal(out[2].float().cpu(), torch.zeros(heads, rank))
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert float(err) < TOL, float(err)


def test_a_row_alone_equals_the_row_in_a_batch_and_refusals() -> None:
    gen = torch.Generator().manual_seed(5)
    q, cache, table, ctx = _setup(gen, [300, 9, 140], 4, 32, 16)
    batch = paged_latent_decode(q, cache, 1, table, ctx, 32, 0.1)
    alone = paged_latent_decode(q[:1].contiguous(), cache, 1, table[:1].contiguous(), ctx[:1].contiguous(), 32, 0.1)
    assert torch.equal(batch[:1], alone)
    with pytest.raises(ValueError, match="do not fit"):
        paged_latent_decode(q[..., :40].contiguous(), cache, 1, table, ctx, 32, 0.1)
    with pytest.raises(ValueError, match="latent cache"):
        paged_latent_decode(q, cache.expand(-1, -1, 2, -1, -1, -1), 1, table, ctx, 32, 0.1)


def test_store_latents_writes_each_row_at_its_position_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(7)
    lens = [37, 0, 16, 1]  # a ragged page, a padded row, a full page, a first token
    _, cache, table, ctx = _setup(gen, lens, 4, 32, 9)
    table[1] = table[2]  # the padded row points at a page a real row owns: it must not write there
    new = torch.randn(len(lens), cache.shape[-1], generator=gen).to(DEVICE, DTYPE)
    before = cache.clone()
    store_latents(new, cache, 1, table, ctx)
    expect = before.clone()
    for b, n in enumerate(lens):
        if n:
            page = int(table[b, (n - 1) // BLOCK])
            expect[page, 1, 0, (n - 1) % BLOCK, 0] = new[b]
    assert torch.equal(cache, expect)
    with pytest.raises(ValueError, match="do not fit"):
        store_latents(new[:, :-1].contiguous(), cache, 1, table, ctx)
