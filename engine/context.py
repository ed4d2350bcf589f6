"""Per-step metadata the model's attention reads: which tokens belong to which sequence, where their
KV lives. Set by `forward_context(...)` for exactly one forward pass and always cleared."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.decode import DecodeMeta
from engine.kv_cache import KVCache
from engine.numerics import Numerics


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's slice of a step.

    Tokens [token_start, token_start + num_tokens) of the flattened batch sit at positions
    [start_pos, start_pos + num_tokens); positions [0, start_pos) are already in the cache.
    """

    token_start: int
    num_tokens: int
    start_pos: int
    block_ids: list[int]
    state_slot: int  # -1 when the model has no sliding layers

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass
class ForwardContext:
    chunks: list[SeqChunk]
    kv: KVCache
    numerics: Numerics
    # Where each new token's K/V goes in the paged pool (full-attention layers): page id and offset.
    page_ids: torch.Tensor
    page_offsets: torch.Tensor
    # CUDA: the step's decode rows, after the chunks' tokens (engine/decode.py); chunks excludes them.
    decode: DecodeMeta | None = None


_CONTEXT: ForwardContext | None = None


def get_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("model forward called outside forward_context()")
    return _CONTEXT


@contextmanager
def forward_context(
    chunks: list[SeqChunk], kv: KVCache, numerics: Numerics, decode: DecodeMeta | None = None
) -> Iterator[ForwardContext]:
    global _CONTEXT
    page_ids: list[int] = []
    page_offsets: list[int] = []
    bs = kv.block_size
    if kv.num_full_layers:
        for c in chunks:
            for pos in range(c.start_pos, c.end_pos):
                page_ids.append(c.block_ids[pos // bs])
                page_offsets.append(pos % bs)
    device = kv.device
    _CONTEXT = ForwardContext(
        chunks=chunks,
        kv=kv,
        numerics=numerics,
        page_ids=torch.tensor(page_ids, dtype=torch.long, device=device),
        page_offsets=torch.tensor(page_offsets, dtype=torch.long, device=device),
        decode=decode,
    )
    try:
        yield _CONTEXT
    finally:
        _CONTEXT = None
