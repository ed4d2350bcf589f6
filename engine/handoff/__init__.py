"""The engine's side of the P/D boundary: the only engine module `transfer/` may import.

The room engine/handoff/ around it (the engine's P/D side, above its other rooms; this module stays light):

    ledger.py     HandoffLedger: the one owner of a sequence's P/D phases and their transitions
    pages.py      HandoffIO: a sequence's pages, SWA state and sampling state, gathered for an export, checked
                  and written for an import
    facade.py     LLMEngine's export_sequence, import_sequence, export_pages, in_place_target, finish_handoff
    kv_shards.py  a --tp group's KV as a handoff carries it (every KV head, re-sharded)

CUDA-free and light (torch for dtypes and tensors, nothing of the model, loader, attention or
kernels): the KV layout, which alone computes page and state shapes and byte sizes; the exported
sequence a handoff carries; and, re-exported so that the transfer layer needs no other door into
the engine, the request types a handoff carries (SamplingParams, TokenLogprob) and the one strict
codec every message uses (engine/codec.py).

    pages: [num_pages, num_full_layers, planes, block_size, num_kv_heads, head_dim]
    state: [num_swa_layers, planes, window, num_kv_heads, head_dim]  ring: position p at p % window

A page kind says what a token keeps per layer (KVLayout.page_kind):

    "kv"      planes = 2 (k, v), num_kv_heads heads of head_dim each
    "latent"  planes = 1, one "head" of head_dim = kv_lora_rank + qk_rope_head_dim: multi-head latent
              attention's compressed KV (after its norm) then its rotary key (engine/layers/mla.py); DeepSeek-V3:
              (512 + 64) x 2 bytes = 1,152 B per token and layer in bf16, where a llama-8B's K and V
              take 2 x 8 x 128 x 2 = 4,096 B
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.codec import WireError, from_wire, to_wire
from engine.errors import InvalidRequestError
from engine.request import PromptLogprobs, SamplingParams, TokenLogprob

__all__ = [
    "DTYPES",
    "InvalidRequestError",
    "KVLayout",
    "PoolPages",
    "PromptLogprobs",
    "SamplingParams",
    "SequenceExport",
    "TokenLogprob",
    "WireError",
    "PAGE_KINDS",
    "dtype_name",
    "from_wire",
    "to_wire",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
PAGE_KINDS = ("kv", "latent")  # KVLayout.page_kind (the module docstring)
_ELEM_BYTES = {dt: torch.empty((), dtype=dt).element_size() for dt in DTYPES.values()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# alloc(shape, dtype, device): the memory an export's tensors are gathered into, or None for new memory
# (the engine gathers an export into it; a transport hands one out for its registered memory)
Alloc = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor | None]


@dataclass(frozen=True)
class KVLayout:
    """How one engine lays out a sequence's KV: the unit both ends of a handoff must agree on."""

    num_full_layers: int
    num_swa_layers: int
    block_size: int
    window: int  # SWA window; 0 without sliding layers
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_kind: str = "kv"  # PAGE_KINDS

    # The fields that must be equal on both sides of a handoff, in the order a mismatch is reported.
    FIELDS = (
        "page_kind", "dtype", "block_size", "num_full_layers", "num_swa_layers", "num_kv_heads", "head_dim", "window",
    )

    def __post_init__(self) -> None:
        if self.page_kind not in PAGE_KINDS:
            raise ValueError(f"page_kind {self.page_kind!r}: one of {PAGE_KINDS}")
        if self.page_kind == "latent" and (self.num_kv_heads != 1 or self.num_swa_layers):
            raise ValueError("a latent layout has one latent per token (num_kv_heads 1) and no sliding layers")

    @property
    def planes(self) -> int:
        """Tensors a token keeps per layer: k and v, or the one latent."""
        return 1 if self.page_kind == "latent" else 2

    @property
    def has_pages(self) -> bool:
        return self.num_full_layers > 0

    @property
    def has_state(self) -> bool:
        return self.num_swa_layers > 0

    @property
    def elem_bytes(self) -> int:
        return _ELEM_BYTES.get(self.dtype) or torch.empty((), dtype=self.dtype).element_size()

    def num_pages(self, num_tokens: int) -> int:
        """Pages that hold num_tokens tokens (0 for a model without full-attention layers)."""
        return math.ceil(num_tokens / self.block_size) if self.has_pages else 0

    def page_shape(self, num_pages: int) -> tuple[int, ...]:
        return (num_pages, self.num_full_layers, self.planes, self.block_size, self.num_kv_heads, self.head_dim)

    def state_shape(self, num_slots: int | None = None) -> tuple[int, ...]:
        """One ring ([num_swa_layers, planes, window, kv_heads, head_dim]), or num_slots of them."""
        one = (self.num_swa_layers, self.planes, self.window, self.num_kv_heads, self.head_dim)
        return one if num_slots is None else (num_slots, *one)

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape(1)) * self.elem_bytes

    @property
    def state_bytes(self) -> int:
        return math.prod(self.state_shape()) * self.elem_bytes if self.has_state else 0

    @property
    def token_bytes(self) -> int:
        """What one token keeps in one full-attention layer's pages (a page holds block_size of them per layer)."""
        return self.planes * self.num_kv_heads * self.head_dim * self.elem_bytes

    def payload_bytes(self, num_tokens: int) -> int:
        """What a handoff of a sequence with num_tokens computed tokens carries."""
        return self.num_pages(num_tokens) * self.page_bytes + self.state_bytes

    def fields(self) -> dict[str, Any]:
        """The layout as plain values (a handoff header's and a receiver's auth_ok's)."""
        return {
            "page_kind": self.page_kind,
            "dtype": dtype_name(self.dtype),
            "block_size": self.block_size,
            "num_full_layers": self.num_full_layers,
            "num_swa_layers": self.num_swa_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "window": self.window if self.has_state else 0,
        }

    @classmethod
    def from_fields(cls, d: Any) -> KVLayout:
        """fields()' inverse; raises ValueError for anything else."""
        if not isinstance(d, dict) or set(d) != set(cls.FIELDS):
            raise ValueError(f"a layout has exactly the fields {cls.FIELDS}")
        ints = [k for k in cls.FIELDS if k not in ("dtype", "page_kind")]
        if any(type(d[k]) is not int or d[k] < 0 for k in ints) or d["dtype"] not in DTYPES:
            raise ValueError(f"unreadable layout {d!r}")
        if d["page_kind"] not in PAGE_KINDS:
            raise ValueError(f"unknown page kind {d['page_kind']!r}")
        return cls(**{k: d[k] for k in ints}, dtype=DTYPES[d["dtype"]], page_kind=d["page_kind"])


