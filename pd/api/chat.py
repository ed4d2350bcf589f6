"""POST /v1/chat/completions: render, route, generate, and answer whole or as an SSE stream."""

from __future__ import annotations

import functools
import time
from typing import Any

from aiohttp import web

from engine.request import TokenLogprob
from pd.api.prompt_logprobs import LOGPROB_FLOOR, prompt_logprobs_json
from pd.api.protocol import ChatRequest, parse_chat_request
from pd.api.sse import stream_choices
from pd.chat.reasoning import (
    ReasoningSplitter,
    Start,
    continued_start,
    reasoning_parser,
    split_reasoning,
)
from pd.chat.renderer import RenderedPrompt
from pd.chat.tool_choice import RequiredCalls, forced_name, is_forced, named_call, required_calls
from pd.chat.toolcalls import ParsedOutput, ToolStreamFilter, new_call_id
from pd.frontend.beam_search import BeamParams, eos_token_id, search
from pd.frontend.coordinator import Coordinator
from pd.frontend.generation import ChoiceSource, ChoiceUpdate, Generation, SubRequest
from pd.http.io import json_response, usage
from pd.http.request_log import REQUEST_ID
from pd.rank.client import RankClient


def affinity_key(req: ChatRequest) -> str | None:
    """A conversation's first user message: the same for every turn of it."""
    for m in req.messages:
        if m["role"] == "user":
            return str(m.get("content") or "")
    return None


def _logprob_entry(co: Coordinator, token_id: int, logprob: float) -> dict[str, Any]:
    text = co.token_text(token_id)
    return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(co: Coordinator, lps: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                **_logprob_entry(co, lp.token_id, lp.logprob),
                "top_logprobs": [_logprob_entry(co, t, x) for t, x in lp.top],
            }
            for lp in lps
        ]
    }


def parse_tool_output(co: Coordinator, req: ChatRequest, text: str) -> ParsedOutput:
    """Tool calls in an "auto" answer, in the format the chat template teaches."""
    parsed = co.renderer.tool_parser.parse(text)
    if not req.parallel_tool_calls and len(parsed.tool_calls) > 1:  # at most one call: the first
        return ParsedOutput(parsed.content, parsed.tool_calls[:1])
    return parsed


def reasoning_start(co: Coordinator, req: ChatRequest, rendered: RenderedPrompt) -> Start | None:
    """How the answer starts for --reasoning-parser; None: no reasoning split off."""
    parser = reasoning_parser(co.cfg.reasoning_parser)
    if parser is None or is_forced(req.tool_choice):  # the grammar holds from the first token: no reasoning
        return None
    if req.continue_final_message:
        return continued_start(req.messages[-1].get("content") or "")
    return parser.start(rendered.text, req.chat_template_kwargs)


async def render(co: Coordinator, req: ChatRequest) -> RenderedPrompt:
    """The request's prompt, rendered on the render threads."""
    return await co.offload(
        functools.partial(
            co.renderer.render_chat,
            req.messages,
            req.tools,
            req.tool_choice,
            req.chat_template_kwargs,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens,
        )
    )


async def chat_completions(co: Coordinator, request: web.Request) -> web.StreamResponse:
    arrival_s = time.monotonic()
    return await answer_chat(co, request, await co.read_json(request), arrival_s)


async def answer_chat(co: Coordinator, request: web.Request, body: Any, arrival_s: float) -> web.StreamResponse:
    """A chat completion for a body already read (POST /v1/chat/completions, and /invocations)."""
    req = parse_chat_request(co.with_sampling_defaults(body))
    co.check_model(req.model)
    rendered = await render(co, req)
    prompt = list(rendered.token_ids)
    max_tokens = co.max_tokens_for(len(prompt), req.sampling.max_tokens, "messages")
    rid = f"chatcmpl-{REQUEST_ID.get()}"
    with co.claim(rid), co.pick_rank(affinity_key(req), prompt) as rank:
        return await _generate(co, request, req, rendered, rank, rid, arrival_s, max_tokens)


