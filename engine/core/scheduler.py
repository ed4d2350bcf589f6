"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences first (decodes take one token each, partial prefills continue), then
waiting sequences in arrival order while the budget, max_num_seqs, free pages and state slots allow.
A sequence is admitted only when pages for all its tokens plus the next one are free (so two
half-done prefills never wait on each other); a decode that finds no page for its next token
preempts the newest running sequence, which later recomputes from its tokens.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.block_pool import BlockPool
from engine.core.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    needs_blocks: bool  # the model has full-attention layers
    needs_state_slot: bool  # the model has sliding-window layers


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockPool,
        slots: BlockPool,
        on_admit: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.config = config
        self.on_admit = on_admit  # called once memory is allocated (the prefix cache fills it here)
        self.blocks = blocks
        self.slots = slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.config.block_size) if self.config.needs_blocks else 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self, num_tokens: int, num_held_blocks: int = 0) -> bool:
        """Whether memory for a sequence of num_tokens (and its next token) is free now, its first
        num_held_blocks pages being held already (pinned from the decode cache)."""
        slots_ok = not self.config.needs_state_slot or self.slots.can_allocate(1)
        return slots_ok and self.blocks.can_allocate(self.blocks_for(num_tokens + 1) - num_held_blocks)

    def allocate(self, seq: Sequence, held_block_ids: list[int] | None = None) -> None:
        """Memory for all of seq's tokens plus one; the caller checked can_admit. held_block_ids:
        seq's first pages, already referenced for it (their reference passes to seq)."""
        held = list(held_block_ids or [])
        seq.block_ids = held + self.blocks.allocate(self.blocks_for(seq.num_tokens + 1) - len(held))
        if self.config.needs_state_slot:
            seq.state_slot = self.slots.allocate(1)[0]

    def release(self, seq: Sequence) -> None:
        """Frees everything seq owns and removes it from the queues."""
        if seq.block_ids:
            self.blocks.free(seq.block_ids)
        if seq.state_slot >= 0:
            self.slots.free([seq.state_slot])
        seq.block_ids, seq.state_slot = [], -1
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def park(self, seq: Sequence) -> None:
        """Takes a running sequence out of the batch, its memory kept (P/D: it waits for its export)."""
        self.running.remove(seq)
        seq.status = SeqStatus.PARKED

    def admit_prefilled(self, seq: Sequence) -> None:
        """Puts seq, its memory allocated and every token but the last computed (imported, or queued
        and counted as cached by a benchmark), straight into the running batch: its next step decodes."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.release(seq)
        seq.num_computed = 0
        seq.num_cached_prompt = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _grow(self, seq: Sequence, upto_tokens: int) -> bool:
        need = self.blocks_for(upto_tokens) - len(seq.block_ids)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        seq.block_ids += self.blocks.allocate(need)
        return True

    def grow_all(self, seqs: list[Sequence], num_tokens: int) -> bool:
        """Pages for num_tokens more tokens of every one of seqs (beyond their tokens now), all or none:
        False, with nothing allocated, when they do not all fit (no preemption)."""
        need = [max(0, self.blocks_for(s.num_tokens + num_tokens) - len(s.block_ids)) for s in seqs]
        if not self.blocks.can_allocate(sum(need)):
            return False
        for seq, n in zip(seqs, need):
            if n:
                seq.block_ids += self.blocks.allocate(n)
        return True

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed, budget)
        b = seq.cache_store_upto
        if seq.num_computed < b < seq.num_computed + n:
            n = b - seq.num_computed  # stop at the boundary whose SWA state the cache stores
        return n

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.can_admit(seq.num_tokens):
                break
            self.waiting.popleft()
            self.allocate(seq)
            if self.on_admit is not None:
                self.on_admit(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = self._chunk(seq, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch
