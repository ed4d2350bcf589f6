"""POST /v1/completions: raw prompts (text or token ids, one or a batch), whole or streamed.

`echo` with `logprobs` gives the prompt's tokens' logprobs in the echoed part (its first token's null), then
the generated tokens', as vLLM does (lm-evaluation-harness's loglikelihood relies on it); `max_tokens: 0`
with `echo` answers with the prompt alone (the engine still samples one token, which is counted in
`usage` and not shown, as in vLLM). vLLM's `prompt_logprobs` come on each choice (pd/api/prompt_logprobs.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine.request import PromptLogprobs, TokenLogprob
from pd.api.prompt_logprobs import LOGPROB_FLOOR, candidates, prompt_logprobs_json
from pd.api.protocol import CompletionRequest, parse_completion_request
from pd.api.sse import stream_choices
from pd.errors import bad_request, internal
from pd.frontend.beam_search import BeamAnswers, BeamParams, eos_token_id, search
from pd.frontend.coordinator import Coordinator
from pd.frontend.generation import ChoiceSource, ChoiceUpdate, Generation, SubRequest
from pd.http.io import json_response, usage
from pd.http.request_log import REQUEST_ID
from pd.rank.client import RankClient

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_AFFINITY_CHARS = 1024


class _LogprobWriter:
    """OpenAI's legacy logprobs object of one choice, built up as tokens arrive."""

    def __init__(self, co: Coordinator, text_offset: int) -> None:
        self.co = co
        self.offset = text_offset

    def block(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            text = self.co.token_text(lp.token_id)
            tokens.append(text)
            token_lps.append(max(lp.logprob, LOGPROB_FLOOR))
            # the sampled token first, then the top `logprobs` (OpenAI's legacy API, vLLM: up to logprobs + 1)
            top = {text: max(lp.logprob, LOGPROB_FLOOR)}
            for t, x in lp.top:
                if t != lp.token_id:
                    top.setdefault(self.co.token_text(t), max(x, LOGPROB_FLOOR))
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def prompt_block(self, prompt_ids: list[int], plp: PromptLogprobs, num_top: int) -> dict[str, Any]:
        """The echoed prompt's part (vLLM's): its first token's logprob and top_logprobs null, then each
        token's with up to num_top + 1 entries (the prompt's token, then the top ones)."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for j, t in enumerate(prompt_ids):
            text = self.co.token_text(t)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if j == 0:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(max(plp.logprobs[j - 1], LOGPROB_FLOOR))
            top: dict[str, float] = {}
            for c, x, _ in candidates(prompt_ids, plp, j - 1)[: num_top + 1]:
                top.setdefault(self.co.token_text(c), max(x, LOGPROB_FLOOR))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _merge(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    return b if a is None else {k: a[k] + b[k] for k in a}


async def completions(co: Coordinator, request: web.Request) -> web.StreamResponse:
    arrival_s = time.monotonic()
    return await answer_completion(co, request, await co.read_json(request), arrival_s)


async def answer_completion(
    co: Coordinator, request: web.Request, body: Any, arrival_s: float
) -> web.StreamResponse:
    """A completion for a body already read (POST /v1/completions, and /invocations)."""
    req = parse_completion_request(co.with_sampling_defaults(body))
    co.check_model(req.model)
    n = req.sampling.n
    prompt_ids, prompt_texts = await co.offload(_tokenize, co, req)
    subs: list[SubRequest] = []
    rid = f"cmpl-{REQUEST_ID.get()}"
    # max_tokens 0 (echo only): the engine samples one token nobody sees, as vLLM's does
    requested = 1 if req.sampling.max_tokens == 0 else req.sampling.max_tokens
    for j, ids in enumerate(prompt_ids):
        max_tokens = co.max_tokens_for(len(ids), requested, "prompt", DEFAULT_MAX_TOKENS)
        for i in range(n):
            params = req.sampling.params(max_tokens, req.logprobs, i)
            subs.append(
                SubRequest(f"{rid}-{j * n + i}", j * n + i, ids, params, req.sampling.use_prefix_cache)
            )
    first = req.prompts[0]
    key = first[:_AFFINITY_CHARS] if isinstance(first, str) else ",".join(map(str, first[:256]))
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": co.model_name}
    echo = [
        _Echo(prompt_texts[k // n] if req.echo else "", prompt_ids[k // n]) for k in range(len(subs))
    ]
    num_prompt = sum(len(ids) for ids in prompt_ids)
    with co.claim(rid), co.pick_rank(key, prompt_ids[0]) as rank:  # by the first prompt, as the key
        if req.sampling.beam is not None:
            beams = await _beam_search(co, req, rank, key, rid, prompt_ids, subs, arrival_s)
            return await _whole(co, req, beams, head, echo, num_prompt)
        return await _generate(co, request, req, rank, key, subs, arrival_s, head, echo, num_prompt)


async def _beam_search(
    co: Coordinator,
    req: CompletionRequest,
    rank: RankClient,
    key: str,
    rid: str,
    prompt_ids: list[list[int]],
    subs: list[SubRequest],
    arrival_s: float,
) -> BeamAnswers:
    """vLLM's use_beam_search: the n choices of each prompt are its n best beams, best first."""
    beam = req.sampling.beam
    assert beam is not None
    eos = eos_token_id(co, req.sampling.ignore_eos)
    params = [
        BeamParams(
            beam.width,
            subs[j * beam.width].params.max_tokens,
            beam.length_penalty,
            eos,
            beam.include_stop_str_in_output,
            req.logprobs or 0,
        )
        for j in range(len(prompt_ids))
    ]
    return await search(co, rank, key, rid, prompt_ids, params, req.sampling.use_prefix_cache, arrival_s)


@dataclass(frozen=True)
class _Echo:
    """One choice's prompt: the text it echoes ("" without echo) and its token ids."""

    text: str
    token_ids: list[int]


def _prompt_part(
    req: CompletionRequest, e: _Echo, u: ChoiceUpdate, writer: _LogprobWriter
) -> tuple[str, dict[str, Any] | None]:
    """A choice's echoed part (its first update): the prompt's text and, with logprobs, its block."""
    if not (req.echo and req.logprobs is not None):
        return e.text, None
    if u.prompt_logprobs is None:
        raise internal("the engine's first output lacks the prompt logprobs the request asked for")
    return e.text, writer.prompt_block(e.token_ids, u.prompt_logprobs, req.logprobs)


def _tokenize(co: Coordinator, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Each prompt's ids, and its text when echoed (on the render threads: pd/frontend/coordinator.py)."""
    prompt_ids: list[list[int]] = []
    prompt_texts: list[str] = []
    for p in req.prompts:
        ids = co.renderer.encode(p, req.add_special_tokens) if isinstance(p, str) else list(p)
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        prompt_ids.append(ids)
        if req.echo:
            prompt_texts.append(p if isinstance(p, str) else co.tokenizer.decode(ids))
    return prompt_ids, prompt_texts


async def _generate(
    co: Coordinator,
    request: web.Request,
    req: CompletionRequest,
    rank: RankClient,
    key: str,
    subs: list[SubRequest],
    arrival_s: float,
    head: dict[str, Any],
    echo: list[_Echo],
    num_prompt: int,
) -> web.StreamResponse:
    async with Generation(rank, co.metrics, arrival_s, co.pd, key) as gen:
        await gen.submit(subs)
        if req.sampling.stream:
            return await _stream(co, request, req, gen, head, echo, num_prompt)
        return await _whole(co, req, gen, head, echo, num_prompt)


async def _whole(
    co: Coordinator,
    req: CompletionRequest,
    gen: ChoiceSource,
    head: dict[str, Any],
    echo: list[_Echo],
    num_prompt: int,
) -> web.Response:
    k = len(echo)
    is_echo_only = req.sampling.max_tokens == 0
    texts = [""] * k
    writers = [_LogprobWriter(co, 0 if req.logprobs is not None and req.echo else len(e.text)) for e in echo]
    lps: list[dict[str, Any] | None] = [None] * k
    prompt_lps: list[list[Any] | None] = [None] * k
    is_started = [False] * k
    finish: list[str | None] = [None] * k
    num_out = [0] * k
    cached: dict[int, int] = {}
    async for u in gen.updates():
        i = u.choice
        if not is_started[i]:
            is_started[i] = True
            texts[i], block = _prompt_part(req, echo[i], u, writers[i])
            lps[i] = block
            if u.prompt_logprobs is not None:
                prompt_lps[i] = prompt_logprobs_json(co, echo[i].token_ids, u.prompt_logprobs)
        if not is_echo_only:
            texts[i] += u.text
            if req.logprobs is not None:
                lps[i] = _merge(lps[i], writers[i].block(u.logprobs))
        if u.finish_reason is not None:
            finish[i], num_out[i] = u.finish_reason, u.num_output_tokens
            p = i // req.sampling.n
            cached[p] = max(cached.get(p, 0), u.num_cached_tokens)
    empty: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    choices = [
        {
            "index": i,
            "text": texts[i],
            "logprobs": (lps[i] or empty) if req.logprobs is not None else None,
            "finish_reason": finish[i],
            "prompt_logprobs": prompt_lps[i],  # vLLM's (null unless computed: prompt_logprobs, or echo's)
        }
        for i in range(k)
    ]
    return json_response(
        {**head, "choices": choices, "usage": usage(num_prompt, sum(num_out), sum(cached.values()))}
    )


async def _stream(
    co: Coordinator,
    request: web.Request,
    req: CompletionRequest,
    gen: Generation,
    head: dict[str, Any],
    echo: list[_Echo],
    num_prompt: int,
) -> web.StreamResponse:
    k = len(echo)
    is_echo_only = req.sampling.max_tokens == 0
    is_started = [False] * k
    writers = [_LogprobWriter(co, 0 if req.logprobs is not None and req.echo else len(e.text)) for e in echo]
    num_out = [0] * k
    cached: dict[int, int] = {}

    def choice(u: ChoiceUpdate) -> dict[str, Any] | None:
        i = u.choice
        text, logprobs = ("", None) if is_echo_only else (u.text, None)
        prompt_block = None
        if not is_started[i]:
            is_started[i] = True
            echoed, prompt_block = _prompt_part(req, echo[i], u, writers[i])
            text = echoed + text
        if u.finish_reason is not None:
            num_out[i] = u.num_output_tokens
            p = i // req.sampling.n
            cached[p] = max(cached.get(p, 0), u.num_cached_tokens)
        if req.logprobs is not None:
            logprobs = prompt_block
            if not is_echo_only:
                logprobs = _merge(logprobs, writers[i].block(u.logprobs))
        if not text and u.finish_reason is None and not (logprobs and logprobs["tokens"]):
            return None
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": u.finish_reason}

    def final_usage() -> dict[str, Any]:
        return usage(num_prompt, sum(num_out), sum(cached.values()))

    def choice_usage(u: ChoiceUpdate) -> dict[str, Any]:
        """vLLM's continuous usage: the choice's prompt and its tokens so far."""
        return usage(len(echo[u.choice].token_ids), u.num_output_tokens, u.num_cached_tokens)

    return await stream_choices(request, gen, head, choice, final_usage, choice_usage, req.sampling)
