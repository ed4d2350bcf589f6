"""Per-step metadata the model's attention reads: which tokens belong to which sequence, where their
KV lives. Set by `forward_context(...)` for exactly one forward pass and always cleared."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.config import ForwardConfig
from engine.core.kv_cache import KVCache
from engine.layers.decode import DecodeMeta
from engine.layers.numerics import Numerics, run_rows
from pdkernels import pdl


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
    config: ForwardConfig  # which kernels the forward takes (the runner's)
    # Where each new token's K/V goes in the paged pool (full-attention layers): page id and offset.
    page_ids: torch.Tensor
    page_offsets: torch.Tensor
    # CUDA: the step's decode rows, after the chunks' tokens (engine/layers/decode.py); chunks excludes them.
    decode: DecodeMeta | None = None


_CONTEXT: ForwardContext | None = None


def get_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("model forward called outside forward_context()")
    return _CONTEXT


def current_context() -> ForwardContext | None:
    """The forward pass's context, or None outside one (a model function called on its own)."""
    return _CONTEXT


def _kv_slots(chunks: list[SeqChunk], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page id and offset of every new token of the chunks (empty without full-attention layers),
    built a page at a time (list repeats and ranges run in C), not a Python step per token."""
    page_ids = array("q")
    page_offsets = array("q")
    if block_size:
        for c in chunks:
            pos, end = c.start_pos, c.end_pos
            if end - pos == 1:  # a decode row
                page_ids.append(c.block_ids[pos // block_size])
                page_offsets.append(pos % block_size)
                continue
            while pos < end:
                offset = pos % block_size
                k = min(block_size - offset, end - pos)
                page_ids.extend([c.block_ids[pos // block_size]] * k)
                page_offsets.extend(range(offset, offset + k))
                pos += k
    return _long_tensor(page_ids), _long_tensor(page_offsets)


def _long_tensor(values: array[int]) -> torch.Tensor:
    # NOTE: frombuffer shares the array's memory (the tensor keeps it alive); an empty array has no buffer
    return torch.frombuffer(values, dtype=torch.long) if values else torch.empty(0, dtype=torch.long)


@contextmanager
def forward_context(
    chunks: list[SeqChunk],
    kv: KVCache,
    numerics: Numerics,
    decode: DecodeMeta | None = None,
    *,
    config: ForwardConfig,
) -> Iterator[ForwardContext]:
    global _CONTEXT
    page_ids, page_offsets = _kv_slots(chunks, kv.block_size if kv.num_full_layers else 0)
    device = kv.device
    _CONTEXT = ForwardContext(
        chunks=chunks,
        kv=kv,
        numerics=numerics,
        page_ids=page_ids.to(device, non_blocking=True),
        page_offsets=page_offsets.to(device, non_blocking=True),
        decode=decode,
        config=config,
    )
    try:
        with pdl.scope(config.pdl and pdl.supported(device)):
            yield _CONTEXT
    finally:
        _CONTEXT = None


def rowwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """fn(*xs) for a row-local fn, under the step's numerics."""
    return run_rows(fn, xs, get_context().numerics)
