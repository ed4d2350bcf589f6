"""What `pdserve router` adds to a request: one server (`--model`, default the catalogue's SmolLM2) and a
router in front of it, both real processes on loopback; the same requests sent straight to the server
and through the router, interleaved one by one (so drift moves both alike), through the `openai` client.
The server alone is the ceiling; the table gives each path's median and p90 and what the router adds.

    python bench/load/router_overhead.py [--requests 40] [--model smollm2-135m-instruct] [--routing affinity,kv-aware]

Rows: a non-streamed chat completion of one token (the whole request's latency: TTFT plus the answer),
a streamed one of --stream-tokens tokens (time to the first content chunk, and to the end; the chunk
counts of both paths must be equal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pd.tools.server_process import ServerProcess, free_port


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def one_token(client: Any, model: str, i: int) -> float:
    t0 = time.perf_counter()
    client.chat.completions.create(model=model, max_tokens=1, temperature=0.0,
                                   messages=[{"role": "user", "content": f"Say a number: {i}"}])
    return time.perf_counter() - t0


def streamed(client: Any, model: str, i: int, tokens: int) -> tuple[float, float, int]:
    """(time to the first content chunk, to the end, chunks)."""
    t0 = time.perf_counter()
    first, chunks = None, 0
    stream = client.chat.completions.create(model=model, max_tokens=tokens, temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True},
                                            messages=[{"role": "user", "content": f"Count from {i}."}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            chunks += 1
    return first or float("nan"), time.perf_counter() - t0, chunks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=40, help="per row and path")
    ap.add_argument("--stream-tokens", type=int, default=32)
    ap.add_argument("--routing", default="affinity", help="comma-separated: one router per policy, each a path "
                    "(kv-aware: the server publishes KV events and the router asks its /tokenize per chat)")
    args = ap.parse_args(argv)
    from openai import OpenAI

    logs = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    policies = args.routing.split(",")
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}",
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}  # fmt: skip
    server = ServerProcess("--model", args.model, "--kv-cache-gb", "0.5", "--hicache-gb", "0",
                           *(("--kv-events-config", json.dumps(events)) if "kv-aware" in policies else ()),
                           log_path=logs / "server.log")  # fmt: skip
    with server, contextlib.ExitStack() as stack:
        clients = {"server": OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)}
        for policy in policies:
            router = stack.enter_context(ServerProcess(
                "--decode-url", server.url, "--health-interval-s", "1", "--routing", policy,
                command=(sys.executable, "-m", "pd.router.server"), log_path=logs / f"router-{policy}.log"))  # fmt: skip
            clients[f"router {policy}"] = OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        for c in clients.values():  # warm-up: connections, the first prefill
            one_token(c, args.model, 0)
            streamed(c, args.model, 0, 4)
        lat: dict[str, list[float]] = {p: [] for p in clients}
        ttft: dict[str, list[float]] = {p: [] for p in clients}
        total: dict[str, list[float]] = {p: [] for p in clients}
        counts: dict[str, set[int]] = {p: set() for p in clients}
        for i in range(args.requests):
            order = list(clients)[i % len(clients):] + list(clients)[: i % len(clients)]
            for p in order:
                lat[p].append(one_token(clients[p], args.model, i))
            for p in order:
                f, t, n = streamed(clients[p], args.model, i, args.stream_tokens)
                ttft[p].append(f)
                total[p].append(t)
                counts[p].add(n)
    routers = [p for p in clients if p != "server"]
    print(f"{args.requests} requests per row and path, interleaved; {args.model}; logs in {logs}")
    print(f"{'row':34s} | {'path':18s} | {'p50 ms':>9s} | {'added p50 ms':>12s} | {'p90 ms':>9s}")
    for name, d in (("chat, 1 token (whole request)", lat), (f"stream {args.stream_tokens} tokens: first chunk", ttft),
                    (f"stream {args.stream_tokens} tokens: to the end", total)):
        s50 = statistics.median(d["server"]) * 1e3
        for p in clients:
            p50 = statistics.median(d[p]) * 1e3
            added = "" if p == "server" else f"{p50 - s50:12.2f}"
            print(f"{name:34s} | {p:18s} | {p50:9.2f} | {added:>12s} | {percentile(d[p], 0.9) * 1e3:9.2f}")
    print("content chunks per stream: " + ", ".join(f"{p} {sorted(counts[p])}" for p in clients))
    return 0 if all(counts[p] == counts["server"] for p in routers) else 1


if __name__ == "__main__":
    sys.exit(main())
