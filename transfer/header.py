"""What a handoff carries: a versioned header (msgpack, explicit fields) and a payload of tensors.

Payload layout (payload_bytes = num_pages * page_bytes + state_bytes; two segments, checksummed as
such, see checksum.py):

    | page f | page f+1 | ... | page f+num_pages-1 | SWA state (only if num_swa_layers > 0) |
      f = first_page: the receiver's decode cache holds the sequence's pages [0, f) already (its
          reservation said so), so they are not sent; 0 for a full handoff
      page i: tokens [i*block_size, (i+1)*block_size) of every full-attention layer,
              [num_full_layers, planes, block_size, kv_heads, head_dim], C order, `dtype`; planes:
              2 (k, v) for page_kind "kv", 1 for "latent" (MLA: one latent of head_dim per token)
      state:  [num_swa_layers, planes, window, kv_heads, head_dim] ring: position p at row p % window;
              rows of positions [num_computed - swa_fill, num_computed) are live

num_pages = ceil(num_computed / block_size) - first_page (0 for a model without full-attention layers); the last
page's rows past num_computed are whatever the sender had there. The first sampled token(s) and their
logprobs travel in the header: they are small, typed, and needed before the payload is.

Token ids travel as packed little-endian int32 bytes (a long prompt as a msgpack list costs a
noticeable part of the handoff to pack, unpack and check, on each side). A prompt longer than
IDS_INLINE_MAX tokens is not in the header's bytes: the header says how many ids there are
(num_prompt_tokens) and the sender sends them in an `ids` message right after the offer (wire.py),
so packing them, carrying them and reading them overlap the payload instead of delaying its start.
A decoded header keeps the prompt's ids packed (PackedIds: checked when they arrive, unpacked on
first use).

The checksum may follow the offer (checksum_follows; the header's checksum field is then 0): an ipc
sender offers as soon as its export's gather is queued, and sends the checksum in a `sum` message
once the gather's sums are read (wire.py), so the receiver's copy launch overlaps the gather's end.

A request that asks for prompt logprobs (params.prompt_logprobs) has them in the header too, computed
by the sender's prefill (the receiver reports them with its first output): prompt_logprobs, the
codec's map of PromptLogprobs, null otherwise.

Header version 7 (6 had no page_kind, 5 no prompt_logprobs, 4 no checksum_follows, 3 no first_page).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from engine.handoff import (
    DTYPES,
    PAGE_KINDS,
    KVLayout,
    PoolPages,
    PromptLogprobs,
    SamplingParams,
    SequenceExport,
    TokenLogprob,
    from_wire,
    to_wire,
)
from pdkernels.checksum import MASK64, as_words, fold
from transfer.checksum import pool_pages_sum, segment_sum
from transfer.errors import BAD_HEADER, LAYOUT, VERSION, HandoffError

HEADER_VERSION = 7
IDS_INLINE_MAX = 1024  # prompts longer than this send their token ids after the offer


@dataclass(frozen=True)
class HandoffHeader:
    """Everything about a handoff but its bytes. Built by make_header or decode; consistent by
    construction (__post_init__ checks the derived sizes), so a receiver can size buffers from it."""

    request_id: str
    prompt_token_ids: Sequence[int]  # a tuple, or PackedIds in a decoded header
    output_token_ids: tuple[int, ...]  # the first sampled token (maybe more)
    num_computed: int  # tokens whose KV is in the payload: all but the last
    params: SamplingParams
    seed: int
    model: str  # the model's identity (model_fingerprint); "" to skip that check
    page_kind: str  # engine.handoff.PAGE_KINDS: what a page holds per token and layer
    dtype: str
    block_size: int
    num_full_layers: int
    num_swa_layers: int
    num_kv_heads: int
    head_dim: int
    window: int  # SWA window, 0 without sliding layers
    swa_fill: int  # live rows of the ring: min(num_computed, window)
    num_pages: int
    page_bytes: int  # one page (every full layer)
    state_bytes: int  # the whole SWA ring
    payload_bytes: int
    checksum: int  # transfer.checksum.payload_checksum of [pages, state]; 0 when it follows
    first_page: int = 0  # the payload's pages start at this page of the sequence (see the module's doc)
    output_logprobs: tuple[TokenLogprob, ...] = ()
    checksum_follows: bool = False  # a `sum` message after the offer carries the checksum
    prompt_logprobs: PromptLogprobs | None = None  # exactly when params.prompt_logprobs asks for them
    version: int = HEADER_VERSION

    def __post_init__(self) -> None:
        def bad(msg: str) -> HandoffError:
            return HandoffError(BAD_HEADER, f"request {self.request_id!r}: {msg}")

        if self.version != HEADER_VERSION:
            raise HandoffError(VERSION, f"header version {self.version}, this side reads {HEADER_VERSION}")
        if self.dtype not in DTYPES:
            raise bad(f"unknown dtype {self.dtype!r}")
        if self.page_kind not in PAGE_KINDS:
            raise bad(f"unknown page kind {self.page_kind!r}")
        ints = (
            "num_computed",
            "block_size",
            "num_full_layers",
            "num_swa_layers",
            "num_kv_heads",
            "head_dim",
            "window",
        )
        if any(getattr(self, f) < 0 for f in ints) or self.block_size < 1 or not self.prompt_token_ids:
            raise bad("negative size, zero block size or empty prompt")
        if self.num_computed != len(self.prompt_token_ids) + len(self.output_token_ids) - 1:
            raise bad("num_computed must be every token but the last")
        if (self.num_swa_layers > 0) != (self.window > 0):
            raise bad("window and num_swa_layers must be both zero or both positive")
        try:
            lo = KVLayout(
                self.num_full_layers, self.num_swa_layers, self.block_size, self.window, self.num_kv_heads,
                self.head_dim, DTYPES[self.dtype], self.page_kind,
            )  # fmt: skip
        except ValueError as e:
            raise bad(str(e)) from None
        object.__setattr__(self, "_layout", lo)  # derived once: the shapes below come from it
        if not 0 <= self.first_page <= lo.num_pages(self.num_computed):
            raise bad(f"first_page {self.first_page} is not a page of {self.num_computed} tokens")
        want = {
            "swa_fill": min(self.num_computed, self.window),
            "num_pages": lo.num_pages(self.num_computed) - self.first_page,
            "page_bytes": lo.page_bytes,
            "state_bytes": lo.state_bytes,
            "payload_bytes": lo.payload_bytes(self.num_computed) - self.first_page * lo.page_bytes,
        }
        wrong = [f"{k} {getattr(self, k)} != {v}" for k, v in want.items() if getattr(self, k) != v]
        if wrong:
            raise bad("inconsistent sizes: " + ", ".join(wrong))
        if not 0 <= self.checksum < 1 << 64 or (self.checksum_follows and self.checksum):
            raise bad("checksum out of range (or given although it follows)")
        plp, k = self.prompt_logprobs, self.params.prompt_logprobs
        if (plp is None) != (k is None) or (
            plp is not None and (plp.num_top, plp.num_positions) != (k, len(self.prompt_token_ids) - 1)
        ):
            raise bad("prompt_logprobs do not match params.prompt_logprobs and the prompt's length")

    @property
    def layout(self) -> KVLayout:
        """The sender's KV layout, as this header states it."""
        return self._layout  # type: ignore[no-any-return, attr-defined]

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.layout.dtype

    @property
    def elem_bytes(self) -> int:
        return self.layout.elem_bytes

    @property
    def page_shape(self) -> tuple[int, ...]:
        return self.layout.page_shape(self.num_pages)

    @property
    def state_shape(self) -> tuple[int, ...]:
        return self.layout.state_shape()

    @property
    def has_state(self) -> bool:
        return self.layout.has_state

    # ---- wire ---------------------------------------------------------------------------------

    @property
    def ids_inline(self) -> bool:
        """Whether the prompt's token ids are in the header's bytes (else an `ids` message follows)."""
        return len(self.prompt_token_ids) <= IDS_INLINE_MAX

    def ids_bytes(self) -> bytes:
        """The prompt's token ids, packed (what an `ids` message carries)."""
        ids = self.prompt_token_ids
        if isinstance(ids, PackedIds):
            if ids.raw is None:
                raise HandoffError(BAD_HEADER, "the prompt's token ids have not arrived")
            return ids.raw
        return pack_ids(ids)

    def encode(self) -> bytes:
        d: dict[str, Any] = {name: getattr(self, name) for name in _HEADER_FIELDS}
        d["num_prompt_tokens"] = len(self.prompt_token_ids)
        d["prompt_token_ids"] = self.ids_bytes() if self.ids_inline else None
        d["output_token_ids"] = pack_ids(self.output_token_ids)
        d["params"] = to_wire(self.params)
        d["output_logprobs"] = [
            [lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in self.output_logprobs
        ]
        d["prompt_logprobs"] = None if self.prompt_logprobs is None else to_wire(self.prompt_logprobs)
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> HandoffHeader:
        """Raises HandoffError (VERSION or BAD_HEADER) for anything but a well-formed header."""
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:
            raise HandoffError(BAD_HEADER, f"undecodable header: {e}") from None
        if not isinstance(d, dict):
            raise HandoffError(BAD_HEADER, "the header is not a map")
        if d.get("version") != HEADER_VERSION:
            raise HandoffError(
                VERSION, f"header version {d.get('version')!r}, this side reads {HEADER_VERSION}"
            )
        if d.keys() != _WIRE_FIELDS:
            raise HandoffError(
                BAD_HEADER,
                f"header fields differ: missing {sorted(_WIRE_FIELDS - set(d))}, "
                f"unknown {sorted(set(d) - _WIRE_FIELDS)}",
            )
        try:
            kw = {k: v for k, v in d.items()}
            count = kw.pop("num_prompt_tokens")
            ids = PackedIds.expected(count)
            if d["prompt_token_ids"] is not None:
                ids.fill(d["prompt_token_ids"])
            elif count <= IDS_INLINE_MAX:
                raise ValueError(f"{count} token ids must be in the header")
            kw["prompt_token_ids"] = ids
            kw["output_token_ids"] = _int_tuple(d["output_token_ids"])
            kw["params"] = from_wire(SamplingParams, d["params"], "params")  # a WireError is a ValueError
            kw["output_logprobs"] = tuple(
                TokenLogprob(int(t), float(lp), tuple((int(a), float(b)) for a, b in top))
                for t, lp, top in d["output_logprobs"]
            )
            if d["prompt_logprobs"] is not None:
                kw["prompt_logprobs"] = from_wire(PromptLogprobs, d["prompt_logprobs"], "prompt_logprobs")
            for k in ("request_id", "model", "page_kind", "dtype"):
                if not isinstance(d[k], str):
                    raise TypeError(f"{k} must be a string")
            for name in _INT_FIELDS:
                if type(d[name]) is not int:  # NOTE: not isinstance: a bool is an int there
                    raise TypeError(f"{name} must be an integer")
            if type(d["checksum_follows"]) is not bool:
                raise TypeError("checksum_follows must be a boolean")
            return cls(**kw)
        except HandoffError:
            raise
        except (TypeError, ValueError) as e:
            raise HandoffError(BAD_HEADER, f"malformed header: {e}") from None


_HEADER_FIELDS = tuple(f.name for f in dataclasses.fields(HandoffHeader))
_WIRE_FIELDS = frozenset(_HEADER_FIELDS) | {"num_prompt_tokens"}  # what an encoded header's map holds
_INT_FIELDS = tuple(f.name for f in dataclasses.fields(HandoffHeader) if f.type == "int")


def pack_ids(ids: Any) -> bytes:
    """Token ids as little-endian int32 bytes (struct: one C call for the whole list)."""
    return struct.pack(f"<{len(ids)}i", *ids)


class PackedIds(Sequence[int]):
    """A prompt's token ids as they arrived: packed int32 bytes, checked (whole words, none negative)
    when they arrive, unpacked into a tuple on first use; equal to any sequence of the same ids.
    PackedIds.expected(n): ids announced by a header and not yet arrived (fill() them)."""

    __slots__ = ("raw", "_count", "_ids")

    def __init__(self, raw: Any) -> None:
        self.raw: bytes | None = None
        self._count = 0
        self._ids: tuple[int, ...] | None = None
        self.fill(raw, _check_count=False)

    @classmethod
    def expected(cls, count: Any) -> PackedIds:
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise TypeError("num_prompt_tokens must be an integer >= 0")
        ids = cls.__new__(cls)
        ids.raw, ids._count, ids._ids = None, count, None
        return ids

    @property
    def pending(self) -> bool:
        return self.raw is None

    def fill(self, raw: Any, _check_count: bool = True) -> None:
        """The announced ids arrive; raises TypeError/ValueError unless they are as many as announced,
        whole int32 words, none negative."""
        if not isinstance(raw, bytes) or len(raw) % 4:
            raise TypeError("token ids must be packed int32 bytes")
        if _check_count and len(raw) // 4 != self._count:
            raise ValueError(f"{len(raw) // 4} token ids, the header announced {self._count}")
        if raw and int(np.frombuffer(raw, dtype="<i4").min()) < 0:
            raise ValueError("token ids must be >= 0")
        self.raw, self._count = raw, len(raw) // 4

    def unpacked(self) -> tuple[int, ...]:
        if self._ids is None:
            if self.raw is None:
                raise HandoffError(BAD_HEADER, "the prompt's token ids have not arrived")
            self._ids = tuple(self.tolist())
        return self._ids

    def tolist(self) -> list[int]:
        """The ids as a new list (what an imported sequence keeps), without going through a tuple."""
        if self._ids is not None:
            return list(self._ids)
        if self.raw is None:
            raise HandoffError(BAD_HEADER, "the prompt's token ids have not arrived")
        return _unpack_ids(self.raw)  # checked when they arrived (fill)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: Any) -> Any:
        return self.unpacked()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.unpacked())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedIds) and not (self.pending or other.pending):
            return self.raw == other.raw
        return self.unpacked() == tuple(other) if isinstance(other, Sequence) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.unpacked())

    def __repr__(self) -> str:
        return f"PackedIds({len(self)} ids{', pending' if self.pending else ''})"


