"""Beam search as vLLM's serving layer runs it: each step is one engine request per beam, for one greedy
token with the top 2 x width logprobs, over the prompt and the beam's tokens so far; all of a step's
requests go at once, so the engine's prefix cache shares the prompt's KV across beams and steps (under
P/D each step is a normal request: the PE prefills it from its host prefix cache).

    step:   beams b_0..b_{w-1}  ──► 2w candidates each (token, cum_logprob + logprob)
            candidates at EOS   ──► finished (unless ignore_eos)
            the rest, best w by cumulative logprob ──► next step's beams
    end:    after max_tokens steps, finished + live ranked by vLLM's get_beam_search_score:
            cum_logprob / (prompt + generated tokens, less a final EOS) ** length_penalty; best w

There is no early stop (vLLM's runs every step too). Bookkeeping (`next_beams`, `best_beams`) works on ints
and floats and is tested on the CPU; `run_beam_search` sends the steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.request import SamplingParams, TokenLogprob
from pd.frontend.coordinator import Coordinator
from pd.frontend.generation import ChoiceUpdate, Generation, SubRequest
from pd.rank.client import RankClient


@dataclass(frozen=True)
class BeamParams:
    width: int
    max_tokens: int
    length_penalty: float = 1.0
    eos_token_id: int | None = None  # None: no token ends a beam (ignore_eos, or a tokenizer without EOS)
    include_eos: bool = False  # include_stop_str_in_output: a finished beam keeps its EOS as a token
    num_top_logprobs: int = 0  # alternatives kept with each token (the request's logprobs)

    @property
    def num_candidates(self) -> int:
        return 2 * self.width


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...] = ()  # generated, not the prompt; ends with EOS only with include_eos
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of token_ids
    cum_logprob: float = 0.0  # the EOS's included, shown or not
    is_finished: bool = False  # ended at EOS

    def score(self, num_prompt_tokens: int, p: BeamParams) -> float:
        """vLLM's get_beam_search_score: its length counts the prompt, and not a final EOS."""
        n = num_prompt_tokens + len(self.token_ids)
        if self.is_finished and p.include_eos:
            n -= 1
        return self.cum_logprob / (n**p.length_penalty)


def next_beams(beams: list[Beam], steps: list[TokenLogprob], p: BeamParams) -> tuple[list[Beam], list[Beam]]:
    """One step: beams[i] continued by steps[i].top's first 2w candidates. Returns (the next step's
    beams, the best w by cumulative logprob; beams finished at EOS this step, all of them, as vLLM's)."""
    live: list[tuple[float, int, int, Beam]] = []
    finished: list[Beam] = []
    for i, (beam, step) in enumerate(zip(beams, steps, strict=True)):
        for j, (token, logprob) in enumerate(step.top[: p.num_candidates]):
            shown = TokenLogprob(token, logprob, step.top[: p.num_top_logprobs])
            cum = beam.cum_logprob + logprob
            if token == p.eos_token_id:
                if p.include_eos:
                    finished.append(Beam(beam.token_ids + (token,), beam.logprobs + (shown,), cum, True))
                else:
                    finished.append(Beam(beam.token_ids, beam.logprobs, cum, True))
                continue
            live.append((-cum, i, j, Beam(beam.token_ids + (token,), beam.logprobs + (shown,), cum)))
    live.sort(key=lambda c: c[:3])
    return [c[3] for c in live[: p.width]], finished


def best_beams(beams: list[Beam], num_prompt_tokens: int, p: BeamParams) -> list[Beam]:
    """The answers: the best w by score, best first (ties keep their order)."""
    return sorted(beams, key=lambda b: -b.score(num_prompt_tokens, p))[: p.width]


@dataclass(frozen=True)
class BeamResult:
    beams: list[Beam]  # best first
    num_cached_tokens: int  # the prompt's, at the first step


async def run_beam_search(
    generation: Callable[[], Generation],
    request_id: str,
    prompt_ids: list[int],
    p: BeamParams,
    use_prefix_cache: bool = True,
) -> BeamResult:
    """Beam search over one prompt; `generation()` opens a Generation for each step (on one rank)."""
    params = SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=max(p.num_candidates, p.num_top_logprobs)
    )
    beams = [Beam()]
    done: list[Beam] = []
    num_cached = 0
    for step in range(p.max_tokens):
        subs = [
            SubRequest(f"{request_id}-{step}-{i}", i, prompt_ids + list(b.token_ids), params, use_prefix_cache)
            for i, b in enumerate(beams)
        ]
        outs: list[TokenLogprob | None] = [None] * len(beams)
        async with generation() as gen:
            await gen.submit(subs)
            async for u in gen.updates():
                if u.logprobs:
                    outs[u.choice] = u.logprobs[0]
                if step == 0 and u.finish_reason is not None:
                    num_cached = u.num_cached_tokens
        steps = [o for o in outs if o is not None]
        if len(steps) != len(beams):
            raise RuntimeError("a beam step's request finished without its token's logprobs")
        beams, finished = next_beams(beams, steps, p)
        done += finished
    return BeamResult(best_beams(done + beams, len(prompt_ids), p), num_cached)


class BeamAnswers:
    """Finished beams as the choice updates a Generation gives (one whole update per choice), for the
    handlers' whole and streamed answers. choices[k]: (the prompt's token count, its result); choice k's
    beams are numbered k * width + rank."""

    def __init__(self, results: list[tuple[int, BeamResult]], p: BeamParams, decode: Callable[[list[int]], str]):
        self.results = results
        self.p = p
        self.decode = decode

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        for k, (num_prompt, result) in enumerate(self.results):
            for rank, b in enumerate(result.beams):
                ids = list(b.token_ids)
                text_ids = ids[:-1] if b.is_finished and self.p.include_eos else ids  # the EOS is never text
                yield ChoiceUpdate(
                    choice=k * self.p.width + rank,
                    text=self.decode(text_ids),
                    token_ids=ids,
                    logprobs=list(b.logprobs),
                    finish_reason="stop" if b.is_finished else "length",
                    num_prompt_tokens=num_prompt,
                    num_cached_tokens=result.num_cached_tokens,
                    num_output_tokens=len(ids),
                )


async def search(
    co: Coordinator,
    rank: RankClient,
    key: str | None,
    request_id: str,
    prompts: list[list[int]],
    params: list[BeamParams],
    use_prefix_cache: bool,
    arrival_s: float,
) -> BeamAnswers:
    """Beam search over each prompt (params[k] for prompts[k]) at once, on one rank (through the PE under P/D)."""

    def generation() -> Generation:
        return Generation(rank, co.metrics, arrival_s, co.pd, key)

    tasks = [
        asyncio.ensure_future(run_beam_search(generation, f"{request_id}-{k}", ids, p, use_prefix_cache))
        for k, (ids, p) in enumerate(zip(prompts, params, strict=True))
    ]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:  # one prompt failed, or the client left: the others' requests end too
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return BeamAnswers(
        [(len(ids), r) for ids, r in zip(prompts, results, strict=True)],
        params[0],
        lambda ids: str(co.tokenizer.decode(ids, skip_special_tokens=True)),
    )


def eos_token_id(co: Coordinator, ignore_eos: bool) -> int | None:
    """The token that ends a beam: the tokenizer's EOS (vLLM's), none with ignore_eos."""
    eos = getattr(co.tokenizer, "eos_token_id", None)
    return None if ignore_eos or not isinstance(eos, int) else eos
