#!/usr/bin/env python3
"""aiperf's and bench/load/replay.py's records of the same trace, paired request by request.

    python bench/load/aiperf_vs_load.py --load load-c4/results.json --aiperf aiperf-c4/profile_export.jsonl \\
        [--load ...] [--aiperf ...]

Both tools replay one trace file (bench/load/replay.py --write-trace F --trace-format multi_turn), so every
request is named by (conversation, turn): aiperf's profile_export.jsonl has them as `conversation_id`
and `turn_index`, replay.py's results.json as `conversation` and `turn`. A table with one line per run:
- requests paired with the first run, and how many of them had the same prompt, cached and completion
  tokens (the server's usage), which is how to tell that the two tools sent the same requests;
- TTFT p50/p90/p99. Both measure from sending to the first chunk with content;
- the per-request mean inter-token gap. aiperf's "Inter Token Latency" is (request latency - TTFT) /
  (output tokens - 1), and replay.py's `tpot_ms` is the mean of the gaps between token chunks;
- every inter-token gap (aiperf's `inter_chunk_latency`, replay.py's `itl_s`), which is what replay.py's
  ITL percentiles are computed from;
- the median, p10 and p90 of each request's TTFT divided by the same request's TTFT in the first run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Rec:
    ttft_ms: float
    mean_gap_ms: float | None  # per-request mean inter-token gap
    gaps_ms: tuple[float, ...]
    tokens: tuple[int, int, int]  # prompt, cached, completion (server usage)


Key = tuple[str, int]  # (conversation, turn)


def read_load(path: Path) -> dict[Key, Rec]:
    """The ok requests of replay.py's results.json (its only run)."""
    (run,) = json.loads(Path(path).read_text())["runs"]
    out: dict[Key, Rec] = {}
    for r in run["requests"]:
        if r["status"] != "ok":
            continue
        gaps = tuple(g * 1e3 for g in r["itl_s"])
        tokens = (r["prompt_tokens"], r["cached_tokens"] or 0, r["completion_tokens"])
        out[(r["conversation"], r["turn"])] = Rec(
            r["ttft_s"] * 1e3, sum(gaps) / len(gaps) if gaps else None, gaps, tokens
        )
    return out


def _metric(metrics: dict[str, Any], name: str) -> Any:
    """The value of one of aiperf's per-request metrics, None where it has none."""
    return metrics[name]["value"] if name in metrics else None


def read_aiperf(path: Path) -> dict[Key, Rec]:
    """The requests of aiperf's profile_export.jsonl that have a TTFT (failed ones have none)."""
    out: dict[Key, Rec] = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        m, meta = rec["metrics"], rec["metadata"]
        if _metric(m, "time_to_first_token") is None:
            continue
        names = ("usage_prompt_tokens", "usage_prompt_cache_read_tokens", "usage_completion_tokens")
        prompt, cached, completion = (int(_metric(m, n) or 0) for n in names)
        out[(meta["conversation_id"], int(meta["turn_index"]))] = Rec(
            float(_metric(m, "time_to_first_token")),
            _metric(m, "inter_token_latency"),
            tuple(_metric(m, "inter_chunk_latency") or ()),
            (prompt, cached, completion),
        )
    return out


def _p(xs: Sequence[float]) -> str:
    if not xs:
        return "-"
    return " / ".join(f"{v:.0f}" for v in np.percentile(np.asarray(xs, dtype=float), [50, 90, 99]))


def compare(runs: Sequence[tuple[str, dict[Key, Rec]]]) -> str:
    """The table: every run against the first one, on the requests that both completed."""
    ref_name, ref = runs[0]
    head = (
        "run",
        f"paired (same tokens as {ref_name})",
        "TTFT p50/p90/p99 ms",
        "mean gap per request p50/p90/p99 ms",
        "all gaps p50/p90/p99 ms",
        "TTFT / first run's: p50 (p10-p90)",
    )
    rows = []
    for name, recs in runs:
        keys = sorted(set(recs) & set(ref))
        same = sum(recs[k].tokens == ref[k].tokens for k in keys)
        ratios = [recs[k].ttft_ms / ref[k].ttft_ms for k in keys if ref[k].ttft_ms > 0]
        q50, q10, q90 = np.percentile(ratios, [50, 10, 90]) if ratios else (np.nan,) * 3
        rows.append(
            (
                name,
                f"{len(keys)} of {len(recs)} ({same})",
                _p([recs[k].ttft_ms for k in keys]),
                _p([g for k in keys if (g := recs[k].mean_gap_ms) is not None]),
                _p([g for k in keys for g in recs[k].gaps_ms]),
                f"{q50:.2f} ({q10:.2f}-{q90:.2f})",
            )
        )
    widths = [max(len(r[c]) for r in (head, *rows)) for c in range(len(head))]

    def fmt(row: Sequence[str]) -> str:
        return " | ".join(v.ljust(w) if c == 0 else v.rjust(w) for c, (v, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(head), "-+-".join("-" * w for w in widths), *map(fmt, rows)])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    ap.add_argument("--load", type=Path, action="append", default=[], help="replay.py's results.json")
    ap.add_argument("--aiperf", type=Path, action="append", default=[], help="aiperf's profile_export.jsonl")
    args = ap.parse_args(argv)
    if not args.load or not args.aiperf:
        ap.error("give at least one --load and one --aiperf")
    runs = [(f"replay.py #{i + 1}", read_load(p)) for i, p in enumerate(args.load)]
    runs += [(f"aiperf #{i + 1}", read_aiperf(p)) for i, p in enumerate(args.aiperf)]
    print(compare(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