async def _generate(
    co: Coordinator,
    request: web.Request,
    req: ChatRequest,
    rendered: RenderedPrompt,
    rank: RankClient,
    rid: str,
    arrival_s: float,
    max_tokens: int,
) -> web.StreamResponse:
    prompt = list(rendered.token_ids)
    subs = [
        SubRequest(
            f"{rid}-{i}",
            i,
            prompt,
            req.sampling.params(max_tokens, req.logprobs, i),
            req.sampling.use_prefix_cache,
        )
        for i in range(req.sampling.n)
    ]
    head = {"id": rid, "created": int(time.time()), "model": co.model_name}
    start = reasoning_start(co, req, rendered)
    if req.sampling.beam is not None:  # vLLM's use_beam_search: the n choices are the n best beams
        beam = req.sampling.beam
        eos = eos_token_id(co, req.sampling.ignore_eos)
        p = BeamParams(beam.width, max_tokens, beam.length_penalty, eos, beam.include_stop_str_in_output, req.logprobs or 0)
        key = affinity_key(req)
        beams = await search(co, rank, key, rid, [prompt], [p], req.sampling.use_prefix_cache, arrival_s)
        if req.sampling.stream:  # the finished beams, one chunk each (vLLM's)
            return await _stream(co, request, req, beams, head, len(prompt), start)
        return await _whole(co, req, beams, head, prompt, start)
    async with Generation(rank, co.metrics, arrival_s, co.pd, affinity_key(req)) as gen:
        await gen.submit(subs)
        if req.sampling.stream:
            return await _stream(co, request, req, gen, head, len(prompt), start)
        return await _whole(co, req, gen, head, prompt, start)


async def _whole(
    co: Coordinator,
    req: ChatRequest,
    gen: ChoiceSource,
    head: dict[str, Any],
    prompt: list[int],
    start: Start | None,
) -> web.Response:
    n = req.sampling.n
    prompt_lps: list[Any] | None = None
    texts = [""] * n
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    num_out = [0] * n
    num_cached = 0
    async for u in gen.updates():
        texts[u.choice] += u.text
        lps[u.choice] += u.logprobs
        if u.prompt_logprobs is not None and prompt_lps is None:  # every choice's are the prompt's
            prompt_lps = prompt_logprobs_json(co, prompt, u.prompt_logprobs)
        if u.finish_reason is not None:
            finish[u.choice], num_out[u.choice] = u.finish_reason, u.num_output_tokens
            num_cached = max(num_cached, u.num_cached_tokens)
    choices = []
    for i in range(n):
        reasoning, answer = split_reasoning(start, texts[i]) if start is not None else (None, texts[i])
        message: dict[str, Any] = {
            "role": "assistant",
            "content": answer if reasoning is None else answer or None,  # vLLM's: null after reasoning
        }
        if co.cfg.reasoning_parser is not None:
            message["reasoning_content"] = reasoning if req.include_reasoning else None
        reason = finish[i]
        if is_forced(req.tool_choice):
            message, reason = _forced_message(req, message, answer, reason)
        elif req.uses_tools:  # tool calls are in the answer, never in the reasoning
            parsed = parse_tool_output(co, req, answer)
            if parsed.tool_calls:
                message = {
                    **message,
                    "content": parsed.content,
                    "tool_calls": [c.to_openai() for c in parsed.tool_calls],
                }
                reason = "tool_calls" if reason == "stop" else reason
        if req.echoed:  # vLLM's echo: the last message's content, then the answer's
            message = {**message, "content": req.echoed + (message["content"] or "")}
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(co, lps[i]) if req.logprobs is not None else None,
                "finish_reason": reason,
            }
        )
    body = {
        **head,
        "object": "chat.completion",
        "choices": choices,
        "usage": usage(len(prompt), sum(num_out), num_cached),
        "system_fingerprint": None,
        "prompt_logprobs": prompt_lps,  # vLLM's (null unless asked for)
    }
    return json_response(body)


