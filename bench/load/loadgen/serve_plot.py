"""`pdserve bench serve`'s plot: one SVG, written by hand (the serving install has no plotting library), with
one panel per metric (TTFT, TPOT, ITL, E2EL): the metric's CDF over the run's samples in ms, its median and
p99 marked and labelled.

    ┌ TTFT (ms), 200 samples ─┐ ┌ TPOT ... ┐      y: the share of samples at or below x (0 to 1)
    │        ____----‾‾‾‾     │ │          │      x: 0 to a round number above the largest sample
    │    __--  ¦p50    ¦p99   │ │          │
    └─────────────────────────┘ └──────────┘
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from xml.sax.saxutils import escape

from .serving import METRICS

PANEL_W, PANEL_H = 470, 280
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 56, 16, 34, 40  # inside a panel, around its plot area
COLUMNS = 2
MAX_STEPS = 1000  # a CDF of more samples is drawn through this many quantiles (a file of kilobytes, not megabytes)
TITLE_H = 36
LINE_COLOUR, MARK_COLOUR, GRID_COLOUR = "#1f77b4", "#d62728", "#dddddd"


def nice_ceiling(x: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten that is >= x (1 for x <= 0)."""
    if x <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(x))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= x * (1 - 1e-12))


def quantile(sorted_xs: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of sorted_xs by linear interpolation (numpy's default)."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _panel(name: str, values_ms: Sequence[float], x0: float, y0: float) -> list[str]:
    """One metric's panel, its top left corner at (x0, y0)."""
    label = METRICS[name][1]
    left, top = x0 + MARGIN_L, y0 + MARGIN_T
    width, height = PANEL_W - MARGIN_L - MARGIN_R, PANEL_H - MARGIN_T - MARGIN_B
    out = [f'<g class="panel" id="{name}">',
           f'<text x="{x0 + PANEL_W / 2:.1f}" y="{y0 + 20:.1f}" text-anchor="middle" font-weight="bold">'
           f'{escape(label)} (ms), {len(values_ms)} samples</text>',
           f'<rect x="{left:.1f}" y="{top:.1f}" width="{width:.1f}" height="{height:.1f}" fill="none" stroke="#000"/>']  # fmt: skip
    xs = sorted(values_ms)
    x_max = nice_ceiling(xs[-1]) if xs else 1.0

    def px(v: float) -> float:
        return left + width * v / x_max

    def py(share: float) -> float:
        return top + height * (1 - share)

    for i in range(6):  # x ticks: 0 to x_max in fifths; y ticks: quarters
        v = x_max * i / 5
        out.append(f'<line x1="{px(v):.1f}" y1="{top:.1f}" x2="{px(v):.1f}" y2="{top + height:.1f}" stroke="{GRID_COLOUR}"/>')
        out.append(f'<text x="{px(v):.1f}" y="{top + height + 16:.1f}" text-anchor="middle">{_fmt(v)}</text>')
    for i in range(5):
        s = i / 4
        out.append(f'<line x1="{left:.1f}" y1="{py(s):.1f}" x2="{left + width:.1f}" y2="{py(s):.1f}" stroke="{GRID_COLOUR}"/>')
        out.append(f'<text x="{left - 6:.1f}" y="{py(s) + 4:.1f}" text-anchor="end">{s:g}</text>')
    out.append(f'<text x="{left + width / 2:.1f}" y="{top + height + 32:.1f}" text-anchor="middle">ms</text>')
    if not xs:
        out.append(f'<text x="{left + width / 2:.1f}" y="{top + height / 2:.1f}" text-anchor="middle">no samples</text>')
        return [*out, "</g>"]
    # the empirical CDF as steps: flat at (i / n) until sample i, then up to (i + 1) / n
    points = [(px(0), py(0))]
    if len(xs) <= MAX_STEPS:
        for i, v in enumerate(xs):
            points += [(px(v), py(i / len(xs))), (px(v), py((i + 1) / len(xs)))]
    else:
        points += [(px(quantile(xs, k / MAX_STEPS)), py(k / MAX_STEPS)) for k in range(MAX_STEPS + 1)]
    points.append((px(x_max), py(1)))
    out.append(f'<polyline class="cdf" fill="none" stroke="{LINE_COLOUR}" stroke-width="1.5" points="'
               + " ".join(f"{x:.1f},{y:.1f}" for x, y in points) + '"/>')  # fmt: skip
    for q, anchor in ((0.5, "end"), (0.99, "start")):
        v = quantile(xs, q)
        tag = f"p{q * 100:g}"
        out.append(f'<line class="mark" data-quantile="{tag}" data-ms="{v:.6g}" x1="{px(v):.1f}" y1="{top:.1f}" '
                   f'x2="{px(v):.1f}" y2="{top + height:.1f}" stroke="{MARK_COLOUR}" stroke-dasharray="4 3"/>')  # fmt: skip
        dx = -4 if anchor == "end" else 4
        y = top + 14 if q == 0.5 else top + 30
        out.append(f'<text x="{px(v) + dx:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{MARK_COLOUR}">{tag} {_fmt(v)}</text>')
    return [*out, "</g>"]


def serve_svg(values_ms: Mapping[str, Sequence[float]], title: str) -> str:
    """The SVG document: a title, then one panel per metric of values_ms (in METRICS' order), two a row."""
    names = [n for n in METRICS if n in values_ms]
    rows = max(1, math.ceil(len(names) / COLUMNS))
    width, height = COLUMNS * PANEL_W, TITLE_H + rows * PANEL_H
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="#fff"/>',
           f'<text x="{width / 2:.1f}" y="24" text-anchor="middle" font-size="15">{escape(title)}</text>']  # fmt: skip
    for k, name in enumerate(names):
        out += _panel(name, values_ms[name], (k % COLUMNS) * PANEL_W, TITLE_H + (k // COLUMNS) * PANEL_H)
    return "\n".join([*out, "</svg>", ""])


def write_serve_svg(path: Path, values_s: Mapping[str, Sequence[float]], title: str) -> Path:
    """Writes serve_svg of the metrics' samples, given in seconds, to path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(serve_svg({n: [v * 1e3 for v in vs] for n, vs in values_s.items()}, title))
    return path
