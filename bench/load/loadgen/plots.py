"""The PNGs of a run or a sweep, drawn from results.json's run documents."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_axis(ax: Any, which: str) -> None:
    """Log scale, labelled at 1, 2 and 5 of each decade as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _cdf(ax: Any, xs: Sequence[float], label: str) -> None:
    if xs:
        s = sorted(xs)
        ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", label=label)


def token_times(r: dict[str, Any]) -> list[tuple[float, float]]:
    """(arrival since the run's start, tokens) of each token-carrying chunk; the usage's completion
    tokens spread evenly over the chunks, so the chunks add up to the server's count."""
    if r["status"] != "ok" or r["ttft_s"] is None or not r["num_chunks"]:
        return []
    t = r["start_s"] + r["ttft_s"]
    per_chunk = (r["completion_tokens"] or 0) / r["num_chunks"]
    out = [(t, per_chunk)]
    for g in r["itl_s"]:
        t += g
        out.append((t, per_chunk))
    return out


def plot_runs(out_dir: Path, runs: Sequence[dict[str, Any]]) -> list[Path]:
    """distributions.png (TTFT and ITL CDFs) and throughput.png (output tokens/s, 1 s bins), one line a run."""
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for run in runs:
        ok = [r for r in run["requests"] if r["status"] == "ok"]
        _cdf(a1, [r["ttft_s"] * 1e3 for r in ok if r["ttft_s"] is not None], run["label"])
        _cdf(a2, [g * 1e3 for r in ok for g in r["itl_s"]], run["label"])
    for ax, name in ((a1, "TTFT (ms)"), (a2, "inter-token gap (ms)")):
        _log_axis(ax, "x")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests" if ax is a1 else "fraction of gaps")
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.tight_layout()
    paths = [out_dir / "distributions.png"]
    fig.savefig(paths[0], dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    times = {run["label"]: [tn for r in run["requests"] for tn in token_times(r)] for run in runs}
    end_s = max((t for tns in times.values() for t, _ in tns), default=1.0)
    bin_s = max(1, round(end_s / 60))  # about 60 bins
    for label, tns in times.items():
        bins = [0.0] * (int(end_s // bin_s) + 1)
        for t, n in tns:
            bins[int(t // bin_s)] += n / bin_s
        ax.plot([i * bin_s for i in range(len(bins))], bins, drawstyle="steps-post", label=label)
    ax.set_xlabel("time since the run's start (s)")
    ax.set_ylabel(f"output tokens/s ({bin_s} s bins)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[1], dpi=80)
    plt.close(fig)
    return paths


def load_of(run: dict[str, Any]) -> float:
    load = run["load"]
    return float(load["concurrency"] if load["request_rate"] is None else load["request_rate"])


def plot_sweep(path: Path, series: dict[str, list[dict[str, Any]]]) -> Path:
    """Latency against load: p50 and p90 TTFT and ITL, one line per configuration (series name)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    xlabel = "load"
    for name, runs in series.items():
        runs = sorted(runs, key=load_of)
        xs = [load_of(r) for r in runs]
        xlabel = (
            "request rate (conversations/s)"
            if runs[0]["load"]["request_rate"]
            else "concurrent conversations"
        )
        for ax, key in zip(axes, ("ttft_ms", "itl_ms")):
            (line,) = ax.plot(xs, [r["summary"][key]["p50"] for r in runs], "o-", label=f"{name} p50")
            ax.plot(
                xs,
                [r["summary"][key]["p90"] for r in runs],
                "s--",
                color=line.get_color(),
                label=f"{name} p90",
            )
    loads = sorted({load_of(r) for runs in series.values() for r in runs})
    for ax, title in zip(axes, ("TTFT (ms)", "inter-token gap (ms)")):
        ax.set_xticks(loads, [f"{x:g}" for x in loads])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(title)
        _log_axis(ax, "y")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
