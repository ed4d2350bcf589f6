#!/usr/bin/env python3
"""Multi-turn load generator for any OpenAI-compatible chat endpoint, streamed.

Replays conversations: turn N+1 sends the whole history (system prompt, every earlier message and the
server's own answers) plus one new message, after a think time, so contexts grow turn by turn the way
an agent's do. Load is a number of concurrent conversations (`--concurrency`), or new conversations
arriving as a Poisson process (`--request-rate`, per second, as aiperf's --request-rate in multi-turn
mode), or both (the rate, capped at the concurrency). A comma list of either is a sweep. Runs are
bounded by `--max-requests` and `--duration-s`.

    python bench/load.py --url http://127.0.0.1:8888 --trace synthetic --conversations 64 --turns 8 \\
        --concurrency 8 --slo-ttft-ms 2000 --slo-itl-ms 100 --out bench/results/load
    python bench/load.py --trace synthetic --conversations 64 --turns 8 \\
        --write-trace conv.jsonl --trace-format multi_turn        # for aiperf; no --url: nothing is sent

Synthetic traces (`--trace synthetic`, seeded by `--seed`), per conversation; sizes are in tokens by
estimate (HEAD_TOKENS below), the server's usage has the real counts:
  system prompt  one prompt of --system-tokens shared by every conversation (an agent's instructions)
  turn 0         the user's task: lognormal, mean --user-tokens, sigma --length-sigma (of the log)
  turn k >= 1    with probability --tool-fraction a tool result (grep-like lines): lognormal, mean
                 --tool-tokens; else a user message like turn 0. Think time before it: exponential, mean
                 --tool-latency-s after a tool call, --think-s before a user message
  max_tokens     lognormal, mean --output-tokens, sigma --output-sigma, clipped to [1, 4 x mean]
  context cap    a conversation ends before a turn whose estimated prompt + max_tokens would pass
                 --max-context-tokens (earlier answers counted at their max_tokens)
A trace file (`--trace F`) is JSONL in this tool's format (`--trace-format pdserve`, below), aiperf's
`multi_turn` or aiperf's `mooncake_trace` (text_input entries grouped by session_id); the format of each
line is recognised.

Per request it records TTFT, every inter-token gap, end-to-end time, and prompt / cached / completion
tokens from the server's usage (`stream_options.include_usage`); every turn of the trace is accounted
for as ok, error, cancelled (cut at the end of --duration-s + --grace-s) or skipped (not sent: a bound
was reached or an earlier turn of its conversation failed).

ITL is the gap between chunks that carry tokens (pdserve sends one token a chunk unless text is held
back; `--logprobs` counts tokens exactly). Goodput: requests per second that are ok and meet both SLOs,
TTFT <= --slo-ttft-ms and mean inter-token gap (TPOT) <= --slo-itl-ms; a missing SLO is not applied.
Prefix-cache hit rate: cached / prompt tokens, from usage.

Long prefills: a request whose uncached prompt (prompt - cached tokens, from usage) has at least
--long-prompt-tokens is prefilled from its send to its first token; every inter-token gap of the run is
put in one of two sets, gaps that overlap some long prefill and gaps that overlap none, and the summary
has the percentiles of each (`itl_in_long_prefill_ms`, `itl_outside_long_prefill_ms`). A server whose
decode steps stall behind prefills shows it in the first set.

Outputs in --out: results.json (schema `pdserve-load/1`, see `results_doc`), summary.txt (the table
printed), distributions.png (TTFT and ITL CDFs), throughput.png (output tokens/s over time) and, for a
sweep, sweep.png (latency against load).
"""

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

SCHEMA = "pdserve-load/1"
# Synthetic text is sized in tokens by estimate: a word of _WORDS is one token, a tool line's
# `path:line:` head and newline HEAD_TOKENS (SmolLM2's tokenizer: 1.01 tokens a word; tool results within 5%).
HEAD_TOKENS = 12
TURN_TOKENS = 8  # the chat template's markers around one message
LONG_PROMPT_TOKENS = 512  # default --long-prompt-tokens: an uncached prompt this long is a long prefill