def _int_tuple(v: Any) -> tuple[int, ...]:
    # NOTE: checked and converted in C (numpy's min, array.tolist): min() or tuple() over the array
    # would iterate in Python
    if not isinstance(v, bytes) or len(v) % 4:
        raise TypeError("token ids must be packed int32 bytes")
    if v and int(np.frombuffer(v, dtype="<i4").min()) < 0:
        raise ValueError("token ids must be >= 0")
    return tuple(_unpack_ids(v))


def _unpack_ids(raw: bytes) -> list[int]:
    """pack_ids' inverse, unchecked (the callers check)."""
    ids = array("i", raw)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tolist()


def check_layout(header: HandoffHeader, layout: KVLayout, model: str = "") -> None:
    """Raises HandoffError(LAYOUT) unless the header was made for this model and KV layout."""
    mine = layout.fields()
    diffs = [
        f"{k} {getattr(header, k)!r} (theirs) != {mine[k]!r} (ours)"
        for k in KVLayout.FIELDS
        if getattr(header, k) != mine[k]
    ]
    if model and header.model and header.model != model:
        diffs.insert(0, f"model {header.model!r} (theirs) != {model!r} (ours)")
    if diffs:
        raise HandoffError(
            LAYOUT, f"request {header.request_id!r} does not match this engine: " + "; ".join(diffs)
        )


