"""The fused copy+hash kernel (pdkernels/copy_hash.py) with its chunk keys applied in the kernel, and
several segments' sums in one buffer folded on the host (checksum_gpu.SegmentSums, the ipc
receiver's way), against the torch checksum: flat and paged sources, paged destinations (pages of
one pool into another's), ragged last chunks, an empty segment. On CUDA, or on the CPU with TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_support import DEVICE, require_triton

require_triton()

from pdkernels.checksum import CHUNK_WORDS, MASK64, torch_segment_sum  # noqa: E402
from pdkernels.checksum_gpu import SegmentSums, _launch, copy_segments  # noqa: E402


def _words(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64).to(DEVICE)


@pytest.mark.parametrize("first_chunk", [0, 3])
def test_weighted_chunk_sums_add_up_to_the_segment_sum(first_chunk: int) -> None:
    w = _words(2 * CHUNK_WORDS + 999, 1)
    dst = torch.full_like(w, -1)
    sums = _launch(w, w.numel(), first_chunk, dst=dst)
    assert sums.shape == (3,) and torch.equal(dst, w)
    assert int(sums.sum()) & MASK64 == torch_segment_sum(w, first_chunk)


def test_paged_source_into_a_slice_of_a_shared_buffer() -> None:
    page_words = 6144
    pool = _words(40 * page_words, 2).view(40, page_words)
    ids = torch.tensor([7, 3, 39, 0, 12, 25, 1, 30, 8, 9, 11, 22, 5, 33, 2, 17, 18, 19, 20, 21, 23, 24, 26],
                       dtype=torch.int64, device=DEVICE)  # fmt: skip
    want = pool[ids].reshape(-1)  # 23 pages: 141,312 words, 2 chunks
    got = torch.empty_like(want)
    buf = torch.full((5,), 77, dtype=torch.int64, device=DEVICE)
    _launch(pool.reshape(-1), want.numel(), dst=got, page_ids=ids, page_words=page_words, out=buf[1:3])
    assert torch.equal(got, want)
    assert buf[0] == 77 and bool((buf[3:] == 77).all())  # nothing written outside its slice
    assert int(buf[1:3].sum()) & MASK64 == torch_segment_sum(want, 0)


@pytest.mark.parametrize("page_words", [6144, 1000])  # steps inside a page, and steps across pages
@pytest.mark.parametrize("paged_source", [True, False])
def test_into_pages_of_another_pool(page_words: int, paged_source: bool) -> None:
    src_pool = _words(30 * page_words, 3).view(30, page_words)
    src_ids = torch.tensor([4, 29, 0, 17, 5, 6, 7, 21, 13, 2, 11, 8, 9, 10, 12, 14, 15, 16, 18, 19, 20, 22, 23],
                           dtype=torch.int64, device=DEVICE)  # fmt: skip
    want = src_pool[src_ids].reshape(-1)
    dst_pool = torch.full((40, page_words), -1, dtype=torch.int64, device=DEVICE)
    dst_ids = torch.randperm(40, generator=torch.Generator().manual_seed(4))[:23].to(DEVICE)
    if paged_source:
        sums = _launch(src_pool.reshape(-1), want.numel(), dst=dst_pool.reshape(-1), page_ids=src_ids,
                       page_words=page_words, dst_page_ids=dst_ids)  # fmt: skip
    else:
        sums = _launch(want, want.numel(), dst=dst_pool.reshape(-1), page_words=page_words, dst_page_ids=dst_ids)
    assert torch.equal(dst_pool[dst_ids].reshape(-1), want)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[dst_ids.cpu()] = False
    assert bool((dst_pool[untouched.to(DEVICE)] == -1).all())  # no page outside dst_ids written
    assert int(sums.sum()) & MASK64 == torch_segment_sum(want, 0)


def test_segments_folded_on_the_host_match_torch() -> None:
    segs = [_words(n, 10 + n % 7) for n in (CHUNK_WORDS + 5, 17, 3 * CHUNK_WORDS)]
    bounds = [0, 2, 3, 6]
    buf = torch.empty(bounds[-1], dtype=torch.int64, device=DEVICE)
    outs = [torch.empty_like(s) for s in segs]
    for i, (s, d) in enumerate(zip(segs, outs)):
        _launch(s, s.numel(), dst=d, out=buf[bounds[i] : bounds[i + 1]])
    got = SegmentSums(buf, bounds).fold(buf.cpu())
    assert got == [torch_segment_sum(s, 0) for s in segs]
    assert all(torch.equal(s, d) for s, d in zip(segs, outs))
    flipped = segs[1].clone()
    flipped[3] ^= 1 << 40
    assert torch_segment_sum(flipped, 0) != got[1]  # the sums see a changed word


def test_out_of_the_wrong_length_is_refused() -> None:
    w = _words(CHUNK_WORDS + 1, 3)
    with pytest.raises(ValueError, match="2 chunks"):
        _launch(w, w.numel(), out=torch.empty(1, dtype=torch.int64, device=DEVICE))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="copy_segments runs on CUDA tensors only")
def test_copy_segments_on_cuda() -> None:
    src = [_words(n, n).view(torch.uint8) for n in (CHUNK_WORDS * 2 + 3, 1000, 0)]
    dst = [torch.empty_like(s) for s in src]
    got = copy_segments(dst, src)
    assert got is not None and got.bounds == [0, 3, 4, 4]
    assert got.fold(got.sums.cpu()) == [torch_segment_sum(s.view(torch.int64), 0) for s in src]
    assert all(torch.equal(s, d) for s, d in zip(src, dst))
