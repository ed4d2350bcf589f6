"""A sequence's prompt logprobs (SamplingParams.prompt_logprobs, vLLM's), gathered as its prefill runs.

The hidden state at position p predicts token p + 1, so the prompt's tokens 1..n-1 take their logprobs
from the LM head over positions 0..n-2 (position n-1 predicts the first output token: the sampler's row).
The runner computes them for the positions of each prefill chunk (engine/execution/runner.py) and adds them here:

    prompt     t0    t1    t2   ...  t(n-2)  t(n-1)
    position   0     1     2    ...  n-2     n-1
    entry            [0]   [1]  ...  [n-3]   [n-2]    entry i: token i + 1, from position i
    chunk      [start, start + n): positions [max(start, num_done), min(start + n, n - 1)) are new

A chunk recomputed (the sequence was preempted and starts over) adds nothing twice: positions below
num_done are skipped. The prefix cache is not restored for such a sequence (engine/core/host_prefix_cache.py),
so every position is computed here, in order. Bookkeeping only (lists): the tensors are the runner's.
"""

from __future__ import annotations

from engine.request import PromptLogprobs


class PromptLogprobsCollector:
    def __init__(self, num_prompt_tokens: int, num_top: int) -> None:
        self.num_positions = max(num_prompt_tokens - 1, 0)
        self.num_top = num_top
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top_ids: list[int] = []
        self.top_logprobs: list[float] = []

    @classmethod
    def of(cls, done: PromptLogprobs) -> PromptLogprobsCollector:
        """A complete collector holding `done` (an imported sequence's, computed by its PE)."""
        c = cls(done.num_positions + 1, done.num_top)
        c.logprobs, c.ranks = list(done.logprobs), list(done.ranks)
        c.top_ids, c.top_logprobs = list(done.top_ids), list(done.top_logprobs)
        return c

    @property
    def num_done(self) -> int:
        return len(self.logprobs)

    @property
    def is_complete(self) -> bool:
        return self.num_done == self.num_positions

    def wanted(self, start: int, num_tokens: int) -> tuple[int, int]:
        """Positions [lo, hi) of the chunk [start, start + num_tokens) whose logprobs are still missing
        (lo >= hi: none)."""
        if self.num_done < start < self.num_positions:
            raise AssertionError(f"prompt logprobs: chunk at {start} skips positions from {self.num_done}")
        return max(start, self.num_done), min(start + num_tokens, self.num_positions)

    def add(self, logprobs: list[float], ranks: list[int], top_ids: list[int], top_logprobs: list[float]) -> None:
        """The next positions' values, in order (top_* flat: num_top per position)."""
        if len(ranks) != len(logprobs) or len(top_ids) != len(logprobs) * self.num_top:
            raise AssertionError("prompt logprobs: inconsistent rows")
        if self.num_done + len(logprobs) > self.num_positions:
            raise AssertionError("prompt logprobs: more positions than the prompt has")
        self.logprobs += logprobs
        self.ranks += ranks
        self.top_ids += top_ids
        self.top_logprobs += top_logprobs

    def result(self) -> PromptLogprobs:
        if not self.is_complete:
            raise AssertionError(f"prompt logprobs: {self.num_done} of {self.num_positions} positions computed")
        return PromptLogprobs(
            self.num_top, tuple(self.logprobs), tuple(self.ranks), tuple(self.top_ids), tuple(self.top_logprobs)
        )