def peer_layout(d: Any) -> KVLayout:
    """A peer's layout from its auth_ok (KVLayout.fields() there); raises HandoffError(LAYOUT)."""
    try:
        return KVLayout.from_fields(d)
    except ValueError as e:
        raise HandoffError(LAYOUT, f"the peer sent an unreadable layout: {e}") from None


# ---- payload --------------------------------------------------------------------------------------


def payload_segments(export: SequenceExport, layout: KVLayout) -> list[Buffer]:
    """The export's tensors in payload order (pages, then the state if the model has sliding layers).
    The pages may be PoolPages (an export made in place, engine.export_sequence(pages_in_place=True)):
    only a transport that reads pages in a pool takes those (Transport.reads_pool_pages)."""
    if not layout.has_state:
        return [export.pages]
    if export.state is None:
        raise HandoffError(LAYOUT, "the export has no SWA state")
    return [export.pages, export.state]


def export_checksum(export: SequenceExport, layout: KVLayout) -> int:
    """payload_checksum of the export's segments, taking the pages' sum from the export when its
    gather (or in-place hash) computed it (pages_sum: then only the small SWA state is hashed here)."""
    sums = []
    for i, t in enumerate(payload_segments(export, layout)):
        pages_sum = export.pages_sum if i == 0 else None
        if pages_sum is not None:
            sums.append((segment_bytes(t), int(pages_sum) & MASK64))
        elif isinstance(t, PoolPages):
            sums.append((t.nbytes, pool_pages_sum(t)))
        else:
            sums.append((segment_bytes(t), segment_sum(as_words(t))))
    return fold(sums)


