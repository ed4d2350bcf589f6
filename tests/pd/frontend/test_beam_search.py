"""Beam search's bookkeeping (pd/frontend/beam_search.py) on a synthetic model, against brute force: with a
width that keeps every prefix until the last step, vLLM's procedure must return the best `width` of all
paths (ending at EOS, or max_tokens long) by cum_logprob / (prompt + tokens, less a final EOS) ** penalty."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.request import TokenLogprob
from pd.frontend.beam_search import Beam, BeamAnswers, BeamParams, next_beams, run_beam_search
from pd.frontend.generation import ChoiceUpdate, SubRequest

PROMPT = [7, 8, 9]
EOS = 0


def _logprobs(prefix: tuple[int, ...], vocab: int) -> list[tuple[int, float]]:
    """A made-up model: the next token's logprobs after `prefix`, best first."""
    rng = random.Random(hash(prefix))
    logits = [rng.uniform(-3, 3) for _ in range(vocab)]
    z = math.log(sum(math.exp(x) for x in logits))
    return sorted(((t, x - z) for t, x in enumerate(logits)), key=lambda c: -c[1])


class FakeGeneration:
    """A Generation over the made-up model: one token per request, with its top logprobs."""

    def __init__(self, vocab: int, log: list[list[int]]) -> None:
        self.vocab, self.log = vocab, log
        self.subs: list[SubRequest] = []

    async def __aenter__(self) -> FakeGeneration:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    async def submit(self, subs: list[SubRequest]) -> None:
        self.subs = subs
        self.log += [s.prompt_token_ids for s in subs]

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        for s in reversed(self.subs):  # in any order
            top = _logprobs(tuple(s.prompt_token_ids), self.vocab)
            assert s.params.max_tokens == 1 and s.params.temperature == 0.0 and s.params.logprobs is not None
            top = top[: s.params.logprobs]
            lp = TokenLogprob(top[0][0], top[0][1], tuple(top))
            n = len(s.prompt_token_ids)
            yield ChoiceUpdate(s.choice, "", [top[0][0]], [lp], "length", n, min(n - 1, 2), 1)


def _brute_force(vocab: int, max_tokens: int, eos: int | None, length_penalty: float) -> list[tuple[tuple[int, ...], float]]:
    """Every path: ended at EOS (EOS not counted in its length), or max_tokens long; best first."""
    paths: list[tuple[float, tuple[int, ...], float]] = []
    for n in range(1, max_tokens + 1):
        for tokens in itertools.product(range(vocab), repeat=n):
            if eos is not None and eos in tokens[:-1]:
                continue
            is_eos = eos is not None and tokens[-1] == eos
            if n < max_tokens and not is_eos:
                continue
            cum = sum(dict(_logprobs(tuple(PROMPT) + tokens[:i], vocab))[t] for i, t in enumerate(tokens))
            length = len(PROMPT) + n - (1 if is_eos else 0)
            paths.append((cum / length**length_penalty, tokens, cum))
    paths.sort(key=lambda p: -p[0])
    return [(t, cum) for _, t, cum in paths]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0, -1.0])
@pytest.mark.parametrize("eos", [EOS, None])
def test_beam_search_is_brute_force_where_the_width_keeps_every_prefix(eos, length_penalty):
    vocab, max_tokens = (3 if eos is not None else 2), 3
    width = 4  # every non-EOS prefix up to max_tokens - 1 tokens (at most 2 x 2) stays a beam
    p = BeamParams(width, max_tokens, length_penalty, eos, include_eos=True, num_top_logprobs=2)
    log: list[list[int]] = []
    result = asyncio.run(run_beam_search(lambda: FakeGeneration(vocab, log), "r", PROMPT, p))  # type: ignore[arg-type,return-value]
    want = _brute_force(vocab, max_tokens, eos, length_penalty)[:width]
    assert [b.token_ids for b in result.beams] == [t for t, _ in want]
    for b, (tokens, cum) in zip(result.beams, want, strict=True):
        assert b.cum_logprob == pytest.approx(cum)
        assert b.is_finished == (eos is not None and tokens[-1] == eos)
        assert [lp.token_id for lp in b.logprobs] == list(tokens)  # each token's logprob, as its step gave it
        assert sum(lp.logprob for lp in b.logprobs) == pytest.approx(cum)
        assert all(len(lp.top) == 2 for lp in b.logprobs)
    assert result.num_cached_tokens == 2  # the first step's
    # every step asks for the prompt and the beam's tokens, at most `width` of them at once
    assert all(ids[: len(PROMPT)] == PROMPT for ids in log)
    assert log[0] == PROMPT and len(log) <= 1 + 2 + 4


def test_eos_kept_as_a_token_only_with_include_stop_str_in_output():
    """vLLM's: without include_stop_str_in_output the finished beam's tokens end before the EOS (its logprob
    still counts); the score's length leaves the EOS out either way, so the ranking is the same."""
    vocab, max_tokens, width = 3, 3, 4
    runs = []
    for include in (False, True):
        p = BeamParams(width, max_tokens, 1.0, EOS, include_eos=include)
        runs.append(asyncio.run(run_beam_search(lambda: FakeGeneration(vocab, []), "r", PROMPT, p)))  # type: ignore[arg-type,return-value]
    without, with_eos = runs
    assert [b.cum_logprob for b in without.beams] == [b.cum_logprob for b in with_eos.beams]
    for a, b in zip(without.beams, with_eos.beams, strict=True):
        assert a.token_ids == (b.token_ids[:-1] if b.is_finished else b.token_ids)
    finished = [b for b in with_eos.beams if b.is_finished]
    assert finished, "the synthetic model ends some beam at EOS within 3 tokens"

    async def updates() -> list[ChoiceUpdate]:
        p = BeamParams(width, max_tokens, 1.0, EOS, include_eos=True)
        answers = BeamAnswers([(len(PROMPT), with_eos)], p, lambda ids: ",".join(map(str, ids)))
        return [u async for u in answers.updates()]

    for u, b in zip(asyncio.run(updates()), with_eos.beams, strict=True):
        assert u.token_ids == list(b.token_ids) and u.num_output_tokens == len(b.token_ids)
        assert u.text == ",".join(map(str, b.token_ids[:-1] if b.is_finished else b.token_ids))  # EOS: no text
        assert u.finish_reason == ("stop" if b.is_finished else "length")


def test_one_step_keeps_the_best_width_by_cumulative_logprob():
    p = BeamParams(2, 5, eos_token_id=EOS)
    beams = [Beam((1,), cum_logprob=-1.0), Beam((2,), cum_logprob=-0.5)]
    steps = [
        TokenLogprob(3, -0.1, ((3, -0.1), (EOS, -0.2), (4, -3.0), (5, -4.0))),
        TokenLogprob(EOS, -0.3, ((EOS, -0.3), (6, -1.0), (7, -2.0), (8, -9.0))),
    ]
    live, finished = next_beams(beams, steps, p)
    assert [(b.token_ids, b.cum_logprob) for b in live] == [((1, 3), -1.1), ((2, 6), -1.5)]
    assert [(b.token_ids, b.cum_logprob) for b in finished] == [((1,), -1.2), ((2,), -0.8)]
