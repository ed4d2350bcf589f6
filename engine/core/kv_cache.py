"""The engine's KV memory: a paged pool for full-attention layers and a pool of SWA state slots.

Layout (block-major, so one page of every full layer is one contiguous run of bytes: the unit the
prefix cache and the P/D handoff copy):

    pages: [num_blocks, num_full_layers, 2 (k, v), block_size, num_kv_heads, head_dim]
    swa:   [num_slots,  num_swa_layers,  2 (k, v), window,     num_kv_heads, head_dim]

A multi-head latent attention model (DeepSeek-V3) keeps one latent per token and layer instead of K and V
(KVLayout.page_kind "latent", engine/layers/mla.py): pages [num_blocks, num_full_layers, 1, block_size, 1,
kv_lora_rank + qk_rope_head_dim], in the same pool, block tables and copies as any other page.

A model built with multi-token-prediction layers (ModelArch.num_mtp_layers, engine/models/mtp.py) keeps each
one's KV as one more full layer after the model's own (ModelArch.mtp_cache_index): num_full_layers counts
them, so every page carries them. Without MTP layers the layout is the model's alone.

A draft model (speculative method draft_model, engine/speculative/draft_model.py) keeps its KV in the same
pages too, in layers of its own shape: layout_of(..., draft=its layout) adds draft_slots() full layers of the
target's shape after all the others, and KVCache.draft_cache() views them, page by page, as the draft's pool:

    page b:  | target's full layers (+ MTP) | draft slots: draft layer 0 | draft layer 1 | ... (| unused) |
                                              [2, block_size, draft kv_heads, draft head_dim] each

so a block id means the same tokens to both models, and whatever copies pages (prefix cache, decode cache,
the P/D handoff) copies the draft's KV with them.

A sliding layer's state is a ring buffer: position p lives at index p % window, and after n tokens
it holds positions [max(0, n - window), n).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from engine.arch import ModelArch
from engine.handoff import KVLayout, PoolPages


def layout_of(arch: ModelArch, block_size: int, dtype: torch.dtype, draft: KVLayout | None = None) -> KVLayout:
    """The pool's layout for arch; draft: a draft model's layout (same block_size and dtype), whose pages
    ride in draft_slots() more full layers."""
    own = _layout_of(arch, block_size, dtype)
    if draft is None:
        return own
    return dataclasses.replace(own, num_full_layers=own.num_full_layers + draft_slots(own, draft))


def draft_slots(layout: KVLayout, draft: KVLayout) -> int:
    """Full layers of layout's shape that hold one page of draft's (its page rounded up to whole layers)."""
    if draft.block_size != layout.block_size or draft.dtype != layout.dtype or draft.has_state:
        raise ValueError("a draft's pages share the pool's block_size and dtype, and it has no sliding layers")
    if not layout.has_pages:
        raise ValueError("a draft's pages ride in the pool's pages: the model needs full-attention layers")
    return -(-draft.page_bytes // (layout.block_size * layout.token_bytes))


def _layout_of(arch: ModelArch, block_size: int, dtype: torch.dtype) -> KVLayout:
    num_full_layers = len(arch.full_layers) + arch.num_mtp_layers
    if arch.mla is not None:
        return KVLayout(
            num_full_layers=num_full_layers,
            num_swa_layers=0,
            block_size=block_size,
            window=0,
            num_kv_heads=1,
            head_dim=arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim,
            dtype=dtype,
            page_kind="latent",
        )
    return KVLayout(
        num_full_layers=num_full_layers,
        num_swa_layers=len(arch.sliding_layers),
        block_size=block_size,
        window=arch.sliding_window or 0,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        dtype=dtype,
    )


class KVCache:
    """The tensors; bookkeeping of which block/slot belongs to whom lives in the block pools."""

    def __init__(
        self, layout: KVLayout, num_blocks: int, num_slots: int, device: torch.device, pin_memory: bool = False
    ) -> None:
        """pin_memory: page-locked host memory (the prefix cache's host pool on a CUDA machine)."""
        self.layout = layout
        self.device = device
        lo = layout
        page_shape, state_shape = lo.page_shape(num_blocks), lo.state_shape(num_slots)
        # NOTE: uninitialized on purpose (no memset, and on the CPU no resident pages until used):
        # attention only ever reads positions a sequence has written.
        self.pages = torch.empty(page_shape, dtype=lo.dtype, device=device, pin_memory=pin_memory)
        self.swa = torch.empty(state_shape, dtype=lo.dtype, device=device, pin_memory=pin_memory)

    def draft_cache(self, draft: KVLayout) -> KVCache:
        """The draft model's pool inside this one's pages (the module docstring): the last draft_slots
        full layers of every page viewed as one page of draft's, under the same block ids; no SWA state.
        Writes through the view land in self.pages."""
        own_layers = self.layout.num_full_layers - draft_slots(self.layout, draft)
        shape = draft.page_shape(self.num_blocks)
        inner = [math.prod(shape[i + 1 :]) for i in range(1, len(shape))]  # one page's, contiguous
        p = self.pages
        if own_layers < 0 or own_layers * p.stride(1) + draft.page_bytes // draft.elem_bytes > p.stride(0):
            raise ValueError("this pool holds no draft of that layout")
        view = p.as_strided(shape, (p.stride(0), *inner), p.storage_offset() + own_layers * p.stride(1))
        return KVCache.over(draft, view, torch.empty(draft.state_shape(0), dtype=draft.dtype, device=self.device))

    @classmethod
    def over(cls, layout: KVLayout, pages: torch.Tensor, swa: torch.Tensor) -> KVCache:
        """A KVCache of the given tensors (a view into another pool: nothing allocated)."""
        cache = cls.__new__(cls)
        cache.layout, cache.device, cache.pages, cache.swa = layout, pages.device, pages, swa
        return cache

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_full_layers(self) -> int:
        return self.layout.num_full_layers

    @property
    def num_blocks(self) -> int:
        return self.pages.shape[0]

    @property
    def num_slots(self) -> int:
        return self.swa.shape[0]

    def read_pages(
        self, block_ids: list[int], out: torch.Tensor | None = None, with_checksum: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copies of the given pages, [n, *layout.page_shape(1)[1:]], into out
        if given (else new memory), and, if with_checksum and the one-pass kernel runs here (CUDA),
        the handoff checksum's sum of their bytes (pdkernels/checksum.py's S of the pages segment, a
        0-dim int64 device tensor, queued: no sync) computed in the same pass; else None."""
        if with_checksum and self.device.type == "cuda" and block_ids:
            from pdkernels.checksum_gpu import gather_pages

            if out is None:
                out = torch.empty((len(block_ids), *self.pages.shape[1:]), dtype=self.pages.dtype, device=self.device)
            pages_sum = gather_pages(self.pages, block_ids, out)
            if pages_sum is not None:
                return out, pages_sum
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if out is None:  # indexing with a tensor gathers into new memory: no clone needed
            return self.pages[ids], None
        return torch.index_select(self.pages, 0, ids, out=out), None

    def pages_in_place(
        self, block_ids: list[int], with_checksum: bool = False
    ) -> tuple[PoolPages, torch.Tensor | None]:
        """The given pages where they lie in the pool (no copy: an export a transport reads in place), and,
        if with_checksum and the one-pass kernel runs here (CUDA), their checksum sum as read_pages gives
        it (queued: no sync); else None."""
        pages = PoolPages(self.pages, block_ids)
        if with_checksum and self.device.type == "cuda" and block_ids:
            from pdkernels.checksum_gpu import queued_pages_sum

            return pages, queued_pages_sum(self.pages, block_ids)
        return pages, None

    def write_pages(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.pages[torch.tensor(block_ids, dtype=torch.long, device=self.device)] = data.to(self.device, self.layout.dtype)

    def read_state(self, slot: int) -> torch.Tensor:
        return self.swa[slot].clone()

    def write_state(self, slot: int, data: torch.Tensor) -> None:
        self.swa[slot].copy_(data)