def segment_bytes(t: Buffer) -> int:
    return t.nbytes if isinstance(t, PoolPages) else t.numel() * t.element_size()


def make_header(
    export: SequenceExport,
    layout: KVLayout,
    model: str = "",
    output_logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...] = (),
    checksum: int | None = None,
    checksum_follows: bool = False,
) -> HandoffHeader:
    """The header of an export (sender side). Computes the checksum where the tensors are unless
    given, or unless it follows (then the header says so and the sender sends it after the offer:
    export_checksum). Raises HandoffError(LAYOUT) if the tensors do not have this layout's shapes."""
    lo = layout.fields()
    num_computed = export.num_computed
    first_page = export.first_page
    num_pages = layout.num_pages(num_computed) - first_page
    page_shape = layout.page_shape(num_pages)
    if tuple(export.pages.shape) != page_shape or export.pages.dtype != layout.dtype:
        raise HandoffError(
            LAYOUT, f"pages {tuple(export.pages.shape)} {export.pages.dtype} != {page_shape} {layout.dtype}"
        )
    if layout.has_state:
        state_shape = layout.state_shape()
        st = export.state
        if st is None or tuple(st.shape) != state_shape or st.dtype != layout.dtype:
            got = None if st is None else (tuple(st.shape), st.dtype)
            raise HandoffError(LAYOUT, f"SWA state {got} != {state_shape} {layout.dtype}")
    if checksum_follows:
        checksum = 0
    elif checksum is None:
        checksum = export_checksum(export, layout)
    return HandoffHeader(
        request_id=export.request_id,
        prompt_token_ids=tuple(export.prompt_token_ids),
        output_token_ids=tuple(export.output_token_ids),
        num_computed=num_computed,
        params=export.params,
        seed=export.seed,
        model=model,
        swa_fill=min(num_computed, lo["window"]),
        num_pages=num_pages,
        page_bytes=layout.page_bytes,
        state_bytes=layout.state_bytes,
        payload_bytes=layout.payload_bytes(num_computed) - first_page * layout.page_bytes,
        checksum=checksum,
        first_page=first_page,
        output_logprobs=tuple(output_logprobs),
        checksum_follows=checksum_follows,
        prompt_logprobs=export.prompt_logprobs,
        **lo,
    )


