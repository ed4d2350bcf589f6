#!/usr/bin/env python3
"""The same multi-turn trace against several endpoints or server configurations, side by side.

Each target is a running endpoint (`--target NAME=URL`, e.g. the P/D pair's CE) or a single-engine
server this script starts for its turn and stops after (`--launch NAME='pd.server flags'`, e.g. the
colocated engine with the same total ranks, or the prefix cache off). `--extra NAME=JSON` adds fields
to that target's requests (`'{"prefix_cache": false}'`: pdserve's per-request cache switch);
`--setup NAME=CMD` and `--teardown NAME=CMD` are shell commands run before and after each of that
target's runs (e.g. pinning the target's processes to cores with taskset, and unpinning them). Runs
never overlap. By default each target runs every load point of the sweep (`--concurrency 1,4,8` or
`--request-rate ...`) before the next target starts; `--interleave` runs every target at one load
point before the next point (all targets up at once), so a slow drift of the machine (other work on
shared cores) spreads over every target instead of landing on one. The trace and request flags are
bench/load/replay.py's (`--help` lists them).

    python bench/load/compare.py --target colocated=http://127.0.0.1:8888 --target pd=http://127.0.0.1:8889 \\
        --trace synthetic --conversations 32 --turns 6 --concurrency 1,4,8 --out bench/results/compare
    python bench/load/compare.py --launch 'dp2=--model smollm2-135m-instruct --dp 2' \\
        --launch 'dp2-nocache=--model smollm2-135m-instruct --dp 2 --hicache-gb 0' --concurrency 2,4 ...

Every run of a comparison starts its conversations with a marker of the target and load point (a few
tokens in front of the first user message), so no run hits prefix-cache entries an earlier run left.
Writes into --out what bench/load/replay.py writes (results.json with one run per target and load point,
labelled `NAME c=4`, summary.txt, distributions.png, throughput.png, sweep.png with one line per
target), compare.png (p50 and p90 TTFT, p90 ITL, p90 ITL of the gaps that overlap a long prefill,
output tokens/s and the prefix-cache hit rate, per target at each load point) and itl_timeline.png (at the highest load point, every
inter-token gap of each target against time, the long prefills shaded).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script without the project installed
    sys.path.insert(0, str(REPO))

from bench.load.loadgen import cli, plots, report, runner, summary  # noqa: E402


def _named(items: Sequence[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"{flag} takes NAME=VALUE, not {item!r}")
        out[name] = value
    return out


@contextlib.contextmanager
def endpoint(url: str | None, launch_args: str | None, log_dir: Path | None) -> Iterator[str]:
    """The URL of a running target, or of a server started for the duration of the block."""
    if url is not None:
        yield url
        return
    from pd.tools.server_process import ServerProcess

    log = log_dir / "server.log" if log_dir else None
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
    with ServerProcess(*shlex.split(launch_args or ""), log_path=log) as server:
        yield server.url


def run_hook(cmd: str | None, what: str) -> None:
    """A --setup/--teardown command; its failure ends the comparison."""
    if cmd:
        print(f"[{what}] {cmd}", flush=True)
        subprocess.run(cmd, shell=True, check=True)


def plot_compare(path: Path, series: dict[str, list[dict[str, Any]]]) -> Path:
    """Grouped bars: p50 and p90 TTFT, p90 ITL (all gaps, and those overlapping a long prefill), output
    tokens/s and the prefix-cache hit rate of each target at each load point."""
    plt = plots.pyplot()
    points = sorted({plots.load_of(r) for runs in series.values() for r in runs})
    fig, axes = plt.subplots(1, 6, figsize=(22, 3.6))
    width = 0.8 / max(1, len(series))
    panels = (
        ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"]),
        ("TTFT p90 (ms)", lambda s: s["ttft_ms"]["p90"]),
        ("inter-token gap p90 (ms)", lambda s: s["itl_ms"]["p90"]),
        ("gap p90 during long prefills (ms)", lambda s: s["itl_in_long_prefill_ms"]["p90"]),
        ("output tokens/s", lambda s: s["output_tokens_per_s"]),
        ("prefix-cache hit rate (%)", lambda s: 100 * (s["prefix_cache_hit_rate"] or 0.0)),
    )
    for ax, (title, get) in zip(axes, panels):
        for k, (name, runs) in enumerate(series.items()):
            by_load = {plots.load_of(r): get(r["summary"]) for r in runs}
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(points))]
            ax.bar(xs, [by_load.get(p) or 0.0 for p in points], width, label=name)
        ax.set_xticks(range(len(points)), [f"{p:g}" for p in points])
        ax.set_xlabel("load (concurrency or conversations/s)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_itl_timeline(path: Path, series: dict[str, list[dict[str, Any]]]) -> Path:
    """At the highest load point: every inter-token gap (ms, at the time it ended) of each target,
    one panel a target, with the spans of long prefills shaded (overlaps darker)."""
    plt = plots.pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig, axes = plt.subplots(len(series), 1, figsize=(10, 2.4 * len(series)), squeeze=False, sharey=True)
    for ax, runs in zip(axes[:, 0], series.values()):
        run = max(runs, key=plots.load_of)
        reqs = [runner.RequestRecord(**r) for r in run["requests"]]
        s = run["summary"]
        for a, b in summary.long_prefills(reqs, s["long_prompt_tokens"]):
            ax.axvspan(a, b, color="tab:orange", alpha=0.15, lw=0)
        # gaps under 1 ms (chunks that arrived together) drawn at 1 ms: the axis is logarithmic
        ends = [
            (b, max(1.0, (b - a) * 1e3)) for r in reqs if r.status == "ok" for a, b in summary.gap_spans(r)
        ]
        ax.scatter([t for t, _ in ends], [g for _, g in ends], s=2, color="tab:blue")
        ax.set_title(
            f"{run['label']}: {s['num_long_prefills']} long prefills (>= {s['long_prompt_tokens']} new "
            "prompt tokens, shaded)",
            fontsize=9,
        )
        ax.set_ylabel("gap (ms)")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time since the run's start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    ap.add_argument("--target", action="append", default=[], help="NAME=URL of a running endpoint")
    ap.add_argument(
        "--launch", action="append", default=[], help="NAME='pd.server flags': started for its runs"
    )
    ap.add_argument(
        "--extra", action="append", default=[], help="NAME=JSON merged into that target's requests"
    )
    ap.add_argument("--setup", action="append", default=[], help="NAME=CMD run before each of its runs")
    ap.add_argument("--teardown", action="append", default=[], help="NAME=CMD run after each of its runs")
    ap.add_argument(
        "--interleave", action="store_true", help="every target at a load point before the next point"
    )
    ap.add_argument("--out", type=Path, required=True)
    cli.add_trace_args(ap)
    cli.add_request_args(ap)
    args = ap.parse_args(argv)
    urls, launches = _named(args.target, "--target"), _named(args.launch, "--launch")
    extras = {k: json.loads(v) for k, v in _named(args.extra, "--extra").items()}
    setups, teardowns = _named(args.setup, "--setup"), _named(args.teardown, "--teardown")
    names = list(urls) + [n for n in launches if n not in urls]
    if not names or set(urls) & set(launches) or (set(extras) | set(setups) | set(teardowns)) - set(names):
        ap.error("give distinct target names with --target/--launch; --extra/--setup/--teardown name one")
    convs, trace_info = cli.trace_from_args(args)
    points = cli.load_points(args)
    base_extra = cli.extra_body_from_args(args)
    # (target, load point index) in the order they run: target-major, or point-major with --interleave
    order = [(n, i) for i in range(len(points)) for n in names] if args.interleave else None
    groups = [order] if order else [[(n, i) for i in range(len(points))] for n in names]
    runs: list[runner.RunResult] = []
    series_names: list[str] = []
    for group in groups:
        with contextlib.ExitStack() as stack:
            chats: dict[str, tuple[str, str]] = {}  # name -> (chat URL, model)
            for name in dict.fromkeys(n for n, _ in group):
                url = stack.enter_context(
                    endpoint(urls.get(name), launches.get(name), args.out / "servers" / name)
                )
                chat = cli.chat_url(url)
                chats[name] = (chat, args.model or cli.server_model(chat))
                extra = base_extra | extras.get(name, {})
                run_hook(setups.get(name), f"setup {name}")
                asyncio.run(runner.warm_up(chat, chats[name][1], args.warmup, extra))
                run_hook(teardowns.get(name), f"teardown {name}")
            for name, i in group:
                c, r = points[i]
                label = f"{name} {cli.point_label(c, r)}"
                extra = base_extra | extras.get(name, {})
                cfg = runner.LoadConfig.from_args(
                    args, chats[name][0], chats[name][1], c, r, extra, label, cli.run_salt(name, i)
                )
                run_hook(setups.get(name), f"setup {name}")
                try:
                    runs.append(asyncio.run(runner.run_load(cfg, convs)))
                finally:
                    run_hook(teardowns.get(name), f"teardown {name}")
                series_names.append(name)
                s = summary.summarize(
                    runs[-1].requests, args.slo_ttft_ms, args.slo_itl_ms, args.long_prompt_tokens
                )
                print(report.format_table([(label, s)]).splitlines()[-1], flush=True)
                print(report.format_itl_split([(label, s)]).splitlines()[-1], flush=True)
                if runs[-1].host_loadavg_1m:
                    a, b = runs[-1].host_loadavg_1m
                    print(f"host load average {a:.1f} -> {b:.1f}", flush=True)
    doc = report.results_doc(
        runs,
        trace_info,
        args.slo_ttft_ms,
        args.slo_itl_ms,
        sys.argv if argv is None else argv,
        args.long_prompt_tokens,
    )
    series: dict[str, list[dict[str, Any]]] = {}
    for name, run in zip(series_names, doc["runs"]):
        run["target"] = name
        series.setdefault(name, []).append(run)
    table = report.write_outputs(args.out, doc, series, plots=not args.no_plots)
    if not args.no_plots:
        plot_compare(args.out / "compare.png", series)
        plot_itl_timeline(args.out / "itl_timeline.png", series)
    print(f"\n{table}\n\nresults in {args.out}/")
    return 1 if any(r["summary"]["num_errors"] for r in doc["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
