"""The payload checksum: a 64-bit word hash computed with torch wherever the bytes are (CPU or GPU).

Why not zlib.crc32 or hashlib: with NCCL and CUDA IPC the payload never reaches host memory, so the
check has to run on the device that holds it, and both ends must get the same number whichever device
they use. Integer arithmetic mod 2^64 is exact, so the value does not depend on the device, the thread
count or the order of a reduction. It is not a MAC (the connection is authenticated; this catches
truncation, misplaced chunks, stale buffers and bit errors).

Definition. A payload is a list of segments (the pages, then the SWA state). Each segment's bytes,
zero-padded to a multiple of 8, are little-endian int64 words w_i, i = c * CHUNK_WORDS + j:

    x_i = y ^ (y >> 31),   y = (w_i ^ M_j) * MUL        (wrapping; >> is arithmetic)
    S   = sum_c K_c * sum_j x_{c,j}                     (mod 2^64)
    checksum = fold(splitmix64, SEED, (nbytes, S) of every segment)

M_j and K_c are odd splitmix64 values of the position in the chunk and of the chunk index: a word
moved to another position or chunk changes the sum. The xorshift after the multiply carries high-bit
changes down into the low bits, so two flips of the same high bit in different words do not cancel
(they would in a purely linear sum). S is linear over chunks, so a receiver can hash whole chunks as
they arrive (SegmentHasher) and get the same value as one pass over the finished buffer.

Cost per word: 4 elementwise ops + a sum over a chunk that stays in cache, so one pass runs near
memory bandwidth on a GPU (pdkernels/checksum_gpu.py; torch's separate elementwise passes move about ten times
the bytes) and at about zlib.crc32's speed on one CPU core (bench/micro/handoff.py measures both).

This module is the definition and its torch and numpy forms; pdkernels/checksum_gpu.py is the one-pass
Triton form, and transfer/checksum.py picks among them for the data at hand.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

CHUNK_WORDS = 1 << 17  # 1 MiB: a chunk and its temporaries stay in the CPU's cache
CHUNK_BYTES = CHUNK_WORDS * 8
GPU_GROUP_CHUNKS = 64  # on a GPU, hash 64 MiB per kernel launch
MASK64 = (1 << 64) - 1
SEED = 0x5EED_0F_0DD5_BEEF
MUL = 0x2545F4914F6CDD1D
SEED_M = 0x9E3779B97F4A7C15
SEED_K = 0xD1B54A32D192ED03


def splitmix64(x: int) -> int:
    """The splitmix64 finalizer on a Python int (mod 2^64)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def signed64(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of each int64 element, bit-identical to splitmix64() (logical shifts emulated)."""

    def lshr(z: torch.Tensor, n: int) -> torch.Tensor:
        return (z >> n) & ((1 << (64 - n)) - 1)

    z = x + signed64(0x9E3779B97F4A7C15)
    z = (z ^ lshr(z, 30)) * signed64(0xBF58476D1CE4E5B9)
    z = (z ^ lshr(z, 27)) * signed64(0x94D049BB133111EB)
    return z ^ lshr(z, 31)


@cache
def position_keys(device: torch.device) -> torch.Tensor:
    """M_j, j in [0, CHUNK_WORDS): odd, built on the CPU and copied once per device."""
    j = torch.arange(CHUNK_WORDS, dtype=torch.int64)
    return (splitmix64_tensor(j ^ signed64(SEED_M)) | 1).to(device)


def make_chunk_keys(first: int, count: int, device: torch.device) -> torch.Tensor:
    c = torch.arange(first, first + count, dtype=torch.int64)
    return (splitmix64_tensor(c + signed64(SEED_K)) | 1).to(device)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as int64 words (zero-padded to a multiple of 8), a view when possible."""
    b = t.contiguous().reshape(-1).view(torch.uint8)
    pad = -b.numel() % 8
    if pad or b.storage_offset() % 8:
        b = torch.cat([b, b.new_zeros(pad)])
    return b.view(torch.int64)


def numpy_segment_sum(words: torch.Tensor, first_chunk: int) -> int:
    w = words.numpy()
    n = w.size
    m = position_keys(torch.device("cpu")).numpy()
    k = make_chunk_keys(first_chunk, -(-n // CHUNK_WORDS), torch.device("cpu")).tolist()
    y = np.empty(min(n, CHUNK_WORDS), dtype=np.int64)
    s = np.empty_like(y)
    acc = 0
    for c, lo in enumerate(range(0, n, CHUNK_WORDS)):
        r = min(CHUNK_WORDS, n - lo)
        yc, sc = y[:r], s[:r]
        np.bitwise_xor(w[lo : lo + r], m[:r], out=yc)
        np.multiply(yc, signed64(MUL), out=yc)
        np.right_shift(yc, 31, out=sc)
        np.bitwise_xor(yc, sc, out=yc)
        acc += (int(yc.sum()) & MASK64) * k[c]
    return acc & MASK64


def torch_segment_sum(words: torch.Tensor, first_chunk: int) -> int:
    n = words.numel()
    device = words.device
    m = position_keys(device)
    num_chunks = -(-n // CHUNK_WORDS)
    k = make_chunk_keys(first_chunk, num_chunks, device)
    group = GPU_GROUP_CHUNKS if device.type == "cuda" else 1
    acc = torch.zeros((), dtype=torch.int64, device=device)
    y = torch.empty(min(group * CHUNK_WORDS, n), dtype=torch.int64, device=device)
    s = torch.empty_like(y)
    for c0 in range(0, num_chunks, group):
        lo, hi = c0 * CHUNK_WORDS, min(n, (c0 + group) * CHUNK_WORDS)
        full = (hi - lo) // CHUNK_WORDS
        if full:  # whole chunks as a [full, CHUNK_WORDS] matrix
            x = _mix(words[lo : lo + full * CHUNK_WORDS].view(full, CHUNK_WORDS), m, y, s)
            acc += (x.sum(1) * k[c0 : c0 + full]).sum()
        r = hi - lo - full * CHUNK_WORDS
        if r:  # the segment's partial last chunk
            acc += _mix(words[hi - r : hi].view(1, r), m[:r], y, s).sum() * k[c0 + full]
    return int(acc) & MASK64


def _mix(w: torch.Tensor, m: torch.Tensor, y_buf: torch.Tensor, s_buf: torch.Tensor) -> torch.Tensor:
    y = y_buf[: w.numel()].view(w.shape)
    torch.bitwise_xor(w, m, out=y)
    y.mul_(signed64(MUL))
    s = s_buf[: w.numel()].view(w.shape)
    torch.bitwise_right_shift(y, 31, out=s)
    return y.bitwise_xor_(s)


def fold(segments: list[tuple[int, int]]) -> int:
    """The checksum of a payload from each segment's (nbytes, S)."""
    h = SEED
    for nbytes, s in segments:
        h = splitmix64(h ^ nbytes)
        h = splitmix64(h ^ s)
    return h