def stream_plan(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    seed: int,
    layout: KVLayout,
    model: str = "",
    first_page: int = 0,
) -> HandoffHeader:
    """The header of a streamed handoff as far as it is known while its prompt is prefilled (an `open`'s,
    wire.py): every size is the handoff's, the first token is a placeholder (0), there are no logprobs
    and the checksum follows. A receiver sizes its buffers and takes the reservation by it; the final
    offer's header must agree with it (check_final)."""
    lo = layout.fields()
    num_computed = len(prompt_token_ids)
    return HandoffHeader(
        request_id=request_id,
        prompt_token_ids=tuple(prompt_token_ids),
        output_token_ids=(0,),
        num_computed=num_computed,
        params=dataclasses.replace(params, prompt_logprobs=None),
        seed=seed,
        model=model,
        swa_fill=min(num_computed, lo["window"]),
        num_pages=layout.num_pages(num_computed) - first_page,
        page_bytes=layout.page_bytes,
        state_bytes=layout.state_bytes,
        payload_bytes=layout.payload_bytes(num_computed) - first_page * layout.page_bytes,
        checksum=0,
        first_page=first_page,
        checksum_follows=True,
        **lo,
    )


def check_final(plan: HandoffHeader, header: HandoffHeader, num_streamed_pages: int) -> None:
    """Raises HandoffError(BAD_HEADER) unless header (a streamed handoff's final offer) is for plan's
    sequence and carries exactly the pages after the num_streamed_pages that went in parts."""
    diffs = [
        k
        for k in ("request_id", "num_computed", "model", *KVLayout.FIELDS)
        if getattr(header, k) != getattr(plan, k)
    ]
    if len(header.prompt_token_ids) != len(plan.prompt_token_ids):
        diffs.append("prompt length")
    if header.first_page != plan.first_page + num_streamed_pages:
        diffs.append(f"first_page {header.first_page} (after {num_streamed_pages} streamed pages)")
    if diffs:
        raise HandoffError(
            BAD_HEADER, f"request {plan.request_id!r}: the final offer differs from the open in {', '.join(diffs)}"
        )


