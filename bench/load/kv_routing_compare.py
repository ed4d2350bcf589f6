"""Affinity against KV-aware routing on a Mooncake trace (issue 51): two PEs (127.0.0.2, 127.0.0.3) and two
CEs (127.0.0.4, 127.0.0.5) behind `pdserve router` (127.0.0.6), SmolLM2, one cluster per policy started
in turn (fresh caches each), the same trace slice replayed against each with bench/load/mooncake.py.

    python bench/load/kv_routing_compare.py --trace conversation_trace.jsonl --requests 300 --out DIR \\
        [--policies affinity,kv-aware] [--concurrency 4] [--block-size 16]

Every engine publishes KV events (--kv-events-config); only kv-aware CEs read them. DIR gets each
policy's report (JSON) and a summary table (summary.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.load import mooncake
from pd.tools.server_process import ServerProcess, free_port, get_json

MODEL = "smollm2-135m-instruct"
TOKEN = "kv-routing-compare-token-0123456789"
PE_HOSTS = ("127.0.0.2", "127.0.0.3")
CE_HOSTS = ("127.0.0.4", "127.0.0.5")
ROUTER_HOST = "127.0.0.6"


def cluster(
    policy: str, block_size: int, hicache_gb: float, logs: Path
) -> tuple[list[ServerProcess], ServerProcess, list[ServerProcess]]:
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
            "--pe-routing", policy, "--kv-host", h, "--kv-port-base", str(free_port()),
            host=h, env=env, log_path=logs / f"ce-{h}.log",
        )
        for h in CE_HOSTS
    ]  # fmt: skip
    router = ServerProcess("--decode-url", ",".join(c.url for c in ces), command=(sys.executable, "-m", "pd.router.server"),
                           host=ROUTER_HOST, log_path=logs / "router.log")  # fmt: skip
    return pes, router, ces


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/load/kv_routing_compare.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policies", default="affinity,kv-aware")
    p.add_argument("--hicache-gb", type=float, default=3.0, help="each engine's host prefix cache (SmolLM2 on the "
                   "CPU: 46 KB a token, so 3 GB holds about 68k tokens)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
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
            mooncake.main([
                "--trace", str(args.trace), "--base-url", router.url, "--model", MODEL, "--requests", str(args.requests),
                "--skip", str(args.skip), "--block-size", str(args.block_size), "--page-size", str(args.block_size),
                "--concurrency", str(args.concurrency), "--ce-url", ",".join(c.url for c in ces), "--out", str(report),
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
    lines = [
        f"trace {args.trace.name}, records {args.skip}..{args.skip + args.requests - 1}, block {args.block_size} tokens, "
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
