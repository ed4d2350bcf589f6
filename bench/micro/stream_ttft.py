"""TTFT of one long prompt: a P/D pair over tcp, with and without a streamed handoff (--kv-stream),
against a colocated single engine on the same machine (the ceiling: no handoff at all).

Servers are started here, all at once: the single engine and a pair for each --pairs entry
(TRANSPORT:KV_STREAM); the timed requests go one at a time, the configurations in turn, so a drifting
host load weighs on each alike (idle servers wait passively: OMP_WAIT_POLICY=PASSIVE unless set).
Every server prefills in chunks of --chunk tokens (the single engine and the PE alike) and has no host prefix cache (--hicache-gb 0); each request is a prompt of --tokens
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
    python bench/micro/stream_ttft.py --pairs tcp:on,nixl:on,nixl:off          # nixl: the extra
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=8000, help="prompt tokens")
    p.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens of every server")
    p.add_argument("--runs", type=int, default=3, help="timed requests per configuration (after a warm-up)")
    p.add_argument(
        "--pairs", default="tcp:on,tcp:off",
        help="the pairs to run beside the single engine, TRANSPORT:KV_STREAM each (nixl: the extra)",
    )  # fmt: skip
    p.add_argument("--kv-cache-gb", default="1.5")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    common = (
        "--model", args.model, "--max-model-len", str(args.tokens + 64), "--max-num-batched-tokens", str(args.chunk),
        "--kv-cache-gb", args.kv_cache_gb, "--hicache-gb", "0", "--max-num-seqs", "4",
    )  # fmt: skip
    pairs = [tuple(x.split(":")) for x in args.pairs.split(",")]
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the servers idle beside the one that works
    logs = Path(tempfile.mkdtemp(prefix="stream_ttft_"))
    results: dict[str, Any] = {"tokens": args.tokens, "chunk": args.chunk, "runs": args.runs, "logs": str(logs)}
    print(f"prompt {args.tokens} tokens, chunks of {args.chunk}, {args.runs} timed runs each, interleaved (logs: {logs})")
    servers: dict[str, ServerProcess | PDPair] = {
        "single": ServerProcess(*common, log_path=logs / "single.log", ready_timeout_s=900)
    }
    for transport, mode in pairs:
        name = f"pair {transport} --kv-stream {mode}"
        (logs / f"{transport}_{mode}").mkdir()
        pe_args = ("--transport", transport, "--kv-stream", mode)
        servers[name] = PDPair(*common, log_dir=logs / f"{transport}_{mode}", pe_args=pe_args, ready_timeout_s=900)
    ttfts: dict[str, list[float]] = {name: [] for name in servers}
    phases: dict[str, dict[str, float]] = {name: {} for name in servers if name != "single"}
    try:
        for s in servers.values():
            s.start()
        for name, s in servers.items():
            s.wait_ready()
            warm_up(s.url, args.model, args.tokens, name)
        # one request at a time, the configurations in turn (the order rotated every run): the host's
        # load, which drifts over minutes on a shared machine, weighs on each alike
        names, k = list(servers), 0
        for r in range(args.runs):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                url = servers[name].url
                before = phase_sums(url) if name in phases else {}
                load = os.getloadavg()[0]
                t = ttft_s(url, args.model, prompts(k + 1, args.tokens)[k])
                k += 1
                ttfts[name].append(t)
                if name in phases:
                    after = phase_sums(url)
                    for key, v in after.items():
                        phases[name][key] = phases[name].get(key, 0.0) + v - before.get(key, 0.0)
                print(f"  run {r + 1} {name}: TTFT {t:.3f} s (host load {load:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    results["single"] = {"ttft_s": ttfts["single"]}
    base = statistics.median(ttfts["single"])
    print(f"{'configuration':<30}{'TTFT median s':>14}{'x single':>10}{'prefill s':>11}{'handoff s':>11}"
          f"{'after prefill s':>17}{'after / handoff':>17}")  # fmt: skip
    print(f"{'single engine':<30}{base:>14.3f}{1.0:>10.3f}")
    verdicts = []
    for name, d in phases.items():
        # NOTE: a pair's handoffs counted here are its timed requests' (the warm-up's came before)
        n = d.get("transfer_count", 0.0)
        mean = {key: d.get(f"{key}_sum", 0.0) / n if n else float("nan") for key in ("transfer", "transfer_after_prefill", "prefill")}
        med = statistics.median(ttfts[name])
        frac = mean["transfer_after_prefill"] / mean["transfer"] if mean["transfer"] else float("nan")
        results[name] = {
            "ttft_s": ttfts[name], "mean_prefill_s": mean["prefill"], "mean_transfer_s": mean["transfer"],
            "mean_transfer_after_prefill_s": mean["transfer_after_prefill"], "handoffs": n,
            "ttft_ratio": med / base, "after_fraction": frac,
        }  # fmt: skip
        print(
            f"{name:<30}{med:>14.3f}{med / base:>10.3f}{mean['prefill']:>11.3f}"
            f"{mean['transfer']:>11.3f}{mean['transfer_after_prefill']:>17.3f}{frac:>17.3f}"
        )
        if name.endswith(" on"):
            verdicts.append(f"{name}: TTFT {med / base:.3f}x single (bar {TTFT_BAR}): {'ok' if med / base <= TTFT_BAR else 'MISSED'}")
            verdicts.append(f"{name}: after prefill {frac:.1%} of the handoff (bar {AFTER_BAR:.0%}): {'ok' if frac <= AFTER_BAR else 'MISSED'}")
    for v in verdicts:
        print(v)
    for name, ts in ttfts.items():
        print(f"{name} TTFTs s: " + ", ".join(f"{t:.3f}" for t in ts))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
