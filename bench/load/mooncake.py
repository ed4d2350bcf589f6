"""`pdserve bench mooncake`: replays a Mooncake-format trace (kvcache-ai/Mooncake FAST25-release/traces/*.jsonl:
one request a line, {"timestamp", "input_length", "output_length", "hash_ids"}) against an OpenAI endpoint
and reports the cluster's prefix hit ratio beside the trace's own reuse.

    a record's prompt: each hash id becomes one fixed block of --block-size token ids (a function of the id:
    equal ids, equal tokens), the prompt being the first input_length * block_size / --trace-block-size
    tokens of those blocks (the trace's blocks are 512 tokens: scaled down, a trace fits a small model)
    sent as a streamed /v1/completions with the token ids as prompt, max_tokens min(output_length, --max-output-tokens)

    hit ratio           sum of usage.prompt_tokens_details.cached_tokens / sum of prompt tokens
    trace reuse         the same for one unlimited cache seeing every request in order: a request's hit is the
                        run of its leading blocks whose chain was seen before, whole pages of --page-size, at
                        least one token left to compute (what an engine can reuse)
    share of reuse      hit ratio / trace reuse

Requests go in trace order, at most --concurrency at once (the trace's timestamps are not replayed).
--ce-url names the CEs (a router in front of them, or not) whose /metrics give the requests per CE and
per PE (vllm:request_success_total, pdserve_pe_selected_total), as differences over the run.

    pdserve bench mooncake --trace conversation_trace.jsonl --base-url http://127.0.0.1:8888 --requests 300 \\
        --block-size 16 --concurrency 4 --ce-url http://127.0.0.1:8890,http://127.0.0.1:8891
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from bench.load.loadgen.runner import RequestRecord, stream_request
from bench.load.loadgen.summary import percentiles

VOCAB = (1000, 40000)  # token ids drawn from here (plain words of a ~49k vocabulary)


def block_tokens(hash_id: int, block_size: int) -> list[int]:
    rng = random.Random(hash_id * 1_000_003 + block_size)
    return [rng.randrange(*VOCAB) for _ in range(block_size)]


def prompt_of(record: dict[str, Any], block_size: int, trace_block_size: int) -> list[int]:
    hash_ids = record["hash_ids"]
    n = max(1, round(record["input_length"] * block_size / trace_block_size))
    n = min(n, len(hash_ids) * block_size)
    tokens: list[int] = []
    for h in hash_ids:
        if len(tokens) >= n:
            break
        tokens += block_tokens(h, block_size)
    return tokens[:n]


def trace_reuse(prompts: list[list[int]], hash_ids: list[list[int]], block_size: int, page_size: int) -> list[int]:
    """Per request, the tokens one unlimited cache seeing every request before it would hold."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for prompt, ids in zip(prompts, hash_ids):
        full = len(prompt) // block_size
        run = 0
        while run < full and tuple(ids[: run + 1]) in seen:
            run += 1
        usable = (len(prompt) - 1) // page_size * page_size  # at least one token computed
        out.append(min(run * block_size // page_size * page_size, usable))
        for k in range(1, full + 1):
            seen.add(tuple(ids[:k]))
    return out


def scrape(urls: list[str]) -> dict[str, dict[str, float]]:
    """Per CE URL: its request count and prefills per PE (pe=URL: count)."""
    out: dict[str, dict[str, float]] = {}
    for url in urls:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
            text = r.read().decode()
        counts: dict[str, float] = Counter()
        for m in re.finditer(r'^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$', text, re.M):
            counts["requests"] += float(m.group(1))
        for m in re.finditer(r'^pdserve_pe_selected_total\{pe="([^"]+)",reason="[^"]+"\} ([0-9.e+]+)$', text, re.M):
            counts[f"pe={m.group(1)}"] += float(m.group(2))
        out[url] = dict(counts)
    return out


async def replay(args: argparse.Namespace, prompts: list[list[int]], outputs: list[int]) -> list[RequestRecord]:
    import aiohttp

    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    recs = [RequestRecord(f"r{i}", 0, "mooncake", outputs[i]) for i in range(len(prompts))]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    t0 = time.perf_counter()

    async def worker(session: Any) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = {
                "model": args.model, "prompt": prompts[i], "max_tokens": outputs[i], "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            }  # fmt: skip
            try:
                await stream_request(session, url, body, recs[i], t0, args.timeout_s, headers)
            except Exception as e:  # a failed request is counted, the replay goes on
                recs[i].status, recs[i].error = "error", f"{type(e).__name__}: {e}"
            done = sum(r.status != "skipped" for r in recs)
            if sys.stderr.isatty():
                print(f"\r{done}/{len(recs)} requests", end="", file=sys.stderr, flush=True)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return recs


def report(args: argparse.Namespace, recs: list[RequestRecord], ideal: list[int], per_ce: dict[str, dict[str, float]]) -> dict[str, Any]:
    ok = [r for r in recs if r.status == "ok"]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    ideal_ok = sum(c for c, r in zip(ideal, recs) if r.status == "ok")
    hit = cached / prompt if prompt else 0.0
    reuse = ideal_ok / prompt if prompt else 0.0
    return {
        "trace": str(args.trace),
        "requests": len(recs),
        "ok": len(ok),
        "failed": len(recs) - len(ok),
        "errors": Counter((r.error or "")[:120] for r in recs if r.status != "ok").most_common(3),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_ratio": hit,
        "trace_reuse": reuse,
        "share_of_reuse": hit / reuse if reuse else None,
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None], (50, 90, 99)),
        "per_ce": per_ce,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench mooncake", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, required=True, help="a Mooncake-format JSONL trace")
    p.add_argument("--base-url", default="http://127.0.0.1:8888", help="the endpoint (a router or a CE)")
    p.add_argument("--model", default=None, help="default: the endpoint's first /v1/models entry")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=200, help="the trace's first N records")
    p.add_argument("--skip", type=int, default=0, help="records skipped first")
    p.add_argument("--block-size", type=int, default=16, help="tokens per trace block here")
    p.add_argument("--trace-block-size", type=int, default=512, help="tokens per block in the trace")
    p.add_argument("--page-size", type=int, default=16, help="the engines' page (--block-size of the servers)")
    p.add_argument("--max-input-tokens", type=int, default=1900, help="longer prompts are cut here (the model's limit)")
    p.add_argument("--max-output-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--ce-url", default="", help="comma-separated CE URLs whose /metrics count requests per CE and PE")
    p.add_argument("--out", type=Path, default=None, help="the report as JSON here")
    args = p.parse_args(argv)
    if min(args.requests, args.block_size, args.page_size, args.concurrency, args.max_output_tokens) < 1:
        p.error("--requests, --block-size, --page-size, --concurrency and --max-output-tokens must be >= 1")
    lines = args.trace.read_text().splitlines()[args.skip : args.skip + args.requests]
    records = [json.loads(line) for line in lines if line.strip()]
    prompts = [prompt_of(r, args.block_size, args.trace_block_size)[: args.max_input_tokens] for r in records]
    outputs = [max(1, min(int(r["output_length"]), args.max_output_tokens)) for r in records]
    ideal = trace_reuse(prompts, [r["hash_ids"] for r in records], args.block_size, args.page_size)
    if args.model is None:
        req = urllib.request.Request(args.base_url.rstrip("/") + "/v1/models",
                                     headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as r:
            args.model = json.loads(r.read())["data"][0]["id"]
    ces = [u for u in args.ce_url.split(",") if u]
    before = scrape(ces)
    recs = asyncio.run(replay(args, prompts, outputs))
    after = scrape(ces)
    per_ce = {u: {k: after[u].get(k, 0) - before[u].get(k, 0) for k in after[u]} for u in ces}
    out = report(args, recs, ideal, per_ce)
    text = (
        f"{out['ok']}/{out['requests']} requests ok; prompt tokens {out['prompt_tokens']}, cached {out['cached_tokens']}\n"
        f"hit ratio {out['hit_ratio']:.3f}, trace reuse {out['trace_reuse']:.3f}, share of reuse "
        f"{(out['share_of_reuse'] or 0) * 100:.1f}%\n"
        f"TTFT ms p50 {out['ttft_ms']['p50'] or 0:.0f}, p90 {out['ttft_ms']['p90'] or 0:.0f}\n"
    )
    for u, counts in per_ce.items():
        text += f"  {u}: " + ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items()) if v) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return 0 if out["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