# A receive buffer: memory of its own, or (the pages segment of a transport that lands in place, nixl)
# the reservation's pages in the CE's KV pool
Buffer = torch.Tensor | PoolPages


def dense(segments: list[Buffer], transport: str) -> list[torch.Tensor]:
    """segments as tensors, for a transport that receives only into memory of their own; raises
    HandoffError(LAYOUT) for pages in a pool (a receiver gives those only to a transport that asks)."""
    out = [t for t in segments if isinstance(t, torch.Tensor)]
    if len(out) != len(segments):
        raise HandoffError(LAYOUT, f"the {transport} transport does not receive into a KV pool in place")
    return out


def allocate_payload(
    header: HandoffHeader, device: torch.device | str = "cpu", pin_memory: bool = False
) -> list[torch.Tensor]:
    """Empty tensors to receive a payload into, in payload order."""
    kw: dict[str, Any] = dict(dtype=header.torch_dtype, device=device, pin_memory=pin_memory)
    out = [torch.empty(header.page_shape, **kw)]
    if header.has_state:
        out.append(torch.empty(header.state_shape, **kw))
    return out


def check_segments(header: HandoffHeader, segments: list[Buffer]) -> None:
    """Raises HandoffError(LAYOUT) unless segments are contiguous tensors (or pages in a pool, for the
    pages) shaped for this header."""
    want = [header.page_shape] + ([header.state_shape] if header.has_state else [])
    got = [tuple(t.shape) for t in segments]
    if got != want or any(t.dtype != header.torch_dtype or not t.is_contiguous() for t in segments):
        raise HandoffError(LAYOUT, f"receive buffers {got} do not fit the payload {want} {header.dtype}")


def to_export(header: HandoffHeader, segments: list[Buffer]) -> SequenceExport:
    """The SequenceExport a verified payload stands for (receiver side)."""
    ids = header.prompt_token_ids
    return SequenceExport(
        request_id=header.request_id,
        prompt_token_ids=ids.tolist() if isinstance(ids, PackedIds) else list(ids),
        output_token_ids=list(header.output_token_ids),
        num_computed=header.num_computed,
        params=header.params,
        seed=header.seed,
        pages=segments[0],
        state=_tensor(segments[1]) if header.has_state else None,
        output_logprobs=list(header.output_logprobs),
        first_page=header.first_page,
        prompt_logprobs=header.prompt_logprobs,
    )


def _tensor(t: Buffer) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise HandoffError(LAYOUT, "a payload's state lands in a tensor")
    return t


def model_fingerprint(folder: str | Path) -> str:
    """A model's identity for the header: its config.json (canonical) and its weight files' names and
    sizes. Cheap (no weight bytes are read); the same folder copied to two hosts gives the same value."""
    folder = Path(folder)
    h = hashlib.sha256()
    config = json.loads((folder / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"\x00{f.name}\x00{f.stat().st_size}".encode())
    return "sha256:" + h.hexdigest()[:32]
