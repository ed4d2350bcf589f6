"""The engine requests behind one HTTP request, on one rank: submitted together, their outputs merged
into one stream of per-choice updates, and whatever is unfinished aborted when the HTTP request ends
(finished, failed, or its client gone), so the engine frees its memory.

    async with Generation(rank, metrics, arrival_s) as gen:
        await gen.submit(subrequests)
        async for update in gen.updates(): ...

With `pd` (a CE coordinator), each engine request runs as a task of pd/disagg/decode_path.py (reserve on
the CE rank, prefill on the PE, then the CE's decode): the task puts the same events on the queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from engine.request import PromptLogprobs, RequestOutput, SamplingParams, TokenLogprob
from pd.disagg.decode_path import DecodePath, PhaseError
from pd.errors import ApiError, bad_request, internal, rejected
from pd.frontend.metrics import ServerMetrics
from pd.messages import RequestRejected
from pd.rank.client import RankClient, RankDown, RankEvent


@dataclass(frozen=True)
class SubRequest:
    request_id: str
    choice: int  # index of the choice it produces
    prompt_token_ids: list[int]
    params: SamplingParams
    use_prefix_cache: bool = True


@dataclass
class ChoiceUpdate:
    """New output of one choice. finish_reason is set on its last update."""

    choice: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    prompt_logprobs: PromptLogprobs | None = None  # asked for: on the choice's first update


class ChoiceSource(Protocol):
    """Where an answer's choice updates come from: a Generation, or finished beams (beam_search.py)."""

    def updates(self) -> AsyncIterator[ChoiceUpdate]: ...


def engine_down_error(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="engine_down")


@dataclass
class _Timing:
    last_s: float
    first_token_s: float | None = None
    num_tokens: int = 0


@dataclass
class Generation:
    rank: RankClient
    metrics: ServerMetrics
    arrival_s: float
    pd: DecodePath | None = None
    key: str | None = None  # the conversation's (a CE picks its PE by it)
    queue: asyncio.Queue[tuple[str, RankEvent | PhaseError]] = field(default_factory=asyncio.Queue)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _subs: dict[str, SubRequest] = field(default_factory=dict)
    _open: set[str] = field(default_factory=set)
    _timing: dict[str, _Timing] = field(default_factory=dict)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        for t in self._tasks:
            t.cancel()  # a pending /prefill is cancelled: the PE aborts its side
        if self._open:
            open_ids, self._open = list(self._open), set()
            await asyncio.shield(self.rank.abort(open_ids))

    async def submit(self, subs: list[SubRequest]) -> None:
        for s in subs:
            self._subs[s.request_id] = s
            self._open.add(s.request_id)
            self._timing[s.request_id] = _Timing(self.arrival_s)
            if self.pd is not None:
                run = self.pd.run(self.rank, s, self.queue, self.arrival_s, self.key)  # type: ignore[arg-type]
                self._tasks.append(asyncio.create_task(run))
            else:
                queue: Any = self.queue  # RankEvents only: PhaseError comes from self.pd alone
                await self.rank.submit(s.request_id, s.prompt_token_ids, s.params, queue, s.use_prefix_cache)

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Yields updates until every choice is finished; raises ApiError on rejection or rank death."""
        while self._open:
            rid, event = await self.queue.get()
            if isinstance(event, PhaseError):
                self._open.discard(rid)
                raise event.error
            if isinstance(event, RankDown):
                self._open.clear()
                raise engine_down_error(event.message)
            if isinstance(event, RequestRejected):
                self._open.discard(rid)
                raise rejected(event)
            if not isinstance(event, RequestOutput):
                continue
            if event.is_finished:
                self._open.discard(rid)
                if event.finish_reason == "error" and event.is_request_fault:
                    raise bad_request(event.error or "the request cannot be served")
                if event.finish_reason in ("abort", "error"):
                    raise internal(event.error or f"the engine ended the request ({event.finish_reason})")
            self._observe(rid, event)
            yield ChoiceUpdate(
                self._subs[rid].choice,
                event.text_delta,
                list(event.new_token_ids),
                list(event.logprobs),
                event.finish_reason if event.is_finished else None,
                event.num_prompt_tokens,
                event.num_cached_tokens,
                event.num_output_tokens,
                event.prompt_logprobs,
            )

    def _observe(self, rid: str, o: RequestOutput) -> None:
        m, t = self.metrics, self._timing[rid]
        labels = (m.model_name, str(self.rank.index))  # pdserve's (model_name, rank), vLLM's (model_name, engine)
        v = m.vllm
        now = time.monotonic()
        n = len(o.new_token_ids)
        if n:
            if t.first_token_s is None:
                t.first_token_s = now
                m.ttft_s.labels(*labels).observe(now - self.arrival_s)
                v.ttft_s.labels(*labels).observe(now - self.arrival_s)
                queue_s = getattr(o, "queue_time_s", None)
                if queue_s is not None:
                    m.queue_s.labels(*labels).observe(queue_s)
                    v.queue_s.labels(*labels).observe(queue_s)
                if n > 1:
                    m.itl_s.labels(*labels).observe(0.0)
                    v.observe_token_gap(labels, 0.0)
            else:
                for _ in range(n):
                    m.itl_s.labels(*labels).observe((now - t.last_s) / n)
                    v.observe_token_gap(labels, (now - t.last_s) / n)
            t.last_s = now
            t.num_tokens += n
        if o.is_finished:
            m.e2e_s.labels(*labels).observe(now - self.arrival_s)
            m.prompt_tokens.labels(*labels).inc(o.num_prompt_tokens)
            m.cached_tokens.labels(*labels).inc(o.num_cached_tokens)
            m.generation_tokens.labels(*labels).inc(o.num_output_tokens)
            m.requests.labels(*labels, o.finish_reason or "unknown").inc()
            v.e2e_s.labels(*labels).observe(now - self.arrival_s)
            v.prompt_tokens.labels(*labels).inc(o.num_prompt_tokens)
            v.generation_tokens.labels(*labels).inc(o.num_output_tokens)
            v.observe_finished(labels, o.num_prompt_tokens, o.num_output_tokens)
            v.request_success.labels(*labels, o.finish_reason or "unknown").inc()