def _forced_message(
    req: ChatRequest, message: dict[str, Any], text: str, reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A forced call's message (vLLM's): the constrained text read back as calls, content "";
    "required" finishes with "tool_calls" where it stopped, a named function with what it finished with."""
    name = forced_name(req.tool_choice)
    if name is not None:
        return {**message, "content": "", "tool_calls": [named_call(name, text).to_openai()]}, reason
    calls = required_calls(text)
    if not calls:  # cut short before its first call closed (max_tokens): the text, as it came
        return message, reason
    calls_message = {**message, "content": "", "tool_calls": [c.to_openai() for c in calls]}
    return calls_message, "tool_calls" if reason == "stop" else reason


async def _stream(
    co: Coordinator,
    request: web.Request,
    req: ChatRequest,
    gen: ChoiceSource,
    head: dict[str, Any],
    num_prompt: int,
    start: Start | None,
) -> web.StreamResponse:
    n = req.sampling.n
    head = {**head, "object": "chat.completion.chunk"}
    filters = None
    if req.uses_tools and not is_forced(req.tool_choice):
        parse = lambda full: parse_tool_output(co, req, full)  # noqa: E731
        filters = [ToolStreamFilter(co.renderer.tool_parser, parse) for _ in range(n)]
    forced = [_ForcedStream(req.tool_choice) for _ in range(n)] if is_forced(req.tool_choice) else None
    splitters = [ReasoningSplitter(start) for _ in range(n)] if start is not None else None
    is_started = [False] * n
    num_out = [0] * n
    num_cached = 0

    def choice(u: ChoiceUpdate) -> dict[str, Any] | None:
        nonlocal num_cached
        i = u.choice
        delta: dict[str, Any] = {}
        echoed = ""
        if not is_started[i]:
            delta["role"] = "assistant"
            is_started[i] = True
            echoed = req.echoed  # vLLM's echo: before the answer, never parsed as part of it
        reason = u.finish_reason
        reasoning, answer = splitters[i].feed(u.text) if splitters else ("", u.text)
        if reason is not None and splitters:
            more_reasoning, more_answer = splitters[i].finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        text = filters[i].feed(answer) if filters else answer
        if forced:  # the answer is the call: tool_calls deltas, no content
            call_deltas = forced[i].feed(answer)
            if call_deltas:
                delta["tool_calls"] = call_deltas
            text = ""
            reason = forced[i].finish_reason(reason)
        if reasoning and req.include_reasoning:
            delta["reasoning_content"] = reasoning
        if reason is not None:
            num_out[i] = u.num_output_tokens
            num_cached = max(num_cached, u.num_cached_tokens)
            if filters:
                rest, calls = filters[i].finish()
                text += rest
                if calls:
                    delta["tool_calls"] = [c.to_openai(index=k) for k, c in enumerate(calls)]
                    reason = "tool_calls" if reason == "stop" else reason
        if text or "role" in delta:
            delta["content"] = echoed + text
        logprobs = chat_logprobs(co, u.logprobs) if req.logprobs is not None and u.logprobs else None
        if not delta and reason is None and logprobs is None:
            return None
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def final_usage() -> dict[str, Any]:
        return usage(num_prompt, sum(num_out), num_cached)

    def choice_usage(u: ChoiceUpdate) -> dict[str, Any]:
        """vLLM's continuous usage: the prompt and the choice's tokens so far."""
        return usage(num_prompt, u.num_output_tokens, u.num_cached_tokens)

    return await stream_choices(request, gen, head, choice, final_usage, choice_usage, req.sampling)


class _ForcedStream:
    """One choice's forced call as tool_calls deltas (vLLM's): a named function's arguments as they are
    generated (the first delta has the call's id, type and name); a "required" call whole, once its array
    element closes."""

    def __init__(self, tool_choice: Any) -> None:
        self.name = forced_name(tool_choice)
        self.required = RequiredCalls() if self.name is None else None
        self.call_id = new_call_id()
        self.num_calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.required is not None:
            out = [c.to_openai(index=self.num_calls + k) for k, c in enumerate(self.required.feed(text))]
            self.num_calls += len(out)
            return out
        if not text:
            return []
        if self.num_calls:
            return [{"index": 0, "function": {"arguments": text}}]
        self.num_calls = 1
        return [{"index": 0, "id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": text}}]

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.required is not None and self.num_calls else reason
