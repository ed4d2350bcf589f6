"""The handoff's payload checksum where the bytes are: the definition (pdkernels/checksum.py) in numpy on
the CPU, in one Triton pass on a GPU where it has matched torch there (pdkernels/checksum_gpu.py), in
torch elsewhere. All compute the same value; tests check they agree bit for bit."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.handoff import PoolPages
from pdkernels import checksum as definition
from pdkernels import checksum_gpu
from pdkernels.checksum import MASK64, as_words, fold


def segment_sum(words: torch.Tensor, first_chunk: int = 0) -> int:
    """S restricted to a run of words that starts at chunk first_chunk of its segment (mod 2^64).

    The run must be whole chunks, except that the last chunk of a segment may be partial. On the
    CPU this runs in numpy, single-threaded, one cache-sized chunk at a time (about twice torch's
    speed there: lower per-op overhead, no thread-pool handoff); on CUDA in one pass through a Triton
    kernel (pdkernels/checksum_gpu.py) where it has matched torch on that device; elsewhere in torch, 64
    chunks per launch. All compute the same definition; tests check they agree bit for bit.
    """
    if words.numel() == 0:
        return 0
    if words.device.type == "cpu":
        return definition.numpy_segment_sum(words, first_chunk)
    if words.device.type == "cuda":
        if checksum_gpu.usable(words.device):
            return checksum_gpu.segment_sum(words, first_chunk)
    return definition.torch_segment_sum(words, first_chunk)


# PoolPages: runs shorter than the staging buffer are hashed through it, this many chunks (on a GPU each
# hash is a launch and a sync: fewer, larger ones)
STAGE_CHUNKS = {"cpu": 8, "cuda": 64}


def payload_checksum(segments: Sequence[torch.Tensor | PoolPages]) -> int:
    """The checksum of a payload (any device; a CUDA tensor is hashed on its GPU, one sync at the end).
    A PoolPages segment (pages received in place) is hashed where its pages lie in the pool."""
    return fold([
        (t.nbytes, pool_pages_sum(t)) if isinstance(t, PoolPages) else (t.numel() * t.element_size(), segment_sum(as_words(t)))
        for t in segments
    ])  # fmt: skip


def pool_pages_sum(pages: PoolPages) -> int:
    """segment_sum of the contiguous tensor pages stand for, read from the pool: on a GPU in one pass of
    the kernel over the pages where they lie (checksum_gpu.pages_sum); elsewhere from the pool's runs, a
    run at least a staging buffer long straight from the pool (its whole chunks), the rest copied
    through a staging buffer of STAGE_CHUNKS chunks (a page is usually smaller), so each piece hashed
    starts at a chunk boundary as SegmentHasher asks."""
    if pages.device.type == "cuda" and pages.block_ids:
        got = checksum_gpu.pages_sum(pages.pool, pages.block_ids)
        if got is not None:
            return got
    hasher = SegmentHasher(pages.nbytes)
    chunk = definition.CHUNK_BYTES
    stage_bytes = STAGE_CHUNKS.get(pages.device.type, 8) * chunk
    stage: torch.Tensor | None = None
    fill = 0
    for run in pages.runs():
        b = run.reshape(-1).view(torch.uint8)
        pos = 0
        while pos < b.numel():
            if fill == 0 and b.numel() - pos >= stage_bytes:  # aligned and long: hash it in place
                whole = (b.numel() - pos) // chunk * chunk
                hasher.update(b[pos : pos + whole])
                pos += whole
                continue
            if stage is None:
                stage = torch.empty(stage_bytes, dtype=torch.uint8, device=b.device)
            k = min(stage.numel() - fill, b.numel() - pos)
            stage[fill : fill + k].copy_(b[pos : pos + k])
            fill, pos = fill + k, pos + k
            if fill == stage.numel():
                hasher.update(stage)
                fill = 0
    if fill:
        assert stage is not None
        hasher.update(stage[:fill])
    return hasher.result()[1]


class SegmentHasher:
    """Hashes a segment in pieces as it arrives. Pieces come in order, each whole chunks except the last."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.num_hashed_bytes = 0
        self.sum = 0

    def update(self, piece: torch.Tensor) -> None:
        """piece: the next bytes (uint8) of the segment, starting at a chunk boundary."""
        if self.num_hashed_bytes % definition.CHUNK_BYTES:
            raise ValueError("pieces must start at a chunk boundary")
        n = piece.numel()
        if n % definition.CHUNK_BYTES and self.num_hashed_bytes + n != self.nbytes:
            raise ValueError("only the last piece of a segment may end inside a chunk")
        self.sum = (self.sum + segment_sum(as_words(piece), self.num_hashed_bytes // definition.CHUNK_BYTES)) & MASK64
        self.num_hashed_bytes += n

    def result(self) -> tuple[int, int]:
        if self.num_hashed_bytes != self.nbytes:
            raise ValueError(f"hashed {self.num_hashed_bytes} of {self.nbytes} bytes")
        return self.nbytes, self.sum