_WORDS = (
    "the of and to in is that for it as with was on be by at this from are or an which have not but "
    "all can one has more their were will about if when there other into some time what only new out "
    "also two first any these may such after most over used then where could than many well made "
    "between under both each same must file line value error model request server token cache block "
    "memory layer batch queue rank prefill decode stream output input function return call check path "
    "test build config state page table index count size length limit start end next last read write "
    "open close load save send receive update change list item key name type field number string data "
    "result report step run task user agent tool answer question plan note fix issue patch code change"
).split()
_PATHS = (
    "src/app.py",
    "src/server/handler.py",
    "lib/cache.py",
    "tests/test_api.py",
    "README.md",
    "setup.cfg",
)
SYSTEM_HEAD = "You are a coding agent. Follow the instructions, call tools when needed, answer briefly."


# ---- traces ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    content: str
    max_tokens: int
    delay_s: float = 0.0  # think time before this turn is sent (after the previous answer)
    kind: str = "user"  # "user" | "tool": what the new message stands for (it is sent as a user message)

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.delay_s < 0 or self.kind not in ("user", "tool"):
            raise ValueError(f"bad turn: {self.max_tokens=} {self.delay_s=} {self.kind=}")


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]
    system: str | None = None


@dataclass(frozen=True)
class SyntheticSpec:
    num_conversations: int = 64
    num_turns: int = 8
    seed: int = 0
    system_tokens: int = 400
    user_tokens: float = 60.0
    tool_tokens: float = 800.0
    tool_fraction: float = 0.3
    length_sigma: float = 0.6
    output_tokens: float = 150.0
    output_sigma: float = 0.5
    think_s: float = 2.0
    tool_latency_s: float = 0.5
    max_context_tokens: int = 32768

    def __post_init__(self) -> None:
        if self.num_conversations < 1 or self.num_turns < 1 or not 0 <= self.tool_fraction <= 1:
            raise ValueError(f"bad synthetic spec: {self}")


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal draw with the given mean (not median)."""
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma) if sigma > 0 else mean


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def _tool_result(rng: random.Random, n: int) -> str:
    lines, left = [], max(1, n)
    while left > 0:
        k = min(left, rng.randint(6, 16))
        lines.append(f"{rng.choice(_PATHS)}:{rng.randint(1, 900)}: {_words(rng, k)}")
        left -= k + HEAD_TOKENS
    return "Tool output:\n" + "\n".join(lines)


def synthetic_trace(spec: SyntheticSpec) -> list[Conversation]:
    """Seeded conversations with the distributions stated in the module docstring; conversation c is the
    same whatever the number of conversations, and a context cap only cuts it short."""
    system = SYSTEM_HEAD + " " + _words(random.Random(f"{spec.seed}-system"), spec.system_tokens)
    convs = []
    for c in range(spec.num_conversations):
        # one stream a conversation: its turns never depend on the other conversations
        rng = random.Random(f"{spec.seed}-{c}")
        context_tokens = spec.system_tokens + len(SYSTEM_HEAD.split()) + TURN_TOKENS  # estimated
        turns: list[Turn] = []
        for k in range(spec.num_turns):
            is_tool = k > 0 and rng.random() < spec.tool_fraction
            mean_tokens = spec.tool_tokens if is_tool else spec.user_tokens
            num_tokens = max(1, round(_lognormal(rng, mean_tokens, spec.length_sigma)))
            if is_tool:
                content = _tool_result(rng, num_tokens)
            else:
                content = (f"Task {c}: " if k == 0 else "") + _words(rng, num_tokens)
            mean_out = spec.output_tokens
            max_tokens = min(max(1, round(_lognormal(rng, mean_out, spec.output_sigma))), round(4 * mean_out))
            delay_s = (
                0.0 if k == 0 else rng.expovariate(1 / (spec.tool_latency_s if is_tool else spec.think_s))
            )
            context_tokens += num_tokens + TURN_TOKENS
            if context_tokens + max_tokens > spec.max_context_tokens:
                break
            turns.append(Turn(content, max_tokens, round(delay_s, 3), "tool" if is_tool else "user"))
            context_tokens += max_tokens + TURN_TOKENS  # the answer, at most
        if turns:
            convs.append(Conversation(f"conv-{c:04d}", tuple(turns), system))
    return convs


def trace_to_lines(convs: Sequence[Conversation], fmt: str) -> list[dict[str, Any]]:
    """JSONL records: `pdserve` (this tool's), aiperf `multi_turn` or aiperf `mooncake_trace`."""
    out: list[dict[str, Any]] = []
    for conv in convs:
        if fmt == "pdserve":
            out.append({"id": conv.id, "system": conv.system, "turns": [asdict(t) for t in conv.turns]})
        elif fmt == "multi_turn":
            turns: list[dict[str, Any]] = [{"role": "system", "text": conv.system}] if conv.system else []
            for k, t in enumerate(conv.turns):
                turns.append(
                    {"text": t.content, "output_length": t.max_tokens}
                    | ({"delay": round(t.delay_s * 1000, 3)} if k else {})
                )
            out.append({"session_id": conv.id, "turns": turns})
        elif fmt == "mooncake_trace":
            # text_input turns of one session_id: aiperf threads the answers into the history, but the
            # format has no system prompt, so it goes in front of the first user message.
            for k, t in enumerate(conv.turns):
                text = f"{conv.system}\n\n{t.content}" if k == 0 and conv.system else t.content
                out.append(
                    {"session_id": conv.id, "text_input": text, "output_length": t.max_tokens}
                    | ({"delay": round(t.delay_s * 1000, 3)} if k else {})
                )
        else:
            raise ValueError(f"unknown trace format {fmt!r}")
    return out


def write_trace(path: Path, convs: Sequence[Conversation], fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in trace_to_lines(convs, fmt):
            f.write(json.dumps(rec) + "\n")


def _turn_from_aiperf(t: dict[str, Any], default_max_tokens: int) -> Turn:
    text = t.get("text") if t.get("text") is not None else t.get("text_input")
    if text is None:
        texts = t.get("texts") or []
        text = "\n".join(x if isinstance(x, str) else "\n".join(x.get("contents", [])) for x in texts)
    kind = "tool" if str(text).startswith("Tool output:") else "user"
    max_tokens = int(t.get("output_length") or t.get("max_tokens") or default_max_tokens)
    return Turn(str(text), max_tokens, float(t.get("delay") or 0) / 1000, kind)


def read_trace(path: Path, default_max_tokens: int = 128) -> list[Conversation]:
    """Conversations of a JSONL trace in any format `trace_to_lines` writes (recognised line by line)."""
    convs: dict[str, Conversation] = {}
    for num, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "turns" in rec and "session_id" not in rec:  # pdserve
            cid = str(rec.get("id", f"conv-{num:04d}"))
            convs[cid] = Conversation(cid, tuple(Turn(**t) for t in rec["turns"]), rec.get("system"))
        elif "turns" in rec:  # aiperf multi_turn; a leading system turn is the system prompt
            cid, turns, system = str(rec["session_id"]), list(rec["turns"]), None
            if turns and turns[0].get("role") == "system":
                system = turns.pop(0).get("text")
            new = tuple(_turn_from_aiperf(t, default_max_tokens) for t in turns)
            old = convs.get(cid)
            convs[cid] = Conversation(
                cid, (old.turns if old else ()) + new, system or (old.system if old else None)
            )
        elif "text_input" in rec:  # aiperf mooncake_trace, one turn a line
            cid = str(rec.get("session_id", f"line-{num}"))
            old = convs.get(cid)
            turn = _turn_from_aiperf(rec, default_max_tokens)
            convs[cid] = Conversation(cid, (old.turns if old else ()) + (turn,), None)
        else:
            raise ValueError(f"{path}:{num + 1}: not a pdserve, multi_turn or text_input mooncake record")
    return list(convs.values())


def trace_digest(convs: Sequence[Conversation]) -> str:
    return hashlib.sha256(json.dumps(trace_to_lines(convs, "pdserve")).encode()).hexdigest()[:16]


# ---- one run --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    url: str  # the chat completions URL
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
        """One load point with the run-wide settings of load.py's (or compare.py's) command line."""
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


async def _stream_one(
    session: Any, cfg: LoadConfig, messages: list[dict[str, Any]], rec: RequestRecord, t0: float
) -> str:
    """Sends one streamed request, fills `rec`; returns the answer's text."""
    import aiohttp

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
    text: list[str] = []
    start = time.perf_counter()
    rec.start_s = start - t0
    last: float | None = None
    num_tokens = 0
    async with session.post(cfg.url, json=body, timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as resp:
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
                lps = (ch.get("logprobs") or {}).get("content") or []
                num_tokens += len(lps)
                if delta.get("content") or delta.get("tool_calls") or lps:
                    text.append(delta.get("content") or "")
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
    if cfg.logprobs:
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
    return RunResult(cfg, started, [r for rs in recs for r in rs], (load_before, os.getloadavg()[0]))


# ---- summary --------------------------------------------------------------------------------------


def _pcts(xs: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    import numpy as np

    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    a = np.asarray(xs, dtype=float) * scale
    p50, p90, p99 = (float(v) for v in np.percentile(a, [50, 90, 99]))
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float(a.mean()), "max": float(a.max())}


def tpot_s(r: RequestRecord) -> float | None:
    """Mean gap between token-carrying chunks of one request (None with fewer than two chunks)."""
    return sum(r.itl_s) / len(r.itl_s) if r.itl_s else None


def long_prefills(reqs: Sequence[RequestRecord], min_new_tokens: int) -> list[tuple[float, float]]:
    """(send, first token) in seconds since the run's start, of each ok request whose uncached prompt
    has at least `min_new_tokens` tokens: the spans in which a long prompt was being prefilled."""
    return sorted(
        (r.start_s, r.start_s + r.ttft_s)
        for r in reqs
        if r.status == "ok"
        and r.start_s is not None
        and r.ttft_s is not None
        and (r.prompt_tokens or 0) - (r.cached_tokens or 0) >= min_new_tokens
    )


def gap_spans(r: RequestRecord) -> list[tuple[float, float]]:
    """(begin, end) of each inter-token gap of a request, in seconds since the run's start."""
    if r.start_s is None or r.ttft_s is None:
        return []
    t, out = r.start_s + r.ttft_s, []
    for g in r.itl_s:
        out.append((t, t + g))
        t += g
    return out


def split_gaps(
    reqs: Sequence[RequestRecord], windows: Sequence[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """Inter-token gaps (s) of the ok requests that overlap one of `windows`, and those that overlap none."""
    inside: list[float] = []
    outside: list[float] = []
    for r in reqs:
        if r.status != "ok":
            continue
        for a, b in gap_spans(r):
            # NOTE: a request's own prefill ends at its first token, before its first gap begins
            (inside if any(a < w1 and b > w0 for w0, w1 in windows) else outside).append(b - a)
    return inside, outside


def is_good(r: RequestRecord, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> bool:
    if r.status != "ok" or r.ttft_s is None:
        return False
    if slo_ttft_ms is not None and r.ttft_s * 1e3 > slo_ttft_ms:
        return False
    t = tpot_s(r)
    return slo_itl_ms is None or t is None or t * 1e3 <= slo_itl_ms


def summarize(
    reqs: Sequence[RequestRecord],
    slo_ttft_ms: float | None = None,
    slo_itl_ms: float | None = None,
    long_prompt_tokens: int = LONG_PROMPT_TOKENS,
) -> dict[str, Any]:
    """The run's numbers: counts, latency percentiles (ms), throughput over the busy span, goodput,
    and the inter-token gaps split by whether a long prefill ran meanwhile."""
    ok = [r for r in reqs if r.status == "ok"]
    sent = [r for r in reqs if r.start_s is not None]
    ends = [r.start_s + r.e2e_s for r in ok if r.start_s is not None and r.e2e_s is not None]
    span_s = (max(ends) - min(r.start_s for r in sent if r.start_s is not None)) if ends else 0.0
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    completion = sum(r.completion_tokens or 0 for r in ok)
    num_good = sum(is_good(r, slo_ttft_ms, slo_itl_ms) for r in ok)
    windows = long_prefills(reqs, long_prompt_tokens)
    gaps_in, gaps_out = split_gaps(reqs, windows)

    def per_s(x: float) -> float | None:
        return x / span_s if span_s > 0 else None

    return {
        "num_planned": len(reqs),
        "num_sent": len(sent),
        "num_ok": len(ok),
        "num_errors": sum(r.status == "error" for r in reqs),
        "num_cancelled": sum(r.status == "cancelled" for r in reqs),
        "num_skipped": sum(r.status == "skipped" for r in reqs),
        "duration_s": span_s,
        "ttft_ms": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _pcts([g for r in ok for g in r.itl_s]),
        "itl_in_long_prefill_ms": _pcts(gaps_in),
        "itl_outside_long_prefill_ms": _pcts(gaps_out),
        "long_prompt_tokens": long_prompt_tokens,
        "num_long_prefills": len(windows),
        "tpot_ms": _pcts([t for r in ok if (t := tpot_s(r)) is not None]),
        "e2e_ms": _pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "output_tokens_per_s": per_s(completion),
        "total_tokens_per_s": per_s(prompt + completion),
        "requests_per_s": per_s(len(ok)),
        "goodput_requests_per_s": per_s(num_good),
        "goodput_fraction": num_good / len(ok) if ok else None,
        "prefix_cache_hit_rate": cached / prompt if prompt else None,
    }


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def _grid(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the others right-aligned."""
    widths = [max(len(r[c]) for r in (head, *body)) for c in range(len(head))]

    def fmt(row: Sequence[str]) -> str:
        return " | ".join(v.ljust(w) if c == 0 else v.rjust(w) for c, (v, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(head), "-+-".join("-" * w for w in widths), *map(fmt, body)])


def format_table(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One line per run: label and its summary."""
    head = (
        "run",
        "ok/sent",
        "err",
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
        "out tok/s",
        "req/s",
        "goodput req/s",
        "cache hit",
    )
    body = []
    for label, s in rows:
        t, i = s["ttft_ms"], s["itl_ms"]
        good = f"{_f(s['goodput_requests_per_s'], '.2f')} ({_f((s['goodput_fraction'] or 0) * 100)}%)"
        body.append(
            (
                label,
                f"{s['num_ok']}/{s['num_sent']}",
                str(s["num_errors"] + s["num_cancelled"]),
                f"{_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])}",
                f"{_f(i['p50'], '.1f')} / {_f(i['p90'], '.1f')} / {_f(i['p99'], '.1f')}",
                _f(s["output_tokens_per_s"], ".1f"),
                _f(s["requests_per_s"], ".2f"),
                good,
                "-" if s["prefix_cache_hit_rate"] is None else f"{s['prefix_cache_hit_rate'] * 100:.1f}%",
            )
        )
    return _grid(head, body)


def format_itl_split(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One line per run: inter-token gaps that overlap a long prefill, and the others."""
    head = (
        "run",
        "long prefills",
        "ITL in long prefill p50/p90/p99/max ms",
        "ITL otherwise p50/p90/p99/max ms",
    )
    body = []
    for label, s in rows:
        cells = []
        for key in ("itl_in_long_prefill_ms", "itl_outside_long_prefill_ms"):
            p = s.get(key) or {}
            cells.append(" / ".join(_f(p.get(q), ".0f") for q in ("p50", "p90", "p99", "max")))
        body.append(
            (label, f"{s.get('num_long_prefills', 0)} (>= {s.get('long_prompt_tokens')} new)", *cells)
        )
    return _grid(head, body)


def run_doc(
    run: RunResult,
    slo_ttft_ms: float | None,
    slo_itl_ms: float | None,
    long_prompt_tokens: int = LONG_PROMPT_TOKENS,
) -> dict[str, Any]:
    cfg = run.config
    return {
        "label": cfg.label,
        "url": cfg.url,
        "model": cfg.model,
        "load": {"concurrency": cfg.concurrency, "request_rate": cfg.request_rate},
        "config": asdict(cfg),
        "started_unix_s": run.started_unix_s,
        "host_loadavg_1m": run.host_loadavg_1m,
        "summary": summarize(run.requests, slo_ttft_ms, slo_itl_ms, long_prompt_tokens),
        "requests": [asdict(r) for r in run.requests],
    }


def results_doc(
    runs: Sequence[RunResult],
    trace: dict[str, Any],
    slo_ttft_ms: float | None,
    slo_itl_ms: float | None,
    argv: Sequence[str],
    long_prompt_tokens: int = LONG_PROMPT_TOKENS,
) -> dict[str, Any]:
    """results.json: {schema, created_unix_s, command, trace, slo, runs: [{label, url, model, load,
    config, started_unix_s, host_loadavg_1m, summary, requests: [RequestRecord fields]}]}. Times in requests are
    seconds (start_s since the run's start); latencies in summaries are milliseconds."""
    return {
        "schema": SCHEMA,
        "created_unix_s": time.time(),
        "command": list(argv),
        "trace": trace,
        "slo": {"ttft_ms": slo_ttft_ms, "itl_ms": slo_itl_ms},
        "runs": [run_doc(r, slo_ttft_ms, slo_itl_ms, long_prompt_tokens) for r in runs],
    }


# ---- plots ----------------------------------------------------------------------------------------


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_axis(ax: Any, which: str) -> None:
    """Log scale, labelled at 1, 2 and 5 of each decade as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _cdf(ax: Any, xs: Sequence[float], label: str) -> None:
    if xs:
        s = sorted(xs)
        ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", label=label)


def token_times(r: dict[str, Any]) -> list[tuple[float, float]]:
    """(arrival since the run's start, tokens) of each token-carrying chunk; the usage's completion
    tokens spread evenly over the chunks, so the chunks add up to the server's count."""
    if r["status"] != "ok" or r["ttft_s"] is None or not r["num_chunks"]:
        return []
    t = r["start_s"] + r["ttft_s"]
    per_chunk = (r["completion_tokens"] or 0) / r["num_chunks"]
    out = [(t, per_chunk)]
    for g in r["itl_s"]:
        t += g
        out.append((t, per_chunk))
    return out


def plot_runs(out_dir: Path, runs: Sequence[dict[str, Any]]) -> list[Path]:
    """distributions.png (TTFT and ITL CDFs) and throughput.png (output tokens/s, 1 s bins), one line a run."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for run in runs:
        ok = [r for r in run["requests"] if r["status"] == "ok"]
        _cdf(a1, [r["ttft_s"] * 1e3 for r in ok if r["ttft_s"] is not None], run["label"])
        _cdf(a2, [g * 1e3 for r in ok for g in r["itl_s"]], run["label"])
    for ax, name in ((a1, "TTFT (ms)"), (a2, "inter-token gap (ms)")):
        _log_axis(ax, "x")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests" if ax is a1 else "fraction of gaps")
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.tight_layout()
    paths = [out_dir / "distributions.png"]
    fig.savefig(paths[0], dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    times = {run["label"]: [tn for r in run["requests"] for tn in token_times(r)] for run in runs}
    end_s = max((t for tns in times.values() for t, _ in tns), default=1.0)
    bin_s = max(1, round(end_s / 60))  # about 60 bins
    for label, tns in times.items():
        bins = [0.0] * (int(end_s // bin_s) + 1)
        for t, n in tns:
            bins[int(t // bin_s)] += n / bin_s
        ax.plot([i * bin_s for i in range(len(bins))], bins, drawstyle="steps-post", label=label)
    ax.set_xlabel("time since the run's start (s)")
    ax.set_ylabel(f"output tokens/s ({bin_s} s bins)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[1], dpi=80)
    plt.close(fig)
    return paths


def load_of(run: dict[str, Any]) -> float:
    load = run["load"]
    return float(load["concurrency"] if load["request_rate"] is None else load["request_rate"])


def plot_sweep(path: Path, series: dict[str, list[dict[str, Any]]]) -> Path:
    """Latency against load: p50 and p90 TTFT and ITL, one line per configuration (series name)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    xlabel = "load"
    for name, runs in series.items():
        runs = sorted(runs, key=load_of)
        xs = [load_of(r) for r in runs]
        xlabel = (
            "request rate (conversations/s)"
            if runs[0]["load"]["request_rate"]
            else "concurrent conversations"
        )
        for ax, key in zip(axes, ("ttft_ms", "itl_ms")):
            (line,) = ax.plot(xs, [r["summary"][key]["p50"] for r in runs], "o-", label=f"{name} p50")
            ax.plot(
                xs,
                [r["summary"][key]["p90"] for r in runs],
                "s--",
                color=line.get_color(),
                label=f"{name} p90",
            )
    loads = sorted({load_of(r) for runs in series.values() for r in runs})
    for ax, title in zip(axes, ("TTFT (ms)", "inter-token gap (ms)")):
        ax.set_xticks(loads, [f"{x:g}" for x in loads])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(title)
        _log_axis(ax, "y")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_outputs(
    out_dir: Path,
    doc: dict[str, Any],
    series: dict[str, list[dict[str, Any]]] | None = None,
    plots: bool = True,
) -> str:
    """results.json, summary.txt and the plots; returns the tables (the summary, then the ITL split)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [(r["label"], r["summary"]) for r in doc["runs"]]
    table = format_table(rows) + "\n\n" + format_itl_split(rows)
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "summary.txt").write_text(table + "\n")
    if plots:
        plot_runs(out_dir, doc["runs"])
        if series and any(len(v) > 1 for v in series.values()):
            plot_sweep(out_dir / "sweep.png", series)
    return table


# ---- command line ---------------------------------------------------------------------------------


def chat_url(url: str) -> str:
    """http://h:p, http://h:p/v1 or the full chat completions URL -> the full URL."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def server_model(url: str) -> str:
    import urllib.request

    base = chat_url(url).removesuffix("/chat/completions")
    with urllib.request.urlopen(base + "/models", timeout=30) as r:
        return str(json.loads(r.read())["data"][0]["id"])


def _floats(s: str | None) -> list[float | None]:
    return [float(x) for x in s.split(",")] if s else [None]


def add_trace_args(ap: argparse.ArgumentParser) -> None:
    d = SyntheticSpec()
    g = ap.add_argument_group("trace")
    g.add_argument(
        "--trace", default="synthetic", help="'synthetic' or a JSONL file (pdserve, multi_turn, mooncake)"
    )
    g.add_argument(
        "--conversations", type=int, default=None, help=f"synthetic: {d.num_conversations}; a file: all of it"
    )
    g.add_argument(
        "--turns", type=int, default=None, help=f"turns per conversation, at most (synthetic: {d.num_turns})"
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--system-tokens", type=int, default=d.system_tokens)
    g.add_argument("--user-tokens", type=float, default=d.user_tokens)
    g.add_argument("--tool-tokens", type=float, default=d.tool_tokens)
    g.add_argument("--tool-fraction", type=float, default=d.tool_fraction)
    g.add_argument("--length-sigma", type=float, default=d.length_sigma)
    g.add_argument("--output-tokens", type=float, default=d.output_tokens, help="mean max_tokens a turn")
    g.add_argument(
        "--output-sigma",
        type=float,
        default=d.output_sigma,
        help="0: every turn asks exactly --output-tokens",
    )
    g.add_argument("--think-s", type=float, default=d.think_s)
    g.add_argument("--tool-latency-s", type=float, default=d.tool_latency_s)
    g.add_argument("--max-context-tokens", type=int, default=d.max_context_tokens)
    g.add_argument("--write-trace", type=Path, default=None, help="also write the trace here")
    g.add_argument("--trace-format", default="pdserve", choices=("pdserve", "multi_turn", "mooncake_trace"))


def add_request_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("load and requests")
    g.add_argument("--model", default=None, help="default: the server's first model")
    g.add_argument("--concurrency", default=None, help="concurrent conversations; a comma list sweeps")
    g.add_argument("--request-rate", default=None, help="new conversations/s (Poisson); a comma list sweeps")
    g.add_argument("--max-requests", type=int, default=None, help="stop sending after this many")
    g.add_argument("--duration-s", type=float, default=600.0, help="stop sending after this long")
    g.add_argument("--grace-s", type=float, default=30.0, help="then cancel what is still running after this")
    g.add_argument("--timeout-s", type=float, default=600.0, help="one request's limit")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--logprobs", action="store_true", help="ask for logprobs to count streamed tokens exactly"
    )
    g.add_argument(
        "--ignore-eos", action="store_true", help='send "ignore_eos": true (pdserve, vLLM, SGLang)'
    )
    g.add_argument("--no-prefix-cache", action="store_true", help='send "prefix_cache": false (pdserve)')
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request")
    g.add_argument("--warmup", type=int, default=1, help="short requests sent first, not recorded")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-itl-ms", type=float, default=None)
    g.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=LONG_PROMPT_TOKENS,
        help="uncached prompt tokens that make a long prefill (ITL is split by overlap with those)",
    )
    g.add_argument("--no-plots", action="store_true")


def trace_from_args(args: argparse.Namespace) -> tuple[list[Conversation], dict[str, Any]]:
    if args.trace == "synthetic":
        spec = SyntheticSpec(
            args.conversations or SyntheticSpec.num_conversations,
            args.turns or SyntheticSpec.num_turns,
            args.seed,
            args.system_tokens,
            args.user_tokens,
            args.tool_tokens,
            args.tool_fraction,
            args.length_sigma,
            args.output_tokens,
            args.output_sigma,
            args.think_s,
            args.tool_latency_s,
            args.max_context_tokens,
        )
        convs = synthetic_trace(spec)
        info: dict[str, Any] = {"source": "synthetic", "spec": asdict(spec)}
    else:
        convs = read_trace(Path(args.trace), round(args.output_tokens))[: args.conversations]
        if args.turns:
            convs = [replace(c, turns=c.turns[: args.turns]) for c in convs]
        info = {"source": str(args.trace), "spec": None}
    info |= {
        "num_conversations": len(convs),
        "num_turns": sum(len(c.turns) for c in convs),
        "sha256_16": trace_digest(convs),
    }
    if args.write_trace:
        write_trace(args.write_trace, convs, args.trace_format)
    return convs, info


def extra_body_from_args(args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = json.loads(args.extra_body) if args.extra_body else {}
    if args.ignore_eos:
        extra["ignore_eos"] = True
    if args.no_prefix_cache:
        extra["prefix_cache"] = False
    return extra


def load_points(args: argparse.Namespace) -> list[tuple[int | None, float | None]]:
    """(concurrency, request rate) of each run; one of the two may be a sweep."""
    cs = [None if c is None else int(c) for c in _floats(args.concurrency)]
    rs = _floats(args.request_rate)
    if len(cs) > 1 and len(rs) > 1:
        raise SystemExit("sweep either --concurrency or --request-rate, not both")
    if cs == [None] and rs == [None]:
        cs = [8]
    return [(c, r) for c in cs for r in rs]


def run_salt(name: str, point: int) -> str:
    """A marker in front of a run's first user messages: a sweep's or a comparison's runs never hit
    prefix-cache entries that an earlier run left (the same length for every run)."""
    return f"[{hashlib.sha1(f'{name}/{point}'.encode()).hexdigest()[:8]}] "


def point_label(c: int | None, r: float | None) -> str:
    return " ".join(x for x in (f"c={c}" if c else "", f"rate={r:g}/s" if r else "") if x)


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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    ap.add_argument(
        "--url", default=None, help="the endpoint: http://h:p, http://h:p/v1 or the full chat URL"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="folder for results.json, summary.txt and the PNGs"
    )
    ap.add_argument("--label", default=None, help="name of the run in the table and plots")
    add_trace_args(ap)
    add_request_args(ap)
    args = ap.parse_args(argv)
    convs, trace_info = trace_from_args(args)
    if args.write_trace:
        print(
            f"wrote {trace_info['num_conversations']} conversations, {trace_info['num_turns']} turns "
            f"to {args.write_trace} ({args.trace_format})"
        )
    if args.url is None:
        if not args.write_trace:
            ap.error("--url is needed to send anything")
        return 0
    url = chat_url(args.url)
    model = args.model or server_model(url)
    extra = extra_body_from_args(args)
    points = load_points(args)
    asyncio.run(warm_up(url, model, args.warmup, extra))
    runs = []
    for i, (c, r) in enumerate(points):
        label = point_label(c, r) if len(points) > 1 or not args.label else args.label
        salt = run_salt(args.label or "run", i) if len(points) > 1 else ""
        cfg = LoadConfig.from_args(args, url, model, c, r, extra, label, salt)
        run = asyncio.run(run_load(cfg, convs))
        if len(points) > 1:  # progress: the table's row of each point as it ends
            lines = format_table(
                [(label, summarize(run.requests, args.slo_ttft_ms, args.slo_itl_ms, args.long_prompt_tokens))]
            ).splitlines()
            print("\n".join(lines if i == 0 else lines[-1:]), flush=True)
        runs.append(run)
    doc = results_doc(
        runs,
        trace_info,
        args.slo_ttft_ms,
        args.slo_itl_ms,
        sys.argv if argv is None else argv,
        args.long_prompt_tokens,
    )
    series = {args.label or "run": doc["runs"]}
    if args.out:
        table = write_outputs(args.out, doc, series, plots=not args.no_plots)
        print(f"\n{table}\n\nresults in {args.out}/")
    else:
        rows = [(r["label"], r["summary"]) for r in doc["runs"]]
        print("\n" + format_table(rows) + "\n\n" + format_itl_split(rows))
    errors = sum(r["summary"]["num_errors"] for r in doc["runs"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
