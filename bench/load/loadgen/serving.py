"""One `pdserve bench serve` run: single-turn requests sent as `vllm bench serve` sends them (all at once or
at a request rate with gamma-distributed gaps, under an optional concurrency cap), streamed through the
load generator's client (runner.stream_request), and reported with vLLM's metrics and layout.

    TTFT   send to the first token-carrying chunk
    TPOT   per request: (end-to-end - TTFT) / (output tokens - 1), requests of 2 tokens or more
    ITL    every gap between token-carrying chunks
    E2EL   send to the stream's end
Throughputs are over the run's duration (first send to last answer); token counts are the server's usage.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .datasets import SampleRequest
from .runner import RequestRecord, stream_request
from .summary import percentiles

METRICS = {  # name: (header, label)
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass(frozen=True)
class ServeConfig:
    url: str  # the endpoint: .../v1/completions or .../v1/chat/completions
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    request_rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0  # the gamma shape of the gaps: 1 is a Poisson process
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 6 * 3600.0  # vLLM's AIOHTTP_TIMEOUT
    show_progress: bool = False

    def __post_init__(self) -> None:
        if not self.url.endswith("/completions"):
            raise ValueError(f"--endpoint must be /v1/completions or /v1/chat/completions, got {self.url}")
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise ValueError(f"--request-rate and --burstiness must be > 0, got {self.request_rate}, {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")

    @property
    def is_chat(self) -> bool:
        return self.url.endswith("/chat/completions")


@dataclass
class ServeResult:
    records: list[RequestRecord]
    texts: list[str]
    duration_s: float


def request_body(cfg: ServeConfig, req: SampleRequest) -> dict[str, Any]:
    """The OpenAI request of one prompt, as vLLM's openai and openai-chat backends build it."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.is_chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.expected_output_len
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


async def arrivals(num: int, rate: float, burstiness: float, seed: int) -> AsyncIterator[int]:
    """Yields 0..num-1, each after its gap: none at an infinite rate, else gamma(burstiness, 1 / (rate *
    burstiness)) seconds (mean 1 / rate; vLLM's get_request)."""
    rng = random.Random(seed)
    for i in range(num):
        yield i
        if math.isinf(rate) or i == num - 1:
            continue
        await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def run_serving(cfg: ServeConfig, requests: Sequence[SampleRequest]) -> ServeResult:
    import aiohttp
    from tqdm import tqdm

    records = [RequestRecord(f"prompt-{i:05d}", 0, "serve", r.expected_output_len) for i, r in enumerate(requests)]
    texts = [""] * len(requests)
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(requests), disable=not cfg.show_progress, unit="req", file=sys.stderr)

    async def one(i: int) -> None:
        rec = records[i]
        try:
            if gate is None:
                texts[i] = await stream_request(session, cfg.url, request_body(cfg, requests[i]), rec, t0, cfg.timeout_s, cfg.headers)
            else:
                async with gate:
                    texts[i] = await stream_request(session, cfg.url, request_body(cfg, requests[i]), rec, t0, cfg.timeout_s, cfg.headers)
        except Exception as e:  # noqa: BLE001 - any failure of one request is that request's error
            rec.status, rec.error = "error", f"{type(e).__name__}: {e}"[:300]
        bar.update(1)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one(i)) async for i in arrivals(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)]
        await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - t0
    bar.close()
    return ServeResult(records, texts, duration_s)


def tpot_s(r: RequestRecord) -> float | None:
    """vLLM's TPOT of one request: decode time over the tokens after the first."""
    if r.e2e_s is None or r.ttft_s is None or (r.completion_tokens or 0) < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)  # type: ignore[operator]


def metric_values(result: ServeResult) -> dict[str, list[float]]:
    """Each metric's samples (s) over the run's successful requests: what its percentiles and plot are of."""
    ok = [r for r in result.records if r.status == "ok"]
    return {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [t for r in ok if (t := tpot_s(r)) is not None],
        "itl": [g for r in ok for g in r.itl_s],
        "e2el": [r.e2e_s for r in ok if r.e2e_s is not None],
    }


def serving_metrics(
    result: ServeResult,
    requests: Sequence[SampleRequest],
    metrics: Sequence[str],
    ps: Sequence[float],
) -> dict[str, Any]:
    """vLLM's result document: counts, throughputs, and mean/median/std/percentiles (ms) of each metric."""
    recs = result.records
    ok = [r for r in recs if r.status == "ok"]
    duration = result.duration_s
    input_lens = [r.prompt_tokens if r.prompt_tokens is not None else q.prompt_len for r, q in zip(recs, requests)]
    output_lens = [r.completion_tokens or 0 for r in recs]
    total_in = sum(n for n, r in zip(input_lens, recs) if r.status == "ok")
    total_out = sum(r.completion_tokens or 0 for r in ok)
    values = metric_values(result)
    doc: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "input_lens": input_lens,
        "output_lens": output_lens,
        "ttfts": [r.ttft_s or 0.0 for r in recs],
        "itls": [list(r.itl_s) for r in recs],
        "generated_texts": result.texts,
        "errors": [r.error or "" for r in recs],
    }
    for name in metrics:
        p = percentiles(values[name], ps)
        doc[f"mean_{name}_ms"], doc[f"median_{name}_ms"], doc[f"std_{name}_ms"] = p["mean"], p["median"], p["std"]
        for q in ps:
            doc[f"p{q:g}_{name}_ms"] = p[f"p{q:g}"]
    return doc


def format_report(doc: dict[str, Any], metrics: Sequence[str], ps: Sequence[float], cfg: ServeConfig) -> str:
    """vLLM's printed summary."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value: Any) -> None:
        cell = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        lines.append(f"{label:<40} {cell}".rstrip())

    row("Successful requests:", doc["completed"])
    row("Failed requests:", doc["failed"])
    if cfg.max_concurrency is not None:
        row("Maximum request concurrency:", cfg.max_concurrency)
    row("Request rate configured (RPS):", cfg.request_rate)
    row("Benchmark duration (s):", doc["duration"])
    row("Total input tokens:", doc["total_input_tokens"])
    row("Total generated tokens:", doc["total_output_tokens"])
    row("Request throughput (req/s):", doc["request_throughput"])
    row("Output token throughput (tok/s):", doc["output_throughput"])
    row("Total token throughput (tok/s):", doc["total_token_throughput"])
    for name in metrics:
        header, label = METRICS[name]
        lines.append(f"{header:-^50}")
        for key, text in (("mean", "Mean"), ("median", "Median"), *((f"p{q:g}", f"P{q:g}") for q in ps)):
            value = doc[f"{key}_{name}_ms"]
            row(f"{text} {label} (ms):", "-" if value is None else float(value))
    lines.append("=" * 50)
    return "\n".join(lines)
