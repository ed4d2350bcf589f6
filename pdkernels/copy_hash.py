"""One pass over int64 words that copies them (optionally) and returns the per-chunk sums of the
payload checksum (transfer/checksum.py), so a copy that has to happen anyway hashes for free.

Source addressing (word i of the segment, i in [0, num_words)):

    flat:   src[i]
    paged:  src[page_ids[i // page_words] * page_words + i % page_words]      (a pool of pages)

    segment words: | page_ids[0] ......... | page_ids[1] ......... | ... |
    chunks:        | chunk 0 (1 MiB) | chunk 1 | chunk 2 | ...            (need not align with pages)

The destination, when given, is flat, dst[i], or paged the same way (dst_ids, pages of the same size: the
ipc receiver copying a sender's pool pages straight into its own pool's). sums[c] = K_c * sum_j x(w[c*CHUNK + j], keys[j]) over
the chunk's live words, x = y ^ (y >> 31), y = (w ^ keys[j]) * MUL (wrapping int64, >> arithmetic),
K_c the chunk's key (chunk_keys[c]): a segment's S is the wrapping sum of its sums (checksum.py), which
the caller takes on the device or, once copied to host memory, with numpy (pdkernels/checksum_gpu.py).

One program per chunk, BLOCK words per step. When BLOCK divides page_words, a step never crosses a
page, so the page lookup (of each paged side) is one scalar load per step (PAGE_STEPS); otherwise per word. Triton is
imported on first use, so this module imports on a machine without it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

MAX_BLOCK_WORDS = 2048  # 16 KiB per step of a program
NUM_WARPS = 16  # the fastest of 4, 8 and 16 for a 2 GiB copy+hash on the H200 (bench/figures/code-choices.md)


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_hash(
        src_ptr, ids_ptr, dst_ptr, dst_ids_ptr, keys_ptr, ckeys_ptr, out_ptr, num_words, page_words, num_pages,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr, MUL: tl.constexpr,
        PAGED: tl.constexpr, DST_PAGED: tl.constexpr, PAGE_STEPS: tl.constexpr, WRITE: tl.constexpr,
    ):  # fmt: skip
        c = tl.program_id(0)
        base = c.to(tl.int64) * CHUNK
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for j0 in range(0, CHUNK, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            idx = base + j
            live = idx < num_words
            if PAGED or DST_PAGED:
                if PAGE_STEPS:  # the whole step lies in one page
                    p = tl.minimum((base + j0) // page_words, num_pages - 1)
                else:
                    p = tl.minimum(idx // page_words, num_pages - 1)
                within = idx - p * page_words
            if PAGED:
                if PAGE_STEPS:
                    page = tl.load(ids_ptr + p)
                else:
                    page = tl.load(ids_ptr + p, mask=live, other=0)
                src = page * page_words + within
            else:
                src = idx
            w = tl.load(src_ptr + src, mask=live, other=0)
            if WRITE:
                if DST_PAGED:
                    if PAGE_STEPS:
                        dst_page = tl.load(dst_ids_ptr + p)
                    else:
                        dst_page = tl.load(dst_ids_ptr + p, mask=live, other=0)
                    tl.store(dst_ptr + dst_page * page_words + within, w, mask=live)
                else:
                    tl.store(dst_ptr + idx, w, mask=live)
            y = (w ^ tl.load(keys_ptr + j)) * MUL
            acc += tl.where(live, y ^ (y >> 31), 0)
        tl.store(out_ptr + c, tl.sum(acc, axis=0) * tl.load(ckeys_ptr + c))

    return copy_hash


def _block_words(page_words: int) -> int:
    """The largest power of two <= MAX_BLOCK_WORDS dividing page_words (steps stay in one page), or
    MAX_BLOCK_WORDS when that is too small to be worth it (then pages are looked up per word)."""
    b = MAX_BLOCK_WORDS
    while b > 256 and page_words % b:
        b //= 2
    return b if page_words % b == 0 else MAX_BLOCK_WORDS


def copy_hash(
    src: torch.Tensor,
    num_words: int,
    keys: torch.Tensor,
    chunk_keys: torch.Tensor,
    mul: int,
    chunk_words: int,
    *,
    dst: torch.Tensor | None = None,
    page_ids: torch.Tensor | None = None,
    page_words: int = 0,
    dst_page_ids: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-chunk weighted sums (int64, [ceil(num_words / chunk_words)], on src's device) of num_words
    words of src (int64, contiguous; a pool of pages of page_words words when page_ids, int64, is
    given), copied to dst[:num_words] (int64, contiguous; a pool of pages of page_words words when
    dst_page_ids is given, word i then landing in page dst_page_ids[i // page_words]) on the way when dst
    is given. chunk_keys:
    K_c of each chunk (int64, at least that many); out: where the sums go (a contiguous int64 slice
    of that length, e.g. of one buffer for several segments), else new memory. Queued on the current
    stream; nothing waits for it."""
    num_chunks = -(-num_words // chunk_words)
    sums = torch.empty(num_chunks, dtype=torch.int64, device=src.device) if out is None else out
    if sums.numel() != num_chunks or chunk_keys.numel() < num_chunks:
        raise ValueError(f"{num_chunks} chunks: out has {sums.numel()} sums, chunk_keys {chunk_keys.numel()} keys")
    if num_chunks == 0:
        return sums
    paged, dst_paged = page_ids is not None, dst_page_ids is not None and dst is not None
    ids = page_ids if page_ids is not None else dst_page_ids
    if dst_paged and paged and dst_page_ids.numel() != page_ids.numel():  # type: ignore[union-attr]
        raise ValueError("a paged copy's source and destination name as many pages")
    block = _block_words(page_words) if paged or dst_paged else MAX_BLOCK_WORDS
    _kernel()[(num_chunks,)](
        src, page_ids if paged else src, dst if dst is not None else src, dst_page_ids if dst_paged else src,
        keys, chunk_keys, sums, num_words, max(page_words, 1), ids.numel() if ids is not None else 1,
        CHUNK=chunk_words, BLOCK=block, MUL=mul, PAGED=paged, DST_PAGED=dst_paged,
        PAGE_STEPS=(paged or dst_paged) and page_words % block == 0, WRITE=dst is not None, num_warps=NUM_WARPS,
    )  # fmt: skip
    return sums