class PoolPages:
    """Pages of a KV pool where a handoff lands in place, or that an export offers in place (ipc: the PE's
    pages, read by the CE where they lie): pool[block_ids[i]] is page i. Shaped, typed and sliced as the
    contiguous page tensor it stands for ([len(block_ids), *pool.shape[1:]]), so a receiver treats it as
    one (a transport that writes one-sided writes into its runs; the checksum reads them where they are);
    the import then finds its pages written already (engine/handoff/pages.py).

    A run is a view of consecutive block ids: one contiguous stretch of the pool (block-major layout)."""

    def __init__(self, pool: torch.Tensor, block_ids: list[int] | tuple[int, ...]) -> None:
        if not pool.is_contiguous():
            raise ValueError("a KV pool is contiguous")
        self.pool = pool
        self.block_ids = tuple(block_ids)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.block_ids), *self.pool.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def nbytes(self) -> int:
        return len(self.block_ids) * self.pool[0].numel() * self.pool.element_size()

    def is_contiguous(self) -> bool:
        return True  # each page is, and the page order is block_ids'

    def __len__(self) -> int:
        return len(self.block_ids)

    def __getitem__(self, pages: slice) -> PoolPages:
        if not isinstance(pages, slice) or pages.step not in (None, 1):
            raise TypeError("PoolPages take a slice of pages")
        return PoolPages(self.pool, self.block_ids[pages])

    def runs(self) -> list[torch.Tensor]:
        """Views of the pool, in page order, one per run of consecutive block ids."""
        out: list[torch.Tensor] = []
        start = 0
        for i in range(1, len(self.block_ids) + 1):
            if i == len(self.block_ids) or self.block_ids[i] != self.block_ids[i - 1] + 1:
                first = self.block_ids[start]
                out.append(self.pool[first : first + i - start])
                start = i
        return out

    def gather(self) -> torch.Tensor:
        """A contiguous copy of the pages."""
        return self.pool[torch.tensor(self.block_ids, dtype=torch.long, device=self.pool.device)]


@dataclass
class SequenceExport:
    """A sequence's tokens, sampling state and KV, enough to continue decoding elsewhere.

    pages: layout.page_shape(layout.num_pages(num_computed) - first_page), the sequence's pages from
    first_page on (the receiver holds pages [0, first_page) already); state: layout.state_shape() or None.
    A received export's pages may be PoolPages: they landed in the importer's pool already, in the
    blocks of its reservation (and state then is its reservation's slot). An export made with
    pages_in_place has PoolPages too: the exporter's own pages, which it holds until the handoff ends.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed: int
    params: SamplingParams
    seed: int
    pages: torch.Tensor | PoolPages
    state: torch.Tensor | None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the exporter took from its prefix cache
    # The handoff checksum's sum of the pages' bytes (pdkernels/checksum.py's S), when the export
    # gather computed it on the way (CUDA): a 0-dim int64 device tensor, read by the sender. NOTE:
    # whoever changes pages after the export must set it to None.
    pages_sum: torch.Tensor | None = None
    first_page: int = 0  # pages [0, first_page) are not carried: the receiver's decode cache holds them
    prompt_logprobs: PromptLogprobs | None = None  # params.prompt_logprobs set: the exporter computed them
