"""The payload checksum of checksum.py in one pass over GPU memory (a Triton kernel).

Why: the torch version runs the definition as five elementwise passes and a reduction, about ten
times the payload's bytes through device memory plus a few hundred launches for a long sequence
(~6 ms for 2 GiB on an H200), and a handoff hashes twice (sender and receiver). Here one program
hashes one 1 MiB chunk: it reads each word once, mixes it with its position key (1 MiB of keys,
read from L2) and sums in registers; torch then weights the per-chunk sums by their chunk keys.

Integer arithmetic wraps mod 2^64 in Triton as in torch and numpy, and >> of a signed int64 is
arithmetic in all three, so the value is the definition's bit for bit. Still, the kernel is used on a
device only after it has matched the torch version there on random words (checked once per device
and process); otherwise, or without Triton, checksum.py keeps its torch path.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import torch

log = logging.getLogger("transfer.checksum")
BLOCK_WORDS = 2048  # words per inner step of a program (16 KiB)


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_sums(
        words_ptr, keys_ptr, out_ptr, num_words, CHUNK: tl.constexpr, BLOCK: tl.constexpr, MUL: tl.constexpr
    ):
        c = tl.program_id(0)
        base = c.to(tl.int64) * CHUNK
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for j0 in range(0, CHUNK, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            idx = base + j
            live = idx < num_words
            w = tl.load(words_ptr + idx, mask=live, other=0)
            y = (w ^ tl.load(keys_ptr + j)) * MUL
            acc += tl.where(live, y ^ (y >> 31), 0)
        tl.store(out_ptr + c, tl.sum(acc, axis=0))

    return chunk_sums


def segment_sum(words: torch.Tensor, first_chunk: int) -> int:
    """checksum.segment_sum through the kernel (words: int64, contiguous, on any device Triton runs on)."""
    from transfer.checksum import CHUNK_WORDS, MASK64, MUL, _chunk_keys, _position_keys, _signed

    n = words.numel()
    num_chunks = -(-n // CHUNK_WORDS)
    sums = torch.empty(num_chunks, dtype=torch.int64, device=words.device)
    _kernel()[(num_chunks,)](
        words, _position_keys(words.device), sums, n, CHUNK=CHUNK_WORDS, BLOCK=BLOCK_WORDS, MUL=_signed(MUL),
        num_warps=8,
    )  # fmt: skip
    return int((sums * _chunk_keys(first_chunk, num_chunks, words.device)).sum()) & MASK64


@cache
def usable(device: torch.device) -> bool:
    """Whether the kernel runs on device and gives the torch version's sums (checked once)."""
    from transfer.checksum import CHUNK_WORDS, _torch_segment_sum

    try:
        g = torch.Generator().manual_seed(7)
        words = torch.randint(-(2**62), 2**62, (2 * CHUNK_WORDS + 12345,), generator=g, dtype=torch.int64)
        words = words.to(device)
        ok = all(
            segment_sum(words[lo:], k) == _torch_segment_sum(words[lo:], k)
            for lo, k in ((0, 0), (CHUNK_WORDS, 5))
        )
    except Exception as e:  # no Triton, or it cannot build for this device
        log.info("payload checksum on %s: torch path (Triton kernel unavailable: %r)", device, e)
        return False
    if not ok:
        log.warning("payload checksum on %s: the Triton kernel disagrees with torch; using torch", device)
    return ok
