"""One run: conversations replayed against a streamed chat endpoint under a load (concurrency, Poisson
arrivals or both), with a record of every turn of the trace."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .server_metrics import scrape, speculation, ttft_phases_ms
from .trace import Conversation, Turn


@dataclass(frozen=True)
class LoadConfig:
    url: str  # the chat completions URL; several, comma-separated: a conversation's turns take them in turn
    model: str
    concurrency: int | None = None  # concurrent conversations; None: no cap (rate only)
    request_rate: float | None = None  # new conversations per second (Poisson); None: all at once
    max_requests: int | None = None
    duration_s: float = 600.0
    grace_s: float = 30.0
    timeout_s: float = 600.0
    temperature: float = 0.0
    logprobs: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    label: str = "run"
    salt: str = ""  # put in front of each first user message: repeated runs miss each other's cache
    progress_s: float = 0.0  # a progress line on stderr this often while the run goes; 0: none

    @classmethod
    def from_args(
        cls,
        args: argparse.Namespace,
        url: str,
        model: str,
        concurrency: int | None,
        request_rate: float | None,
        extra_body: dict[str, Any],
        label: str,
        salt: str,
    ) -> LoadConfig:
        """One load point with the run-wide settings of replay.py's (or compare.py's) command line."""
        return cls(
            url,
            model,
            concurrency,
            request_rate,
            args.max_requests,
            args.duration_s,
            args.grace_s,
            args.timeout_s,
            args.temperature,
            args.logprobs,
            extra_body,
            args.seed,
            label,
            salt,
        )

    def __post_init__(self) -> None:
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("give a concurrency, a request rate, or both")
        if (self.concurrency is not None and self.concurrency < 1) or (self.request_rate or 1) <= 0:
            raise ValueError(f"bad load: {self.concurrency=} {self.request_rate=}")


@dataclass
class RequestRecord:
    conversation: str
    turn: int
    kind: str
    max_tokens: int
    status: str = "skipped"  # ok | error | cancelled | skipped
    error: str | None = None
    http_status: int | None = None
    start_s: float | None = None  # since the run's start
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between token-carrying chunks
    num_chunks: int = 0  # chunks that carried tokens
    stream_tokens: int | None = None  # tokens counted in the stream (with --logprobs)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


@dataclass
class RunResult:
    config: LoadConfig
    started_unix_s: float
    requests: list[RequestRecord]
    # the host's 1-minute load average at the start and the end: other work on the machine shows here
    host_loadavg_1m: tuple[float, float] | None = None
    # a P/D endpoint's TTFT split over the run (its /metrics' pdserve_ttft_phase_seconds, the run's
    # requests only): mean milliseconds per phase; None where the endpoint exports none (a single engine)
    ttft_phases_ms: dict[str, float] | None = None
    # a speculating endpoint's drafts over the run (server_metrics.speculation: counts, mean accepted length,
    # acceptance rate); None where the endpoint does not speculate
    speculation: dict[str, Any] | None = None


class _Budget:
    """The count and time bounds shared by every conversation of a run."""

    def __init__(self, max_requests: int | None, duration_s: float) -> None:
        self.num_left = max_requests if max_requests is not None else math.inf
        self.deadline = time.perf_counter() + duration_s

    def take(self) -> bool:
        if self.num_left <= 0 or time.perf_counter() >= self.deadline:
            return False
        self.num_left -= 1
        return True


def url_for(cfg: LoadConfig, rec: RequestRecord) -> str:
    """The endpoint of a request: with several (the CEs of one cluster), a conversation starts at one
    chosen by its name and each turn moves to the next, so consecutive turns land on different ones."""
    urls = cfg.url.split(",")
    if len(urls) == 1:
        return urls[0]
    start = int.from_bytes(hashlib.blake2b(rec.conversation.encode(), digest_size=4).digest(), "little")
    return urls[(start + rec.turn) % len(urls)]


async def _stream_one(
    session: Any, cfg: LoadConfig, messages: list[dict[str, Any]], rec: RequestRecord, t0: float
) -> str:
    """Sends one streamed chat request, fills `rec`; returns the answer's text."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "messages": messages,
        "max_tokens": rec.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.logprobs:
        body["logprobs"] = True
    body |= cfg.extra_body
    return await stream_request(session, url_for(cfg, rec), body, rec, t0, cfg.timeout_s, counts_logprobs=cfg.logprobs)


