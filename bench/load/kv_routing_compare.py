"""Affinity against KV-aware routing (issue 51): two PEs (127.0.0.2, 127.0.0.3) and two CEs (127.0.0.4,
127.0.0.5) behind `pdserve router` (127.0.0.6), SmolLM2, one cluster per policy started in turn (fresh
caches each), the same load replayed against each.

    python bench/load/kv_routing_compare.py --trace conversation_trace.jsonl --requests 300 --out DIR \
        [--policies affinity,kv-aware,kv-aware@0.5] [--concurrency 4] [--block-size 16]
    python bench/load/kv_routing_compare.py --shared-first 64 --concurrency 8 --out DIR

A policy is the choice at both hops: affinity (router --routing affinity, CEs --pe-routing affinity) or
kv-aware (both kv-aware); kv-aware@W sets --kv-load-weight W at both. The load is a Mooncake trace
slice (bench/load/mooncake.py) or, with --shared-first N, N two-turn chats that open with the same user
turn (each then asks its own question), --concurrency chats at a time. Every engine publishes KV events
(--kv-events-config). DIR gets each run's report (JSON) and a summary table (summary.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.load import mooncake
from bench.load.loadgen.summary import percentiles
from pd.tools.server_process import ServerProcess, free_port, get_json

MODEL = "smollm2-135m-instruct"
TOKEN = "kv-routing-compare-token-0123456789"
PE_HOSTS = ("127.0.0.2", "127.0.0.3")
CE_HOSTS = ("127.0.0.4", "127.0.0.5")
ROUTER_HOST = "127.0.0.6"


def cluster(
    policy: str, block_size: int, hicache_gb: float, logs: Path
) -> tuple[list[ServerProcess], ServerProcess, list[ServerProcess]]:
    routing, _, weight = policy.partition("@")
    weighted = ("--kv-load-weight", weight) if weight else ()
    env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": TOKEN}
    env.pop("PDSERVE_CLUSTER_TOKEN_FILE", None)
    common = ("--model", MODEL, "--block-size", str(block_size), "--max-model-len", "2048", "--kv-cache-gb", "0.5",
              "--hicache-gb", str(hicache_gb))  # fmt: skip

    def events(host: str) -> tuple[str, str]:
        cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://{host}:{free_port()}",
               "replay_endpoint": f"tcp://{host}:{free_port()}"}  # fmt: skip
        return "--kv-events-config", json.dumps(cfg)

    pes = [ServerProcess("--role", "pe", *common, *events(h), host=h, env=env, log_path=logs / f"pe-{h}.log")
           for h in PE_HOSTS]  # fmt: skip
    ces = [
        ServerProcess(
            "--role", "ce", *common, *events(h), "--prefill-url", ",".join(p.url for p in pes),
            "--pe-routing", routing, *weighted, "--kv-host", h, "--kv-port-base", str(free_port()),
            host=h, env=env, log_path=logs / f"ce-{h}.log",
        )
        for h in CE_HOSTS
    ]  # fmt: skip
    router = ServerProcess("--decode-url", ",".join(c.url for c in ces), "--routing", routing, *weighted,
                           command=(sys.executable, "-m", "pd.router.server"), host=ROUTER_HOST, env=env,
                           log_path=logs / "router.log")  # fmt: skip
    return pes, router, ces


FIRST_TURN = (
    "I run a small bakery and want to plan next week. We bake sourdough, rye, baguettes, croissants and "
    "cinnamon rolls; two ovens, three bakers, open from 7 to 19 every day but Monday. Flour arrives on "
    "Tuesdays and Fridays, butter on Wednesdays. Last week we sold out of croissants by 10 and threw away "
    "a third of the rye. Keep this in mind for my questions."
)


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def shared_first(base: str, ces: list[str], chats: int, concurrency: int, page: int) -> dict[str, Any]:
    """chats two-turn conversations, concurrency at a time, that open with FIRST_TURN (answered with
    sampling, so their second turns differ); the report's shape is bench/load/mooncake.py's. The reuse
    one unlimited cache would reach: each prompt's pages held by any prompt sent before it (in chat
    order, token ids from a CE's /tokenize)."""
    before = mooncake.scrape(ces)

    def one(i: int) -> list[tuple[list[dict[str, str]], dict[str, Any] | None, float]]:
        turns: list[tuple[list[dict[str, str]], dict[str, Any] | None, float]] = []
        messages = [{"role": "user", "content": FIRST_TURN}]
        for turn, (max_tokens, temperature) in enumerate(((12, 1.0), (4, 0.0))):
            if turn:
                messages = [*messages, {"role": "user", "content": f"Question {i}: how many batches of item {i % 5} on day {i % 6}?"}]
            t0 = time.perf_counter()
            try:
                r = post_json(base + "/v1/chat/completions", {"model": MODEL, "messages": messages,
                              "max_tokens": max_tokens, "temperature": temperature, "seed": i})  # fmt: skip
            except (OSError, ValueError) as e:
                turns.append((messages, {"error": f"{type(e).__name__}: {e}"}, 0.0))
                break
            turns.append((messages, r, time.perf_counter() - t0))
            messages = [*messages, {"role": "assistant", "content": r["choices"][0]["message"]["content"]}]
        return turns

    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, range(chats)))
    after = mooncake.scrape(ces)
    seen: set[tuple[int, ...]] = set()
    ok, prompt, cached, ideal, latency, errors = 0, 0, 0, 0, [], Counter()
    for turns in done:
        for messages, r, seconds in turns:
            if r is None or "error" in r:
                errors[(r or {}).get("error", "")[:120]] += 1
                continue
            ok += 1
            latency.append(seconds)
            prompt += r["usage"]["prompt_tokens"]
            cached += (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            ids = post_json(ces[0] + "/tokenize", {"model": MODEL, "messages": messages})["tokens"]
            pages = [tuple(ids[: k + page]) for k in range(0, len(ids) - page + 1, page)]
            ideal += page * next((j for j, pg in enumerate(pages) if pg not in seen), len(pages))
            seen.update(pages)
    requests = sum(len(t) for t in done)
    return {
        "load": f"shared-first {chats}", "requests": requests, "ok": ok, "failed": requests - ok,
        "errors": errors.most_common(3), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_ratio": cached / prompt if prompt else 0.0, "trace_reuse": ideal / prompt if prompt else 0.0,
        "share_of_reuse": cached / ideal if ideal else None,
        "ttft_ms": percentiles(latency, (50, 90, 99)),  # whole requests (non-streamed, 4-12 tokens out)
        "per_ce": {u: {k: after[u].get(k, 0) - before[u].get(k, 0) for k in after[u]} for u in ces},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/load/kv_routing_compare.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, help="a Mooncake-format trace (or --shared-first)")
    p.add_argument("--shared-first", type=int, default=0, help="N two-turn chats that open with the same user turn")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policies", default="affinity,kv-aware")
    p.add_argument("--hicache-gb", type=float, default=3.0, help="each engine's host prefix cache (SmolLM2 on the "
                   "CPU: 46 KB a token, so 3 GB holds about 68k tokens)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if (args.trace is None) == (not args.shared_first):
        p.error("give one of --trace and --shared-first")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for policy in args.policies.split(","):
        logs = args.out / f"logs-{policy}"
        logs.mkdir(exist_ok=True)
        pes, router, ces = cluster(policy, args.block_size, args.hicache_gb, logs)
        every = [*pes, *ces, router]
        try:
            for s in every:
                s.start()
            for s in every:
                s.wait_ready()
            deadline = time.monotonic() + 60  # each CE sees both PEs (and, kv-aware, their streams)
            while not all(all(pe["state"] == "up" for pe in get_json(c.url + "/health")[1].get("prefill_engines", []))
                          for c in ces):  # fmt: skip
                if time.monotonic() > deadline:
                    raise TimeoutError("the CEs do not see the PEs")
                time.sleep(0.5)
            report = args.out / f"{policy}.json"
            if args.shared_first:
                r = shared_first(router.url, [c.url for c in ces], args.shared_first, args.concurrency, args.block_size)
                report.write_text(json.dumps(r, indent=1))
            else:
                mooncake.main([
                    "--trace", str(args.trace), "--base-url", router.url, "--model", MODEL, "--requests",
                    str(args.requests), "--skip", str(args.skip), "--block-size", str(args.block_size), "--page-size",
                    str(args.block_size), "--concurrency", str(args.concurrency), "--ce-url", ",".join(c.url for c in ces),
                    "--out", str(report),
                ])  # fmt: skip
            r = json.loads(report.read_text())
            pe_counts = {pe.url: sum(v for ce in r["per_ce"].values() for k, v in ce.items() if k == f"pe={pe.url}") for pe in pes}
            ce_counts = {u: c.get("requests", 0) for u, c in r["per_ce"].items()}
            rows.append((policy, r, ce_counts, pe_counts))
        finally:
            for s in every:
                s.terminate()
            for s in every:
                s.stop()
    load = (f"{args.shared_first} two-turn chats opening with the same user turn" if args.shared_first else
            f"trace {args.trace.name}, records {args.skip}..{args.skip + args.requests - 1}")  # fmt: skip
    lines = [
        f"{load}, block {args.block_size} tokens, "
        f"concurrency {args.concurrency}, 2 PEs x 2 CEs behind pdserve router, {MODEL}, --hicache-gb {args.hicache_gb:g}",
        "| policy | ok | hit ratio | trace reuse | share of reuse | TTFT p50 ms | TTFT p90 ms | requests per CE | prefills per PE |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy, r, ce_counts, pe_counts in rows:
        lines.append(
            f"| {policy} | {r['ok']}/{r['requests']} | {r['hit_ratio']:.3f} | {r['trace_reuse']:.3f} | "
            f"{(r['share_of_reuse'] or 0) * 100:.1f}% | {r['ttft_ms']['p50'] or 0:.0f} | {r['ttft_ms']['p90'] or 0:.0f} | "
            f"{' / '.join(f'{v:g}' for v in ce_counts.values())} | {' / '.join(f'{v:g}' for v in pe_counts.values())} |"
        )
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
