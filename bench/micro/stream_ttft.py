"""TTFT of one long prompt: a P/D pair over tcp, with and without a streamed handoff (--kv-stream),
against a colocated single engine on the same machine (the ceiling: no handoff at all).

Servers are started here, one configuration at a time (so they do not share the CPU): the single engine,
then a pair for each --modes entry. Every server prefills in chunks of --chunk tokens (the single engine
and the PE alike) and has no host prefix cache (--hicache-gb 0); each request is a prompt of --tokens
token ids of its own (a distinct first token: no cache hits anywhere), sent to /v1/completions with
max_tokens 2 (1 would end on the PE: no handoff), ignore_eos and stream on; TTFT is the time to the
first streamed token. After one warm-up request of WARMUP_TOKENS tokens, --runs requests are timed per
configuration; the median is reported. For the pairs, the CE's
/metrics give the handoff's two phases per request: `transfer` (the whole handoff: streamed, from its
open after the first chunk; else from the export) and `transfer_after_prefill` (the PE's first token to
the CE's ack: what the handoff adds to TTFT), and their ratio.

Bars (the streaming check): the pair with --kv-stream on within 1.15x of the single engine's TTFT, and
its transfer after prefill at most 15% of the whole handoff.

    python bench/micro/stream_ttft.py                                  # 8000 tokens, SmolLM2-135M, CPU
    python bench/micro/stream_ttft.py --tokens 2000 --chunk 512 --runs 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pd.tools.server_process import PDPair, ServerProcess  # noqa: E402

TTFT_BAR = 1.15
WARMUP_TOKENS = 512
AFTER_BAR = 0.15


def ttft_s(url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed /v1/completions of prompt (token ids) to its first token."""
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True}
    )
    req = urllib.request.Request(
        url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}, method="POST"
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as r:
        first = None
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
        if first is None:
            raise RuntimeError("no token came back")
    return first


def phase_sums(url: str) -> dict[str, float]:
    """The CE coordinator's pdserve_ttft_phase_seconds sums and counts by phase."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for kind in ("sum", "count"):
            prefix = f"pdserve_ttft_phase_seconds_{kind}{{phase=\""
            if line.startswith(prefix):
                phase = line[len(prefix) :].split('"', 1)[0]
                out[f"{phase}_{kind}"] = out.get(f"{phase}_{kind}", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def prompts(n: int, tokens: int) -> list[list[int]]:
    """n prompts of `tokens` ids, each with a first token of its own (no prefix is shared)."""
    body = [1000 + (i * 7919) % 20000 for i in range(tokens - 1)]
    return [[200 + k, *body] for k in range(n)]


def warm_up(url: str, model: str, tokens: int, label: str) -> None:
    """One request of min(tokens, WARMUP_TOKENS) tokens (a prompt of its own), untimed."""
    n = min(tokens, WARMUP_TOKENS)
    t = ttft_s(url, model, prompts(1, n)[0][::-1])
    print(f"  {label}: warm-up ({n} tokens) TTFT {t:.3f} s", flush=True)


def measure(url: str, model: str, runs: int, start: int, tokens: int, label: str) -> list[float]:
    """TTFTs of `runs` prompts of `tokens` (prompts()[start:start + runs])."""
    out = []
    for i, p in enumerate(prompts(start + runs, tokens)[start:]):
        load = os.getloadavg()[0]
        out.append(ttft_s(url, model, p))
        print(
            f"  {label}: run {i + 1} TTFT {out[-1]:.3f} s (host load average {load:.1f} -> {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=8000, help="prompt tokens")
    p.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens of every server")
    p.add_argument("--runs", type=int, default=3, help="timed requests per configuration (after a warm-up)")
    p.add_argument("--modes", default="on,off", help="the pair's --kv-stream values to run, in order")
    p.add_argument("--kv-cache-gb", default="1.5")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    common = (
        "--model", args.model, "--max-model-len", str(args.tokens + 64), "--max-num-batched-tokens", str(args.chunk),
        "--kv-cache-gb", args.kv_cache_gb, "--hicache-gb", "0", "--max-num-seqs", "4",
    )  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="stream_ttft_"))
    results: dict[str, Any] = {"tokens": args.tokens, "chunk": args.chunk, "runs": args.runs, "logs": str(logs)}
    print(f"prompt {args.tokens} tokens, chunks of {args.chunk}, {args.runs} timed runs each (logs: {logs})")
    with ServerProcess(*common, log_path=logs / "single.log", ready_timeout_s=900) as single:
        warm_up(single.url, args.model, args.tokens, "single")
        results["single"] = {"ttft_s": measure(single.url, args.model, args.runs, 0, args.tokens, "single")}
    for i, mode in enumerate(args.modes.split(",")):
        (logs / f"pair_{mode}").mkdir()
        with PDPair(*common, log_dir=logs / f"pair_{mode}", pe_args=("--kv-stream", mode), ready_timeout_s=900) as pair:
            warm_up(pair.url, args.model, args.tokens, f"pair {mode}")
            before = phase_sums(pair.url)
            start = (i + 1) * args.runs
            ttfts = measure(pair.url, args.model, args.runs, start, args.tokens, f"pair {mode}")
            after = phase_sums(pair.url)
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        n = d.get("transfer_count", 0.0)
        # NOTE: the warm-up's handoff is counted before `before`: n is runs
        transfer = d.get("transfer_sum", 0.0) / n if n else float("nan")
        after_prefill = d.get("transfer_after_prefill_sum", 0.0) / n if n else float("nan")
        prefill = d.get("prefill_sum", 0.0) / n if n else float("nan")
        results[f"pair_{mode}"] = {
            "ttft_s": ttfts,
            "mean_prefill_s": prefill,
            "mean_transfer_s": transfer,
            "mean_transfer_after_prefill_s": after_prefill,
            "handoffs": n,
        }
    base = statistics.median(results["single"]["ttft_s"])
    print(f"{'configuration':<22}{'TTFT median s':>14}{'x single':>10}{'prefill s':>11}{'handoff s':>11}"
          f"{'after prefill s':>17}{'after / handoff':>17}")  # fmt: skip
    print(f"{'single engine':<22}{base:>14.3f}{1.0:>10.3f}")
    verdicts = []
    for mode in args.modes.split(","):
        r = results[f"pair_{mode}"]
        med = statistics.median(r["ttft_s"])
        frac = r["mean_transfer_after_prefill_s"] / r["mean_transfer_s"] if r["mean_transfer_s"] else float("nan")
        r["ttft_ratio"], r["after_fraction"] = med / base, frac
        print(
            f"{'pair --kv-stream ' + mode:<22}{med:>14.3f}{med / base:>10.3f}{r['mean_prefill_s']:>11.3f}"
            f"{r['mean_transfer_s']:>11.3f}{r['mean_transfer_after_prefill_s']:>17.3f}{frac:>17.3f}"
        )
        if mode == "on":
            verdicts.append(f"TTFT {med / base:.3f}x single (bar {TTFT_BAR}): {'ok' if med / base <= TTFT_BAR else 'MISSED'}")
            verdicts.append(f"after prefill {frac:.1%} of the handoff (bar {AFTER_BAR:.0%}): {'ok' if frac <= AFTER_BAR else 'MISSED'}")
    for v in verdicts:
        print(v)
    print("single engine TTFTs s: " + ", ".join(f"{t:.3f}" for t in results["single"]["ttft_s"]))
    for mode in args.modes.split(","):
        print(f"pair {mode} TTFTs s: " + ", ".join(f"{t:.3f}" for t in results[f"pair_{mode}"]["ttft_s"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
