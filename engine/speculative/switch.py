"""Whether speculation pays for the batch at hand, measured by the engine itself.

A decode step with drafts feeds 1 + k rows per sequence: a small, memory-bound batch barely notices (llama8b
k = 3 on an H100: 1.11x a plain step at batch 1), a large, compute-bound one pays nearly in proportion (1.91x
at batch 64), and what it buys is the accepted drafts, which depend on the text. Where the two cross
depends on the device, the model, the drafter and the traffic, so the engine measures it rather than
model it (the goodput of SmartSpec, read off the clock):

- steps fall in batch classes by their running sequences: 1, 2-3, 4-7, 8-15, ... (bit length);
- per class, the output tokens per second of its pure decode steps (no prompt chunk beside) with drafts
  and without: each side's tokens over its seconds in its last WINDOW timed steps (a step's time runs from
  its start to the next step's start: scheduling, drafting, the forward, sampling, the drafter's next
  drafts), so one slow step (a first launch, a page fault) weighs one step's worth and then leaves;
- a class speculates until it has MIN_STEPS drafted steps timed, then runs MIN_STEPS plain ones, then takes
  the side with the higher rate, and every PROBE_EVERY steps runs PROBE_STEPS of the other side (traffic
  changes: drafts that were accepted stop being, and back).

Tokens do not depend on it: a verify draws each token as a plain step does (engine/speculative/speculator.py),
so turning speculation on and off changes when tokens come, never which. `"auto_disable": true` in
--speculative-config turns it on; it is not the default: on SmolLM2 on the CPU (bench/spec_decode.py --ks 3,3a)
it lost to drafting always at batch 32 (44 against 64 decode tokens/s on echo-heavy chats, 40 against 55 on
plain ones), where drafting still paid: each class's first steps time each side at another point of the
answers (acceptance changes along an answer) and a stale side is tried again only every PROBE_EVERY steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

MIN_STEPS = 8  # timed steps of each side before a class compares them
WINDOW = 16  # a side's rate: over its last WINDOW timed steps
PROBE_EVERY = 48  # a class's steps on its side between two tries of the other
PROBE_STEPS = 4  # a try's steps
MAX_GAP_S = 2.0  # a step whose time to the next exceeds this (the engine idled) is not timed


@dataclass
class _Class:
    timed: tuple[deque[tuple[int, float]], ...] = field(
        default_factory=lambda: (deque(maxlen=WINDOW), deque(maxlen=WINDOW))
    )  # (tokens, seconds) of the last timed steps, [plain, drafted]
    steps: list[int] = field(default_factory=lambda: [0, 0])  # timed steps, [plain, drafted]
    since_probe: int = 0
    probe: tuple[bool, int] = (False, 0)  # the side being tried, its steps left

    def rate(self, side: int) -> float:
        seconds = sum(t for _, t in self.timed[side])
        return sum(n for n, _ in self.timed[side]) / seconds if seconds else 0.0

    def record(self, side: int, tokens: int, seconds: float) -> None:
        self.timed[side].append((tokens, seconds))
        self.steps[side] += 1

    def choose(self) -> bool:
        if self.steps[1] < MIN_STEPS:
            return True
        if self.steps[0] < MIN_STEPS:
            return False
        side, left = self.probe
        if left:
            self.probe = (side, left - 1)
            return side
        best = self.rate(1) >= self.rate(0)
        self.since_probe += 1
        if self.since_probe >= PROBE_EVERY:
            self.since_probe = 0
            self.probe = (not best, PROBE_STEPS - 1)
            return not best
        return best


@dataclass
class _Step:
    klass: int
    drafted: bool
    started_s: float
    tokens: int = 0


class SpeculationSwitch:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._classes: dict[int, _Class] = {}
        self._chosen: tuple[int, bool] | None = None  # the next step's class and choice
        self._open: _Step | None = None  # the pure decode step being timed
        self.num_plain_steps = 0  # pure decode steps this switch ran without drafts
        self.num_drafted_steps = 0

    def choose(self, num_running: int) -> bool:
        """Whether the next step drafts, for a batch of num_running sequences (asked once a step: before
        the step for prompt lookup, after the previous one for a drafter that drafts ahead)."""
        klass = max(num_running, 1).bit_length()
        drafted = self._classes.setdefault(klass, _Class()).choose()
        self._chosen = (klass, drafted)
        return drafted

    def chosen(self) -> bool | None:
        return None if self._chosen is None else self._chosen[1]

    def start(self, is_pure_decode: bool) -> None:
        """At a step's start (after choose): closes the previous step's timing, opens this one's."""
        now = self._clock()
        prev, self._open = self._open, None
        if prev is not None and prev.tokens and now - prev.started_s <= MAX_GAP_S:
            self._classes[prev.klass].record(int(prev.drafted), prev.tokens, now - prev.started_s)
        chosen, self._chosen = self._chosen, None
        if is_pure_decode and chosen is not None:
            self._open = _Step(chosen[0], chosen[1], now)
            if chosen[1]:
                self.num_drafted_steps += 1
            else:
                self.num_plain_steps += 1

    def emitted(self, tokens: int) -> None:
        """The tokens the step being timed appended (its verify's)."""
        if self._open is not None:
            self._open.tokens += tokens

    def idle(self) -> None:
        """No sequence runs after this step: its time to the next one is not its own."""
        self._open = None

    def describe(self) -> dict[str, tuple[float, float]]:
        """Per batch class ("1", "2-3", ...): the measured rates (tokens/s) without and with drafts."""
        return {
            ("1" if k == 1 else f"{1 << (k - 1)}-{(1 << k) - 1}"): (c.rate(0), c.rate(1))
            for k, c in sorted(self._classes.items())
        }