async def stream_request(
    session: Any,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    t0: float,
    timeout_s: float,
    headers: dict[str, str] | None = None,
    counts_logprobs: bool = False,
) -> str:
    """POSTs one streamed request (body has "stream": true) to a chat or text completions URL, fills `rec`
    (status, HTTP status, send time since t0, TTFT, gaps between token-carrying chunks, usage); returns the
    answer's text. counts_logprobs: the body asks for logprobs, whose entries count the streamed tokens."""
    import aiohttp

    text: list[str] = []
    start = time.perf_counter()
    rec.start_s = start - t0
    last: float | None = None
    num_tokens = 0
    async with session.post(
        url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as resp:
        rec.http_status = resp.status
        if resp.status != 200:
            rec.status, rec.error = "error", f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return ""
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            ev = json.loads(data)
            if "error" in ev:
                rec.status, rec.error = "error", f"in-stream: {json.dumps(ev['error'])[:300]}"
                return ""
            if ev.get("usage"):
                u = ev["usage"]
                rec.prompt_tokens, rec.completion_tokens = u.get("prompt_tokens"), u.get("completion_tokens")
                rec.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for ch in ev.get("choices") or []:
                delta = ch.get("delta") or {}
                piece = delta.get("content") if "delta" in ch else ch.get("text")  # chat | text completions
                logprobs = ch.get("logprobs") or {}
                lps = logprobs.get("content") or logprobs.get("tokens") or []  # chat | text completions
                num_tokens += len(lps)
                if piece or delta.get("tool_calls") or lps:
                    text.append(piece or "")
                    if last is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    rec.num_chunks += 1
                elif ch.get("finish_reason") and rec.ttft_s is None:
                    rec.ttft_s = now - start  # an answer without text (EOS first): TTFT is its end
                rec.finish_reason = ch.get("finish_reason") or rec.finish_reason
    rec.e2e_s = time.perf_counter() - start
    if counts_logprobs:
        rec.stream_tokens = num_tokens
    if rec.completion_tokens is None:
        rec.status, rec.error = "error", "no usage in the stream"
    else:
        rec.status = "ok"
    return "".join(text)


async def _conversation(
    session: Any, cfg: LoadConfig, conv: Conversation, recs: list[RequestRecord], budget: _Budget, t0: float
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": conv.system}] if conv.system else []
    for k, (turn, rec) in enumerate(zip(conv.turns, recs)):
        if k and turn.delay_s:
            if time.perf_counter() + turn.delay_s >= budget.deadline:
                return
            await asyncio.sleep(turn.delay_s)
        if not budget.take():
            return
        content = (cfg.salt + turn.content) if k == 0 and cfg.salt else turn.content
        messages.append({"role": "user", "content": content})
        try:
            answer = await _stream_one(session, cfg, messages, rec, t0)
        except asyncio.CancelledError:
            rec.status, rec.error = "cancelled", "cut at the end of the run"
            raise
        except Exception as e:  # noqa: BLE001 - any failure of one request is that request's error
            rec.status, rec.error = "error", f"{type(e).__name__}: {e}"[:300]
        if rec.status != "ok":
            return
        messages.append({"role": "assistant", "content": answer})


async def run_load(cfg: LoadConfig, convs: Sequence[Conversation]) -> RunResult:
    """Replays `convs` under `cfg`; one record for every turn of the trace."""
    import aiohttp

    recs = [[RequestRecord(c.id, k, t.kind, t.max_tokens) for k, t in enumerate(c.turns)] for c in convs]
    budget = _Budget(cfg.max_requests, cfg.duration_s)
    load_before = os.getloadavg()[0]
    before = await asyncio.to_thread(scrape, cfg.url)
    started = time.time()
    t0 = time.perf_counter()
    gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    rng = random.Random(cfg.seed)

    async def one(i: int) -> None:
        if gate is None:
            await _conversation(session, cfg, convs[i], recs[i], budget, t0)
            return
        async with gate:
            await _conversation(session, cfg, convs[i], recs[i], budget, t0)

    connector = aiohttp.TCPConnector(limit=0)
    progress = asyncio.create_task(_progress(cfg, recs, t0)) if cfg.progress_s > 0 else None
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = []
        for i in range(len(convs)):
            if cfg.request_rate is not None and i:
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            if time.perf_counter() >= budget.deadline or budget.num_left <= 0:
                break
            tasks.append(asyncio.create_task(one(i)))
        left_s = budget.deadline + cfg.grace_s - time.perf_counter()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(left_s, 0.0))
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    if progress is not None:
        progress.cancel()
        print(progress_line(cfg.label, recs, time.perf_counter() - t0), file=sys.stderr, flush=True)
    after = await asyncio.to_thread(scrape, cfg.url)
    return RunResult(
        cfg,
        started,
        [r for rs in recs for r in rs],
        (load_before, os.getloadavg()[0]),
        ttft_phases_ms(before.phases, after.phases),
        speculation(before.speculation, after.speculation),
    )


def progress_line(label: str, recs: Sequence[Sequence[RequestRecord]], elapsed_s: float) -> str:
    """One line of a run's progress: its requests by state, output tokens and their rate so far."""
    flat = [r for rs in recs for r in rs]
    num = {s: sum(r.status == s for r in flat) for s in ("ok", "error", "cancelled")}
    num_inflight = sum(r.start_s is not None and r.status == "skipped" for r in flat)
    tokens = sum(r.completion_tokens or 0 for r in flat)
    return (
        f"[{label}] {elapsed_s:.0f} s: {num['ok']} ok, {num['error']} errors, {num_inflight} in flight, "
        f"{len(flat) - num['ok'] - num['error'] - num['cancelled'] - num_inflight} turns to go; "
        f"{tokens} output tokens ({tokens / max(elapsed_s, 1e-9):.0f}/s)"
    )


async def _progress(cfg: LoadConfig, recs: Sequence[Sequence[RequestRecord]], t0: float) -> None:
    """Prints progress_line every cfg.progress_s until cancelled."""
    while True:
        await asyncio.sleep(cfg.progress_s)
        print(progress_line(cfg.label, recs, time.perf_counter() - t0), file=sys.stderr, flush=True)


async def warm_up(url: str, model: str, num: int, extra: dict[str, Any]) -> None:
    """Short requests before the timed run (a cold server compiles, allocates, fills caches)."""
    if num <= 0:
        return
    cfg = LoadConfig(url, model, concurrency=1, extra_body=extra)
    conv = Conversation("warmup", (Turn("Say hello.", 4),))
    run = await run_load(replace(cfg, max_requests=num), [conv] * num)
    bad = [r.error for r in run.requests if r.status != "ok"]
    if bad:
        raise SystemExit(f"warm-up failed: {bad[0]}")
