"""Decode rows on CUDA: their per-step metadata in static device buffers, and their attention.

A decode row is one generated token of one sequence (a prompt's tokens, even a one-token chunk of
them, always take the chunked path in engine/layers/attention.py, so a prompt's K/V never depend on how it
was chunked). The step puts its decode rows last in the flattened batch and describes them with
`DecodeMeta`: int32 tensors that live in one static buffer (`DecodeInputs`), filled on the host in
pinned memory and copied to the device in one copy. CUDA graphs (engine/execution/cuda_graphs.py) capture
views of that buffer, so a replay only needs the buffer refilled.

    device buffer (int32), R = max rows, V = rows a sequence may verify (1 + drafts; none without
    speculation), W = max blocks per sequence:
    | input ids [R] | positions [R] | context lens [R] | state slots [R] | draft context lens [V, R] | block table [R, W] |
      a padded row: id 0, position 0, context len 0 (the kernels skip it), slot -1

The attention reads K/V in place through pdkernels/decode_attention.py (full layers: pages through the
block table; sliding layers: the sequence's ring slot), storing the row's new K/V there as it goes.

Speculative decoding's verify (engine/speculative/) runs as decode rows too: a sequence with m drafts
is 1 + m consecutive rows, its last token and drafts at positions p .. p + m, each row attending up to its
own position (`DecodeMeta.is_verify`). On a full layer every row's K/V is stored before any row
attends, since a row reads the keys of the rows before it. A ring cannot take that (a later row's key
overwrites an entry an earlier row still sees), so a sliding layer attends in V launches of the decode
kernel, launch j taking each sequence's row j alone (`DecodeMeta.draft_context_lens[j]`: the others' 0,
skipped): row j stores its key over the ring's oldest entry and reads the ring as a plain decode step at
its position would, so its result is that step's, bit for bit, and a rejected draft's overwrite is
undone by the speculator (engine/speculative/speculator.py restores the ring entries it saved).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.core.kv_cache import KVCache
from engine.core.sequence import Sequence

if TYPE_CHECKING:  # the kernel module imports triton
    from pdkernels.decode_attention import Rope


@dataclass(frozen=True)
class DecodeMeta:
    """The decode rows of a step (the last num_rows tokens of the flattened batch), on the device."""

    num_rows: int
    input_ids: torch.Tensor  # [num_rows] int32
    positions: torch.Tensor  # [num_rows] int32
    context_lens: torch.Tensor  # [num_rows] int32: position + 1; 0 marks a padded row
    state_slots: torch.Tensor  # [num_rows, 1] int32: each row's ring slot (-1: none)
    block_table: torch.Tensor  # [num_rows, max_blocks] int32
    is_verify: bool = False  # a sequence may have several rows (its drafts): every K/V stored before attending
    # [V, num_rows] int32: context_lens where the row is its sequence's row j (its last token's: j = 0), else 0
    draft_context_lens: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeRows:
    """Decode rows' values on the host: each row's input token, position, state slot and the block
    table entries up to its position's page."""

    input_ids: list[int]
    positions: list[int]
    state_slots: list[int]
    block_tables: list[list[int]]
    is_verify: bool = False  # some sequence has drafts: its rows follow one another (DecodeMeta.is_verify)
    row_in_seq: list[int] = dataclasses.field(default_factory=list)  # j of each row: its sequence's row j


