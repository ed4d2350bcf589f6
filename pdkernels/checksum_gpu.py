"""The payload checksum of pdkernels/checksum.py in one pass over GPU memory (pdkernels/copy_hash.py, Triton),
alone or fused with the copy that moves the bytes anyway.

Why: the torch version runs the definition as five elementwise passes and a reduction, about ten
times the payload's bytes through device memory plus a few hundred launches for a long sequence,
and a handoff hashes twice (sender and receiver). The kernel reads
each word once, mixes it with its position key (1 MiB of keys, read from L2) and sums a chunk in
registers; torch then weights the per-chunk sums by their chunk keys (kept on the device).

Three uses, one kernel:
    segment_sum(words)               hash only (checksum.segment_sum on CUDA)
    gather_pages(pool, ids, out)     the PE's export gather, hashing the pages it writes
    copy_segment(dst, src)           the ipc receiver's copy out of the sender's memory

Integer arithmetic wraps mod 2^64 in Triton as in torch and numpy, and >> of a signed int64 is
arithmetic in all three, so the value is the definition's bit for bit. Still, the kernel is used on a
device only after every variant has matched the torch version there on random words (checked once
per device and process); otherwise, or without Triton, callers keep their torch paths.
"""

from __future__ import annotations

import logging
import threading
from functools import cache
from typing import Any

import torch

from pdkernels.checksum import (
    CHUNK_WORDS,
    MASK64,
    MUL,
    make_chunk_keys,
    position_keys,
    signed64,
    torch_segment_sum,
)
from pdkernels.copy_hash import copy_hash

log = logging.getLogger("transfer.checksum")
_KEYS: dict[torch.device, torch.Tensor] = {}
_KEYS_LOCK = threading.Lock()
MIN_CACHED_CHUNK_KEYS = 4096  # 4 GiB of chunks: enough for one segment of a long sequence


def chunk_keys(first: int, count: int, device: torch.device) -> torch.Tensor:
    """K_c for c in [first, first + count), kept on the device (no host copy, so no sync, per call)."""
    with _KEYS_LOCK:
        keys = _KEYS.get(device)
        if keys is None or keys.numel() < first + count:
            keys = make_chunk_keys(0, max(MIN_CACHED_CHUNK_KEYS, 2 * (first + count)), device)
            _KEYS[device] = keys
    return keys[first : first + count]


@cache
def _kernel_args() -> tuple[Any, Any, int, int]:
    """The kernel and its fixed arguments' sources, looked up once (a handoff's launch is host-bound)."""
    return copy_hash, position_keys, signed64(MUL), CHUNK_WORDS


def _launch(
    src: torch.Tensor,
    num_words: int,
    first_chunk: int = 0,
    dst: torch.Tensor | None = None,
    page_ids: torch.Tensor | None = None,
    page_words: int = 0,
) -> torch.Tensor:
    """S of the num_words words (0-dim int64 on the device, mod 2^64 as a signed value); queued only."""
    copy_hash, position_keys, mul, chunk_words = _kernel_args()
    sums = copy_hash(
        src, num_words, position_keys(src.device), mul, chunk_words,
        dst=dst, page_ids=page_ids, page_words=page_words,
    )  # fmt: skip
    return (sums * chunk_keys(first_chunk, sums.numel(), src.device)).sum()


def segment_sum(words: torch.Tensor, first_chunk: int) -> int:
    """checksum.segment_sum through the kernel (words: int64, contiguous, on a CUDA device)."""
    return int(_launch(words, words.numel(), first_chunk)) & MASK64


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous tensor's bytes as int64 words, if they are whole aligned words (else None)."""
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 8 or t.data_ptr() % 8:
        return None
    return t.reshape(-1).view(torch.uint8).view(torch.int64)


def gather_pages(pool: torch.Tensor, block_ids: list[int], out: torch.Tensor) -> torch.Tensor | None:
    """out[i] = pool[block_ids[i]] (pool: [num_blocks, ...] pages, out: [len(block_ids), ...]) in one
    pass that also hashes out's bytes: returns its S (checksum.py) as a 0-dim int64 device tensor,
    queued on the current stream (read it later: no sync here). None, with out untouched, when the
    kernel cannot do it on this device or for these tensors (the caller gathers with torch)."""
    src, dst = _words(pool), _words(out)
    page_bytes = pool[0].numel() * pool.element_size() if pool.shape[0] else 0
    if (
        src is None
        or dst is None
        or not block_ids
        or page_bytes % 8
        or out.shape[0] != len(block_ids)
        or out.shape[1:] != pool.shape[1:]
        or out.dtype != pool.dtype
        or out.device != pool.device
        or not pool.is_cuda
        or not usable(pool.device)
    ):
        return None
    ids = torch.tensor(block_ids, dtype=torch.int64).to(pool.device, non_blocking=True)
    page_words = page_bytes // 8
    return _launch(src, dst.numel(), dst=dst, page_ids=ids, page_words=page_words)


def copy_segment(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor | None:
    """dst.copy_(src) for two contiguous tensors of the same byte size on one CUDA device, hashing
    the bytes on the way: dst's S as a 0-dim int64 device tensor (queued), or None (nothing done)
    when the kernel cannot (the caller copies and hashes with torch)."""
    s, d = _words(src), _words(dst)
    if s is None or d is None or s.numel() != d.numel() or not dst.is_cuda or src.device != dst.device:
        return None
    if not usable(dst.device):
        return None
    return _launch(s, s.numel(), dst=d)


@cache
def usable(device: torch.device) -> bool:
    """Whether the kernel runs on device and every variant (hash only, copy, paged gather with steps
    inside a page or across pages) gives the torch version's sums and bytes (checked once)."""
    def torch_s(words: torch.Tensor, first: int = 0) -> int:
        return torch_segment_sum(words, first)

    try:
        g = torch.Generator().manual_seed(7)
        n = 2 * CHUNK_WORDS + 12345
        words = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64).to(device)
        ok = all(
            int(_launch(words[lo:], n - lo, k)) & MASK64 == torch_s(words[lo:], k)
            for lo, k in ((0, 0), (CHUNK_WORDS, 5))
        )
        out = torch.full_like(words, -1)
        ok = ok and int(_launch(words, n, dst=out)) & MASK64 == torch_s(words) and torch.equal(out, words)
        # pages that do not divide the chunk: steps inside a page (2048 | 6144), and across (1000)
        for page_words in (6144, 1000):
            pool = words[: (n // page_words) * page_words].view(-1, page_words)
            ids = torch.randperm(pool.shape[0], generator=g)[: pool.shape[0] - 3].to(device)
            want = pool[ids].reshape(-1)
            got = torch.full_like(want, -1)
            s = _launch(pool.reshape(-1), want.numel(), dst=got, page_ids=ids, page_words=page_words)
            ok = ok and int(s) & MASK64 == torch_s(want) and torch.equal(got, want)
    except Exception as e:  # no Triton, or it cannot build for this device
        log.info("payload checksum on %s: torch path (Triton kernel unavailable: %r)", device, e)
        return False
    if not ok:
        log.warning("payload checksum on %s: the Triton kernel disagrees with torch; using torch", device)
    return ok
