"""The payload checksum of pdkernels/checksum.py in one pass over GPU memory (pdkernels/copy_hash.py, Triton),
alone or fused with the copy that moves the bytes anyway.

Why: the torch version runs the definition as five elementwise passes and a reduction, about ten
times the payload's bytes through device memory plus a few hundred launches for a long sequence,
and a handoff hashes twice (sender and receiver). The kernel reads
each word once, mixes it with its position key (1 MiB of keys, read from L2) and sums a chunk in
registers; torch then weights the per-chunk sums by their chunk keys (kept on the device).

Four uses, one kernel:
    segment_sum(words)               hash only (checksum.segment_sum on CUDA)
    pages_sum(pool, ids)             hash only, of pages where they lie in a pool (a handoff received in
                                     place: checksum.pool_pages_sum on CUDA; an export offered in place:
                                     queued_pages_sum)
    gather_pages(pool, ids, out)     the PE's export gather, hashing the pages it writes
    copy_segments(dst, src)          the ipc receiver's copy out of the sender's memory (its sums
                                     read in host memory: SegmentSums.fold); either side may be Paged,
                                     pages of a pool (the sender's pool pages into the receiver's)

Integer arithmetic wraps mod 2^64 in Triton as in torch and numpy, and >> of a signed int64 is
arithmetic in all three, so the value is the definition's bit for bit. Still, the kernel is used on a
device only after every variant has matched the torch version there on random words (checked once
per device and process); otherwise, or without Triton, callers keep their torch paths.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
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

log = logging.getLogger(__name__)
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
    out: torch.Tensor | None = None,
    dst_page_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weighted per-chunk sums of the num_words words (copy_hash.py; into out when given), whose
    wrapping sum is S; queued only."""
    copy_hash, position_keys, mul, chunk_words = _kernel_args()
    keys = chunk_keys(first_chunk, -(-num_words // chunk_words), src.device)
    return copy_hash(
        src, num_words, position_keys(src.device), keys, mul, chunk_words,
        dst=dst, page_ids=page_ids, page_words=page_words, dst_page_ids=dst_page_ids, out=out,
    )  # fmt: skip


def _s(src: torch.Tensor, num_words: int, first_chunk: int = 0, **kw: Any) -> torch.Tensor:
    """S of the num_words words (0-dim int64 on the device, mod 2^64 as a signed value); queued only."""
    return _launch(src, num_words, first_chunk, **kw).sum()


def segment_sum(words: torch.Tensor, first_chunk: int) -> int:
    """checksum.segment_sum through the kernel (words: int64, contiguous, on a CUDA device)."""
    return int(_s(words, words.numel(), first_chunk)) & MASK64


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous tensor's bytes as int64 words, if they are whole aligned words (else None)."""
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 8 or t.data_ptr() % 8:
        return None
    return t.reshape(-1).view(torch.uint8).view(torch.int64)


@dataclass(frozen=True)
class _Side:
    """One side of a segment copy as the kernel takes it: int64 words, and the page ids if paged."""

    words: torch.Tensor
    ids: torch.Tensor | None = None
    page_words: int = 0

    @property
    def num_words(self) -> int:
        return self.words.numel() if self.ids is None else self.ids.numel() * self.page_words


def _paged_source(pool: torch.Tensor, block_ids: list[int] | tuple[int, ...]) -> _Side | None:
    """pool's pages block_ids as the kernel reads them (its words, the ids on its device, words per page),
    or None where the kernel cannot (no CUDA or no usable kernel here, no pages, pages not whole words)."""
    words = _words(pool)
    page_bytes = pool[0].numel() * pool.element_size() if pool.shape[0] else 0
    if words is None or not block_ids or page_bytes % 8 or not pool.is_cuda or not usable(pool.device):
        return None
    ids = torch.tensor(block_ids, dtype=torch.int64).to(pool.device, non_blocking=True)
    return _Side(words, ids, page_bytes // 8)


def gather_pages(pool: torch.Tensor, block_ids: list[int], out: torch.Tensor) -> torch.Tensor | None:
    """out[i] = pool[block_ids[i]] (pool: [num_blocks, ...] pages, out: [len(block_ids), ...]) in one
    pass that also hashes out's bytes: returns its S (checksum.py) as a 0-dim int64 device tensor,
    queued on the current stream (read it later: no sync here). None, with out untouched, when the
    kernel cannot do it on this device or for these tensors (the caller gathers with torch)."""
    dst = _words(out)
    fits = out.shape == (len(block_ids), *pool.shape[1:]) and out.dtype == pool.dtype and out.device == pool.device
    src = _paged_source(pool, block_ids) if dst is not None and fits else None
    if src is None or dst is None:
        return None
    return _s(src.words, dst.numel(), dst=dst, page_ids=src.ids, page_words=src.page_words)


def queued_pages_sum(pool: torch.Tensor, block_ids: list[int] | tuple[int, ...]) -> torch.Tensor | None:
    """S (checksum.py) of the pages pool[block_ids[0]], pool[block_ids[1]], ... as one segment, read where
    they lie in the pool (pool: [num_blocks, ...] pages, contiguous, on a CUDA device), in one pass: a
    0-dim int64 device tensor, queued on the current stream (no sync); None when the kernel cannot do
    it on this device or for this pool (the caller hashes another way)."""
    src = _paged_source(pool, block_ids)
    if src is None:
        return None
    return _s(src.words, src.num_words, page_ids=src.ids, page_words=src.page_words)


def pages_sum(pool: torch.Tensor, block_ids: list[int] | tuple[int, ...]) -> int | None:
    """queued_pages_sum, read (a sync)."""
    got = queued_pages_sum(pool, block_ids)
    return None if got is None else int(got) & MASK64


@dataclass(frozen=True)
class Paged:
    """A segment made of pages of a pool, in order: pool[ids[0]], pool[ids[1]], ... (pool: a contiguous
    tensor of whole pages, [num_blocks, ...]; ids: int64 block ids on its device, or in (pinned) host
    memory: copy_segments then moves them on the current stream, without a sync)."""

    pool: torch.Tensor
    ids: torch.Tensor

    @property
    def page_bytes(self) -> int:
        return self.pool[0].numel() * self.pool.element_size() if self.pool.shape[0] else 0

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.page_bytes

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def pages(self) -> torch.Tensor:
        """The pool as [num_blocks, page_bytes] bytes."""
        return self.pool.reshape(self.pool.shape[0], -1).view(torch.uint8)


Segment = torch.Tensor | Paged  # copy_segments' sides: a contiguous tensor, or pages of a pool


def torch_copy(dst: Segment, src: Segment) -> None:
    """dst <- src with torch, no hashing (the path where the kernel cannot run): flat bytes or pages."""
    data = src.pages()[src.ids] if isinstance(src, Paged) else src.reshape(-1).view(torch.uint8)
    if isinstance(dst, Paged):
        dst.pages()[dst.ids] = data.view(-1, dst.page_bytes)
    else:
        dst.reshape(-1).view(torch.uint8).copy_(data.reshape(-1), non_blocking=True)


class SegmentSums:
    """The ipc receiver's copy+hash of several segments: every chunk's weighted sum in one device
    buffer (sums), each segment's chunks a slice of it (bounds); S of each segment once the buffer
    (or a copy of it in host memory) is read."""

    def __init__(self, sums: torch.Tensor, bounds: list[int]) -> None:
        self.sums = sums  # int64 [total chunks]
        self.bounds = bounds  # segment i's chunks: sums[bounds[i]:bounds[i + 1]]

    def fold(self, host: torch.Tensor) -> list[int]:
        """Each segment's S from host, a CPU copy of sums (numpy's uint64 sums wrap mod 2^64)."""
        h = host.numpy().view(np.uint64)
        b = self.bounds
        return [int(h[b[i] : b[i + 1]].sum(dtype=np.uint64)) for i in range(len(b) - 1)]


def _side(t: Segment, moved: dict[int, torch.Tensor]) -> _Side | None:
    if isinstance(t, Paged):
        words = _words(t.pool)
        if words is None or t.page_bytes % 8 or t.ids.dtype != torch.int64:
            return None
        return _Side(words, _ids_on(t.ids, t.pool.device, moved), t.page_bytes // 8)
    words = _words(t)
    return None if words is None else _Side(words)


def _ids_on(ids: torch.Tensor, device: torch.device, moved: dict[int, torch.Tensor]) -> torch.Tensor:
    """ids on device, queued (no sync from pinned memory); ids that are slices of one host tensor move
    in one copy of it (moved: what this call moved so far, by the host tensor's id)."""
    base = ids._base
    if ids.device == device or base is None or base.dim() != 1 or ids.dim() != 1 or not ids.is_contiguous():
        return ids.to(device, non_blocking=True)
    on = moved.get(id(base))
    if on is None:
        on = moved[id(base)] = base.to(device, non_blocking=True)
    at = ids.storage_offset() - base.storage_offset()
    return on[at : at + ids.numel()]


def copy_segments(dst: list[Segment], src: list[Segment]) -> SegmentSums | None:
    """dst[i] <- src[i] for pairs of equal byte sizes on one CUDA device (each side a contiguous tensor or
    Paged; two paged sides have pages of one size), hashing the bytes on the way: one kernel launch per
    segment and one sums buffer for all of them, queued on the current stream (nothing waits). None,
    nothing done, when the kernel cannot do all of them (the caller copies and hashes with torch)."""
    if not dst or not dst[0].device.type == "cuda" or not usable(dst[0].device):
        return None
    moved: dict[int, torch.Tensor] = {}
    pairs = [(_side(s, moved), _side(d, moved)) for s, d in zip(src, dst)]
    bounds = [0]
    for (s, d), t in zip(pairs, src):
        if s is None or d is None or s.num_words != d.num_words or t.device != dst[0].device:
            return None
        if s.ids is not None and d.ids is not None and s.page_words != d.page_words:
            return None
        bounds.append(bounds[-1] + -(-s.num_words // CHUNK_WORDS))
    sums = torch.empty(bounds[-1], dtype=torch.int64, device=dst[0].device)
    for i, (s, d) in enumerate(pairs):
        assert s is not None and d is not None
        if s.num_words:
            _launch(
                s.words, s.num_words, dst=d.words, page_ids=s.ids, page_words=s.page_words or d.page_words,
                dst_page_ids=d.ids, out=sums[bounds[i] : bounds[i + 1]],
            )  # fmt: skip
    return SegmentSums(sums, bounds)


def copy_segment(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor | None:
    """copy_segments of one pair: dst's S as a 0-dim int64 device tensor (queued), or None."""
    got = copy_segments([dst], [src])
    return None if got is None else got.sums.sum()


@cache
def usable(device: torch.device) -> bool:
    """Whether the kernel runs on device and every variant (hash only, copy, paged gather with steps
    inside a page or across pages, paged hash only, into pages from pages or flat words) gives the torch
    version's sums and bytes (checked once)."""
    def torch_s(words: torch.Tensor, first: int = 0) -> int:
        return torch_segment_sum(words, first)

    try:
        g = torch.Generator().manual_seed(7)
        n = 2 * CHUNK_WORDS + 12345
        words = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64).to(device)
        ok = all(
            int(_s(words[lo:], n - lo, k)) & MASK64 == torch_s(words[lo:], k)
            for lo, k in ((0, 0), (CHUNK_WORDS, 5))
        )
        out = torch.full_like(words, -1)
        ok = ok and int(_s(words, n, dst=out)) & MASK64 == torch_s(words) and torch.equal(out, words)
        # two segments' sums in one buffer, folded on the host (copy_segments' way)
        a = CHUNK_WORDS + 7  # 2 chunks, then n - a words in 2 more
        both = torch.empty(4, dtype=torch.int64, device=device)
        _launch(words[:a], a, dst=out[:a], out=both[:2])
        _launch(words[a:], n - a, dst=out[a:], out=both[2:])
        got_s = SegmentSums(both, [0, 2, 4]).fold(both.cpu())
        ok = ok and got_s == [torch_s(words[:a]), torch_s(words[a:])] and torch.equal(out, words)
        # pages that do not divide the chunk: steps inside a page (2048 | 6144), and across (1000)
        for page_words in (6144, 1000):
            pool = words[: (n // page_words) * page_words].view(-1, page_words)
            ids = torch.randperm(pool.shape[0], generator=g)[: pool.shape[0] - 3].to(device)
            want = pool[ids].reshape(-1)
            got = torch.full_like(want, -1)
            s = _s(pool.reshape(-1), want.numel(), dst=got, page_ids=ids, page_words=page_words)
            ok = ok and int(s) & MASK64 == torch_s(want) and torch.equal(got, want)
            s = _s(pool.reshape(-1), want.numel(), page_ids=ids, page_words=page_words)  # no copy
            ok = ok and int(s) & MASK64 == torch_s(want)
            # pages into pages of another pool (the ipc receiver in place), from pages and from flat words
            into = torch.full_like(pool, -1)
            to = torch.randperm(pool.shape[0], generator=g)[: ids.numel()].to(device)
            s = _s(pool.reshape(-1), want.numel(), dst=into.reshape(-1), page_ids=ids, page_words=page_words,
                   dst_page_ids=to)  # fmt: skip
            ok = ok and int(s) & MASK64 == torch_s(want) and torch.equal(into[to].reshape(-1), want)
            into.fill_(-1)
            s = _s(want, want.numel(), dst=into.reshape(-1), page_words=page_words, dst_page_ids=to)
            ok = ok and int(s) & MASK64 == torch_s(want) and torch.equal(into[to].reshape(-1), want)
    except Exception as e:  # no Triton, or it cannot build for this device
        log.info("payload checksum on %s: torch path (Triton kernel unavailable: %r)", device, e)
        return False
    if not ok:
        log.warning("payload checksum on %s: the Triton kernel disagrees with torch; using torch", device)
    return ok
