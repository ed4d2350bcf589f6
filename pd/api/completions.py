"""POST /v1/completions: raw prompts (text or token ids, one or a batch), whole or streamed."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from engine.request import TokenLogprob
from pd.api.protocol import CompletionRequest, parse_completion_request
from pd.api.sse import stream_choices
from pd.errors import bad_request
from pd.frontend.coordinator import Coordinator
from pd.frontend.generation import ChoiceUpdate, Generation, SubRequest
from pd.http.io import json_response, usage
from pd.http.request_log import REQUEST_ID
from pd.rank.client import RankClient

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_LOGPROB_FLOOR = -9999.0
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
            token_lps.append(max(lp.logprob, _LOGPROB_FLOOR))
            # the sampled token first, then the top `logprobs` (OpenAI's legacy API, vLLM: up to logprobs + 1)
            top = {text: max(lp.logprob, _LOGPROB_FLOOR)}
            for t, x in lp.top:
                if t != lp.token_id:
                    top.setdefault(self.co.token_text(t), max(x, _LOGPROB_FLOOR))
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _merge(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    return b if a is None else {k: a[k] + b[k] for k in a}


async def completions(co: Coordinator, request: web.Request) -> web.StreamResponse:
    arrival_s = time.monotonic()
    req = parse_completion_request(await co.read_json(request))
    co.check_model(req.model)
    if req.echo and req.logprobs is not None:
        raise bad_request("'echo' together with 'logprobs' is not supported (no prompt logprobs)", "echo")
    n = req.sampling.n
    prompt_ids, prompt_texts = await co.offload(_tokenize, co, req)
    subs: list[SubRequest] = []
    rid = f"cmpl-{REQUEST_ID.get()}"
    for j, ids in enumerate(prompt_ids):
        max_tokens = co.max_tokens_for(len(ids), req.sampling.max_tokens, "prompt", DEFAULT_MAX_TOKENS)
        for i in range(n):
            params = req.sampling.params(max_tokens, req.logprobs, i)
            subs.append(
                SubRequest(f"{rid}-{j * n + i}", j * n + i, ids, params, req.sampling.use_prefix_cache)
            )
    first = req.prompts[0]
    key = first[:_AFFINITY_CHARS] if isinstance(first, str) else ",".join(map(str, first[:256]))
    rank = co.pick_rank(key)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": co.model_name}
    echo = [prompt_texts[k // n] if req.echo else "" for k in range(len(subs))]
    num_prompt = sum(len(ids) for ids in prompt_ids)
    with co.claim(rid):
        return await _generate(co, request, req, rank, key, subs, arrival_s, head, echo, num_prompt)


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
    echo: list[str],
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
    gen: Generation,
    head: dict[str, Any],
    echo: list[str],
    num_prompt: int,
) -> web.Response:
    k = len(echo)
    texts = list(echo)
    writers = [_LogprobWriter(co, len(e)) for e in echo]
    lps: list[dict[str, Any] | None] = [None] * k
    finish: list[str | None] = [None] * k
    num_out = [0] * k
    cached: dict[int, int] = {}
    async for u in gen.updates():
        texts[u.choice] += u.text
        if req.logprobs is not None:
            lps[u.choice] = _merge(lps[u.choice], writers[u.choice].block(u.logprobs))
        if u.finish_reason is not None:
            finish[u.choice], num_out[u.choice] = u.finish_reason, u.num_output_tokens
            p = u.choice // req.sampling.n
            cached[p] = max(cached.get(p, 0), u.num_cached_tokens)
    empty: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    choices = [
        {
            "index": i,
            "text": texts[i],
            "logprobs": (lps[i] or empty) if req.logprobs is not None else None,
            "finish_reason": finish[i],
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
    echo: list[str],
    num_prompt: int,
) -> web.StreamResponse:
    k = len(echo)
    is_started = [False] * k
    writers = [_LogprobWriter(co, len(e)) for e in echo]
    num_out = [0] * k
    cached: dict[int, int] = {}

    def choice(u: ChoiceUpdate) -> dict[str, Any] | None:
        i = u.choice
        text = u.text
        if not is_started[i]:
            text, is_started[i] = echo[i] + text, True
        if u.finish_reason is not None:
            num_out[i] = u.num_output_tokens
            p = i // req.sampling.n
            cached[p] = max(cached.get(p, 0), u.num_cached_tokens)
        logprobs = writers[i].block(u.logprobs) if req.logprobs is not None else None
        if not text and u.finish_reason is None and not u.logprobs:
            return None
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": u.finish_reason}

    def final_usage() -> dict[str, Any]:
        return usage(num_prompt, sum(num_out), sum(cached.values()))

    return await stream_choices(
        request, gen, head, choice, final_usage if req.sampling.include_usage else None
    )
