"""The speculation switch (engine/speculative/switch.py): per batch class, drafting stays on where drafted steps
give more tokens per second and stops where plain ones do, trying the other side again every PROBE_EVERY
steps; in the engine, the tokens are those of a run without speculation either way.

The step times come from a clock the test drives (each step costs what a cost model says for the tokens it
fed), so the choices are the same on any machine; bench/spec_decode.py measures the switch on the real clock."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from engine.request import SamplingParams
from engine.speculative import switch as sw
from engine.speculative.switch import SpeculationSwitch
from tests.engine.speculative.test_speculator import oracle_proposer
from tests.engine_utils import random_prompts, small_engine


def _runs(chosen: list[bool], side: bool) -> list[int]:
    """The lengths of chosen's runs of side."""
    out, n = [], 0
    for c in [*chosen, not side]:
        if c == side:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


class StepClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(switch: SpeculationSwitch, clock: StepClock, batch: int, steps: int, cost: Callable[[int], float],
         tokens_if_drafted: float) -> list[bool]:
    """steps pure decode steps of `batch` sequences: a drafted one feeds 4 rows a sequence and appends
    tokens_if_drafted a sequence, a plain one 1 and 1; each costs cost(rows fed)."""
    chosen = []
    for _ in range(steps):
        drafted = switch.choose(batch)
        switch.start(True)
        rows = batch * (4 if drafted else 1)
        switch.emitted(round(batch * (tokens_if_drafted if drafted else 1)))
        clock.now += cost(rows)
        chosen.append(drafted)
    return chosen


def test_each_batch_class_takes_the_faster_side_and_probes_the_other() -> None:
    clock = StepClock()
    switch = SpeculationSwitch(clock)

    def roofline(rows: int) -> float:  # a weight read of 10 ms, or 1 ms a row once compute-bound
        return max(0.010, 0.001 * rows)

    # batch 1: 4 rows cost what 1 does, 2.5 tokens a step drafted: drafting pays
    small = _run(switch, clock, 1, 200, roofline, 2.5)
    # batch 16: 64 rows cost 4x, for 2.5x the tokens: it does not
    large = _run(switch, clock, 16, 200, roofline, 2.5)
    # both sides timed first, MIN_STEPS each and one more: a step is chosen before the one before it is timed
    # (the engine chooses after a step, the time runs to the next one's start)
    n = sw.MIN_STEPS + 1
    assert small[:n] == [True] * n and small[n : 2 * n] == [False] * n
    assert large[:n] == [True] * n and large[n : 2 * n] == [False] * n
    settled_small, settled_large = small[2 * n :], large[2 * n :]
    # then its side, with tries of PROBE_STEPS of the other side after every PROBE_EVERY steps of its own
    assert _runs(settled_small, False) == _runs(settled_large, True) == [sw.PROBE_STEPS] * 3
    assert settled_small[: sw.PROBE_EVERY - 1] == [True] * (sw.PROBE_EVERY - 1)
    rates = switch.describe()
    assert rates["1"][1] > 2 * rates["1"][0]  # 250 against 100 tokens/s
    assert rates["16-31"][0] > rates["16-31"][1]
    assert switch.num_drafted_steps == small.count(True) + large.count(True)
    assert switch.num_plain_steps == 400 - switch.num_drafted_steps


def test_a_change_in_the_traffic_turns_it_back_on() -> None:
    """Drafts that stop being accepted turn drafting off; once they are again, a probe sees it and turns it on."""
    clock = StepClock()
    switch = SpeculationSwitch(clock)
    flat = lambda rows: 0.010 + 0.0005 * rows  # noqa: E731
    assert _run(switch, clock, 4, 100, flat, 2.0)[-52:].count(False) == sw.PROBE_STEPS  # accepted: on, one try off
    off = _run(switch, clock, 4, 200, flat, 1.0)  # nothing accepted: off once its window has the new steps
    assert off.count(True) <= sw.WINDOW + 4 * sw.PROBE_STEPS and off[-52:].count(True) == sw.PROBE_STEPS
    back = _run(switch, clock, 4, 400, flat, 3.0)  # accepted again: the tries see it, on again
    assert back[-52:].count(False) == sw.PROBE_STEPS


def test_idle_gaps_and_prompt_steps_are_not_timed() -> None:
    clock = StepClock()
    switch = SpeculationSwitch(clock)
    switch.choose(2)
    switch.start(True)
    switch.emitted(2)
    switch.idle()  # nothing runs after it: the wait for the next request is not this step's time
    clock.now += 100.0
    switch.choose(2)
    switch.start(False)  # a step with a prompt chunk: not timed either
    switch.emitted(9)
    clock.now += 1.0
    switch.choose(2)
    switch.start(True)
    assert switch.describe()["2-3"] == (0.0, 0.0)


def test_in_the_engine_the_switch_keeps_the_tokens_and_follows_the_cost(tiny_model_dir) -> None:
    """An engine with prompt lookup replaced by drafts from the reference run (about half accepted whole),
    under two step costs the test's clock charges per row fed: memory-bound (a verify costs what a plain
    step does) and compute-bound (cost grows with the square of the rows). The tokens equal the run without
    speculation under both; the first keeps drafting, the second stops after its timed steps."""
    folder = tiny_model_dir("llama")
    prompts = random_prompts([20, 24, 28], seed=8)
    p = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ref = small_engine(folder, is_deterministic=True).generate(prompts, p)
    reference = {tuple(q): s.output_token_ids for q, s in zip(prompts, ref)}
    spec_config = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "auto_disable": True})
    stats = {}
    for name, cost in (("memory", lambda rows: 0.010), ("compute", lambda rows: 0.001 * rows * rows)):
        eng = small_engine(folder, is_deterministic=True, speculative_config=spec_config)
        spec = eng.speculator
        assert spec is not None and spec.switch is not None
        clock = StepClock()
        spec.switch = SpeculationSwitch(clock)
        spec._propose = oracle_proposer(reference, random.Random(3))  # type: ignore[method-assign]
        run = eng.runner.run

        def charged(seqs, num_new, run=run, clock=clock, cost=cost):  # type: ignore[no-untyped-def]
            clock.now += cost(sum(num_new))
            return run(seqs, num_new)

        eng.runner.run = charged  # type: ignore[method-assign]
        got = eng.generate(prompts, p)
        assert [s.output_token_ids for s in got] == [s.output_token_ids for s in ref], name
        eng.check_idle()
        stats[name] = eng.stats()
    mem, comp = stats["memory"], stats["compute"]
    assert mem.spec_switch_plain_steps_total < mem.spec_switch_drafted_steps_total
    assert comp.spec_switch_plain_steps_total > comp.spec_switch_drafted_steps_total
    assert mem.spec_num_accepted_tokens_total > comp.spec_num_accepted_tokens_total
