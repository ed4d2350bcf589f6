"""What a run leaves behind: the summary tables, results.json and the files written into --out."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .plots import plot_runs, plot_sweep
from .runner import RunResult
from .summary import LONG_PROMPT_TOKENS, summarize

SCHEMA = "pdserve-load/1"


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


TTFT_PHASES = ("queue", "prefill", "transfer", "transfer_after_prefill", "first_decode")


def format_ttft_phases(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One line per run of a P/D endpoint: the mean of each TTFT phase its /metrics observed during the run
    (transfer: the whole handoff, which a streamed one overlaps with the prefill; transfer after prefill:
    what the handoff added to TTFT). "" when no run has them."""
    if not any(s.get("ttft_phases_ms") for _, s in rows):
        return ""
    head = ("run", *(f"{p.replace('_', ' ')} ms" for p in TTFT_PHASES))
    body = [
        (label, *(_f((s.get("ttft_phases_ms") or {}).get(p), ".1f") for p in TTFT_PHASES)) for label, s in rows
    ]
    return "TTFT phases (P/D, means from the endpoint's /metrics)\n" + _grid(head, body)


def format_speculation(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One line per run of a speculating endpoint (--speculative-config): its drafts over the run, from the
    endpoint's /metrics (vLLM's spec_decode counters); mean accepted length = 1 + accepted / drafts (the
    tokens a sequence gains per verifying step), acceptance rate = accepted / draft tokens. "" when no run
    has them."""
    if not any(s.get("speculation") for _, s in rows):
        return ""
    head = ("run", "drafts", "draft tokens", "accepted tokens", "mean accepted length", "acceptance rate")
    body = []
    for label, s in rows:
        sp = s.get("speculation") or {}
        rate = sp.get("acceptance_rate")
        body.append(
            (
                label,
                _f(sp.get("num_drafts")),
                _f(sp.get("num_draft_tokens")),
                _f(sp.get("num_accepted_tokens")),
                _f(sp.get("mean_accepted_length"), ".2f"),
                "-" if rate is None else f"{rate * 100:.1f}%",
            )
        )
    return "Speculative decoding (from the endpoint's /metrics)\n" + _grid(head, body)


def server_tables(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The tables read from the endpoint's /metrics (TTFT phases, speculative decoding), those that have
    something, each after a blank line; "" when none has."""
    return "".join(f"\n\n{t}" for t in (format_ttft_phases(rows), format_speculation(rows)) if t)


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
        "summary": {
            **summarize(run.requests, slo_ttft_ms, slo_itl_ms, long_prompt_tokens),
            "ttft_phases_ms": run.ttft_phases_ms,
            "speculation": run.speculation,
        },
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


def write_outputs(
    out_dir: Path,
    doc: dict[str, Any],
    series: dict[str, list[dict[str, Any]]] | None = None,
    plots: bool = True,
) -> str:
    """results.json, summary.txt and the plots; returns the tables (the summary, then the ITL split)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [(r["label"], r["summary"]) for r in doc["runs"]]
    table = format_table(rows) + "\n\n" + format_itl_split(rows) + server_tables(rows)
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "summary.txt").write_text(table + "\n")
    if plots:
        plot_runs(out_dir, doc["runs"])
        if series and any(len(v) > 1 for v in series.values()):
            plot_sweep(out_dir / "sweep.png", series)
    return table
