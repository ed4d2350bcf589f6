"""A tensor-parallel group's KV as the P/D handoff carries it: every KV head of the model, whatever the
group's size (engine/parallel/tensor_parallel.py splits them: rank r holds heads [first, first + count) of
`kv_heads_of`, replicated when the group has more ranks than the model KV heads).

The handoff's wire layout is the model's (--tp 1's), so a PE group of any size hands off to a CE group of
any size and the transfer layer (header, checksum, ledger, leases, aborts, the delta handoff) is the same
as between two --tp 1 engines. Rank 0 of each group, the one that schedules and talks to the transport,
does the re-sharding:

    export (PE)  rank 0 broadcasts PLAN_EXPORT {blocks, slot}; every rank reads those pages and that SWA
                 state slot of its own heads; rank 0 gathers them and merges them in head order
                 (a replicated head from the first rank that holds it)
    import (CE)  rank 0 broadcasts PLAN_IMPORT {blocks, slot}, then scatters to each rank the heads it
                 holds, cut from the full pages and state; every rank writes them into those pages and
                 that slot (rank 0's ledger chose them: block ids are the same on every rank)

    pages  [n, num_full_layers, planes, block_size, num_kv_heads, head_dim]   heads: dim -2
    state  [num_swa_layers, planes, window, num_kv_heads, head_dim]           heads: dim -2

NOTE: the plans travel and the collectives run on rank 0's engine thread between steps, like a step's
plan, so every rank meets them in the same order as the forwards."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.core.kv_cache import KVCache
from engine.handoff import KVLayout
from engine.parallel.tensor_parallel import PLAN_EXPORT, PLAN_IMPORT, TensorGroup, kv_heads_of

HEAD_DIM = -2  # the heads' dimension in pages and state alike


class KVShards:
    """Reads and writes of a sequence's pages and state in the group's KV, in the model's layout."""

    def __init__(self, tp: TensorGroup, kv: KVCache, num_kv_heads: int) -> None:
        """num_kv_heads: the model's (kv holds this rank's share of them)."""
        self.tp = tp
        self.kv = kv
        self.layout: KVLayout = dataclasses.replace(kv.layout, num_kv_heads=num_kv_heads)  # the wire's
        self.heads = [kv_heads_of(r, tp.size, num_kv_heads) for r in range(tp.size)]

    # ---- rank 0 -------------------------------------------------------------------------------

    def read(self, block_ids: list[int], slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every head of the given pages, and of the state slot (None for slot < 0), on rank 0's device."""
        self._check_leader()
        self.tp.send_plan(PLAN_EXPORT, {"blocks": block_ids, "slot": slot})
        pages, state = self._read(block_ids, slot)
        assert pages is not None
        return pages, state

    def write(self, block_ids: list[int], slot: int, pages: torch.Tensor, state: torch.Tensor | None) -> None:
        """pages (every head) into block_ids, state into slot (slot >= 0 when state is given), on every rank."""
        self._check_leader()
        self.tp.send_plan(PLAN_IMPORT, {"blocks": block_ids, "slot": slot if state is not None else -1})
        self._write(block_ids, slot if state is not None else -1, pages, state)

    def _check_leader(self) -> None:
        if not self.tp.is_leader:
            raise RuntimeError("only rank 0 of a tensor-parallel group exports and imports sequences")

    # ---- the other ranks ----------------------------------------------------------------------

    def follow(self, kind: int, plan: Any) -> None:
        """Rank 0's PLAN_EXPORT or PLAN_IMPORT: this rank's part of it."""
        blocks, slot = [int(b) for b in plan["blocks"]], int(plan["slot"])
        if kind == PLAN_EXPORT:
            self._read(blocks, slot)
        elif kind == PLAN_IMPORT:
            self._write(blocks, slot, None, None)
        else:
            raise ValueError(f"not a handoff plan: kind {kind}")

    # ---- every rank ---------------------------------------------------------------------------

    def _read(self, block_ids: list[int], slot: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        kv = self.kv
        pages = None
        if block_ids:
            parts = self.tp.gather(kv.read_pages(block_ids)[0])
            pages = self._merge(parts, self.layout.page_shape(len(block_ids))) if parts is not None else None
        elif self.tp.is_leader:
            pages = torch.empty(self.layout.page_shape(0), dtype=kv.pages.dtype, device=kv.device)
        state = None
        if slot >= 0:
            parts = self.tp.gather(kv.read_state(slot))
            state = self._merge(parts, self.layout.state_shape()) if parts is not None else None
        return pages, state

    def _write(self, block_ids: list[int], slot: int, pages: torch.Tensor | None, state: torch.Tensor | None) -> None:
        kv, lo = self.kv, self.kv.layout
        if block_ids:
            out = torch.empty(lo.page_shape(len(block_ids)), dtype=lo.dtype, device=kv.device)
            kv.write_pages(block_ids, self.tp.scatter(out, self._split(pages)))
        if slot >= 0:
            out = torch.empty(lo.state_shape(), dtype=lo.dtype, device=kv.device)
            kv.write_state(slot, self.tp.scatter(out, self._split(state)))

    def _merge(self, parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
        done = set()
        for (first, count), part in zip(self.heads, parts):
            if first not in done:  # a replicated head: every rank holding it holds the same values
                out.narrow(HEAD_DIM, first, count).copy_(part)
                done.add(first)
        return out

    def _split(self, full: torch.Tensor | None) -> list[torch.Tensor] | None:
        """Rank 0: each rank's heads of full (on this rank's device and dtype); the others: None."""
        if not self.tp.is_leader:
            return None
        assert full is not None
        full = full.to(self.kv.device, self.kv.layout.dtype)
        return [full.narrow(HEAD_DIM, first, count).contiguous() for first, count in self.heads]
