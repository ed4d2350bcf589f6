"""Launch-ahead (EngineConfig.launch_ahead): the next decode batch's forward is queued before the step
before it returns, so the device runs it while the host builds that step's outputs and the caller
handles them. Steady decode only, two ways:

    launched ahead   after the step's batch is sampled, the next one is scheduled and launched
                     before the outputs are built (LaunchAhead.launches)
    fed ahead        every row greedy without processors, logprobs or grammar: the rows' argmax stays
                     on the device and is the next batch's input, launched before the tokens reach
                     the host, so appending and detokenizing overlap that forward too
                     (LaunchAhead.feeds, LaunchAhead.feed)

LLMEngine (engine/engine.py) schedules, launches and completes every batch; LaunchAhead decides when
one may go ahead, launches a fed one, and holds the batch launched ahead (at most one) until the next
step takes it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.execution.runner import ModelRunner
from engine.faults import raise_if_fatal
from engine.layers.decode import is_decode_row

log = logging.getLogger(__name__)

PLACEHOLDER = 0  # a sequence's next token while only the device has it (LaunchAhead.feed)


@dataclass(frozen=True)
class LaunchedBatch:
    """A scheduled batch whose forward is queued (on CUDA maybe still running): the step that
    completes it samples the logits of rows `sampled` (indices into seqs)."""

    seqs: list[Sequence]
    num_new: list[int]
    sampled: list[int]
    logits: torch.Tensor | None


class LaunchAhead:
    """The batch launched ahead of its step, when one may be, and how many were."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, enabled: bool) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.enabled = enabled  # off in an expert-parallel group: its ranks step in lockstep
        self.launched: LaunchedBatch | None = None  # a decode batch launched ahead: the next step samples it
        self.num_launched_ahead = 0  # batches launched before the step before them returned
        self.num_fed_ahead = 0  # of those, launched before the last step's tokens reached the host

    def take(self) -> LaunchedBatch | None:
        """The batch launched ahead, if any, now the calling step's to complete."""
        launched, self.launched = self.launched, None
        return launched

    def hold(self, launched: LaunchedBatch | None) -> None:
        """Keeps the batch the engine launched ahead (None: there was nothing to launch) for the next step."""
        self.launched = launched
        self.num_launched_ahead += launched is not None

    def launches(self) -> bool:
        """Whether the next batch may be launched now, before this step's outputs leave: steady decode
        only (every running sequence decodes one token, nothing waits to be admitted). A request that
        arrives meanwhile joins one step later; a sequence aborted meanwhile has its row computed and
        dropped. NOTE: its memory may be reused at once: every later writer of the pools (forwards,
        imports, prefix restores) is queued on the same stream, after the launched forward."""
        sched = self.scheduler
        return (
            self.enabled
            and not sched.waiting
            and bool(sched.running)
            and all(is_decode_row(s, s.num_uncomputed) for s in sched.running)
        )

    def feeds(self, launched: LaunchedBatch) -> bool:
        """Whether the next batch may be launched before this one's tokens reach the host, fed with
        them on the device: steady decode of the same sequences, every row greedy with no processor,
        logprob or grammar (its token is the argmax of the raw logits), and pages for the next token of
        every sequence free without preempting any (a preempted sequence would recompute a placeholder)."""
        sched, seqs = self.scheduler, launched.seqs
        return (
            self.enabled
            and launched.logits is not None
            and not sched.waiting
            and len(sched.running) == len(seqs)
            and all(a is b for a, b in zip(sched.running, seqs))
            and launched.sampled == list(range(len(seqs)))
            and all(
                is_decode_row(s, n) and s.params.is_greedy and not s.params.has_penalties
                and s.params.logprobs is None and s.matcher is None and not s.is_prefill_only
                and not s.cache_store_upto
                for s, n in zip(seqs, launched.num_new)
            )
        )  # fmt: skip

    def feed(self, launched: LaunchedBatch) -> list[int]:
        """Completes a batch that feeds(): its rows' tokens, in row order, for the engine to append.
        The argmax stays on the device and feeds the next batch, launched at once and held (each
        sequence's next token a placeholder while it is queued). A sequence that ends on its token has
        had one more row computed, which the next step drops. NOTE: the tokens' copy to the host is
        queued before the next forward, so reading them waits for this batch only."""
        seqs = launched.seqs
        assert launched.logits is not None
        for seq in seqs:
            seq.num_computed += 1
        ids = launched.logits.argmax(-1)  # what sample() draws for greedy rows without processors
        host, ready = ids, None
        if ids.is_cuda:
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        if self.scheduler.grow_all(seqs, 1):
            for seq in seqs:
                seq.output_token_ids.append(PLACEHOLDER)
            try:
                sampled, logits = self.runner.run(seqs, [1] * len(seqs), fed_ids=ids)
                self.launched = LaunchedBatch(list(seqs), [1] * len(seqs), sampled, logits)
                self.num_launched_ahead += 1
                self.num_fed_ahead += 1
            except Exception as e:  # the next step runs the batch the ordinary way (and fails it there)
                raise_if_fatal(e)
                log.warning("a decode batch launched ahead failed (%r); the next step runs it again", e)
            finally:
                for seq in seqs:
                    seq.output_token_ids.pop()
        if ready is not None:
            ready.synchronize()
        tokens: list[int] = host.tolist()
        return tokens