def decode_rows(seqs: list[Sequence], block_size: int) -> DecodeRows:
    """One row per sequence, and one more per draft of a sequence that has drafts."""
    rows = DecodeRows([], [], [], [], is_verify=any(s.draft_token_ids for s in seqs))
    for seq in seqs:
        p = seq.num_computed
        # a decode row's token is generated
        for j, token in enumerate([seq.output_token_ids[p - seq.num_prompt_tokens], *seq.draft_token_ids]):
            rows.input_ids.append(token)
            rows.positions.append(p + j)
            rows.state_slots.append(seq.state_slot)
            rows.block_tables.append(seq.block_ids[: (p + j) // block_size + 1] if seq.block_ids else [])
            rows.row_in_seq.append(j)
    return rows


def is_decode_row(seq: Sequence, num_new_tokens: int) -> bool:
    """One generated token (its position is past the prompt), and its drafts if it has any."""
    return num_new_tokens == 1 + len(seq.draft_token_ids) and seq.num_computed >= seq.num_prompt_tokens


class DecodeInputs:
    """Static buffers for up to max_rows decode rows (see the module docstring)."""

    def __init__(
        self, max_rows: int, max_blocks: int, block_size: int, device: torch.device, verify_width: int = 1
    ) -> None:
        """verify_width: rows one sequence may verify (1 + drafts per step; 1 without speculation)."""
        self.max_rows, self.max_blocks, self.block_size = max_rows, max(1, max_blocks), block_size
        self.verify_width = verify_width if verify_width > 1 else 0
        self._head = (4 + self.verify_width) * max_rows
        size = self._head + max_rows * self.max_blocks
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self.device_buf = torch.zeros(size, dtype=torch.int32, device=device)
        self._np = self.host.numpy()
        self._copied = torch.cuda.Event()

    def _field(self, buf: torch.Tensor | np.ndarray, i: int, rows: int):  # type: ignore[no-untyped-def]
        return buf[i * self.max_rows : i * self.max_rows + rows]

    def _table(self, buf: torch.Tensor | np.ndarray, rows: int):  # type: ignore[no-untyped-def]
        return buf[self._head : self._head + rows * self.max_blocks].reshape(rows, self.max_blocks)

    def meta(self, rows: int, is_verify: bool = False) -> DecodeMeta:
        """Views of the device buffer for the first `rows` rows (what a graph of that size captures)."""
        d = self.device_buf
        return DecodeMeta(
            num_rows=rows,
            input_ids=self._field(d, 0, rows),
            positions=self._field(d, 1, rows),
            context_lens=self._field(d, 2, rows),
            state_slots=self._field(d, 3, rows).view(rows, 1),
            block_table=self._table(d, rows),
            is_verify=is_verify,
            draft_context_lens=self._draft_lens(d, rows) if is_verify and self.verify_width else None,
        )

    def _draft_lens(self, buf: torch.Tensor | np.ndarray, rows: int):  # type: ignore[no-untyped-def]
        w, r = self.verify_width, self.max_rows
        return buf[4 * r : (4 + w) * r].reshape(w, r)[:, :rows]

    def fill(self, seqs: list[Sequence], padded_rows: int, is_verify: bool = False) -> DecodeMeta:
        """Writes the rows of `seqs` (then padding up to padded_rows) and copies them to the device.
        is_verify: a verify's rows (a graph captured for verifying: with no sequence given, padding alone)."""
        rows = decode_rows(seqs, self.block_size)
        return self.fill_rows(dataclasses.replace(rows, is_verify=rows.is_verify or is_verify), padded_rows)

    def fill_rows(self, rows: DecodeRows, padded_rows: int) -> DecodeMeta:
        """fill() from the rows' values (a tensor-parallel follower has them from rank 0's plan)."""
        n = len(rows.input_ids)
        if not n <= padded_rows <= self.max_rows:
            raise ValueError(f"{n} decode rows padded to {padded_rows}; the buffers hold {self.max_rows}")
        self._copied.synchronize()  # NOTE: the previous step's copy must be done before the host rewrites
        h = self._np
        ids, pos, ctx, slots = (self._field(h, i, padded_rows) for i in range(4))
        table = self._table(h, padded_rows)
        for i, (t, p, slot, blocks) in enumerate(zip(rows.input_ids, rows.positions, rows.state_slots, rows.block_tables)):
            ids[i] = t
            pos[i] = p
            ctx[i] = p + 1
            slots[i] = slot
            table[i, : len(blocks)] = blocks
        ids[n:] = 0
        pos[n:] = 0
        ctx[n:] = 0
        slots[n:] = -1
        if rows.is_verify and self.verify_width:
            lens = self._draft_lens(h, padded_rows)
            lens[:] = 0
            for i, j in enumerate(rows.row_in_seq):
                if j >= self.verify_width:
                    raise ValueError(f"a sequence's row {j}: the buffers verify {self.verify_width} rows each")
                lens[j, i] = ctx[i]
        end = self._head + padded_rows * self.max_blocks  # the fields whole, then the table's rows
        self.device_buf[:end].copy_(self.host[:end], non_blocking=True)
        self._copied.record()
        return self.meta(padded_rows, rows.is_verify)


# Default mode: from this many rows (the step's padded batch) the attention takes the kernel's wide
# splits. Deterministic mode never does: a row's splits must not depend on its batch.
WIDE_SPLIT_ROWS = 32


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_sliding: bool, cache_index: int,
                     window: int | None, scale: float, kv: KVCache, meta: DecodeMeta,
                     batch_invariant: bool = True, sinks: torch.Tensor | None = None,
                     rope: Rope | None = None) -> torch.Tensor:
    """Stores the rows' new K/V and attends over each row's cached keys, in one kernel pass. q: [rows, heads, dim];
    sinks: [heads] attention sink logits, or None; rope: q and k still raw, normed and rotated in the kernel
    (pdkernels/decode_attention.py Rope), or None."""
    from pdkernels.decode_attention import WIDE_SPLIT_TOKENS, paged_decode_attention, store_decode_kv

    wide = not batch_invariant and meta.num_rows >= WIDE_SPLIT_ROWS
    min_split = WIDE_SPLIT_TOKENS if wide else None
    if is_sliding:
        assert window is not None
        if meta.is_verify:  # one launch per row of a sequence (the module docstring); the others' rows give 0
            assert rope is None and meta.draft_context_lens is not None
            out = torch.zeros_like(q)
            for lens in meta.draft_context_lens:
                out += paged_decode_attention(q, kv.swa, cache_index, meta.state_slots, lens, scale, window=window,
                                              k_new=k, v_new=v, min_split=min_split, sinks=sinks)
            return out
        cache, table, ring = kv.swa, meta.state_slots, window
    else:
        cache, table, ring = kv.pages, meta.block_table, 0
    if meta.is_verify:  # a row reads the keys of its sequence's rows before it: all stored first
        assert rope is None
        store_decode_kv(k, v, cache, cache_index, table, meta.context_lens, is_ring=False)
    return paged_decode_attention(q, cache, cache_index, table, meta.context_lens, scale, window=ring, k_new=k, v_new=v,
                                  min_split=min_split, sinks=sinks, rope=rope)
