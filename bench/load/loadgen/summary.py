"""A run's numbers from its request records: counts, latency percentiles, throughput, goodput, and the
inter-token gaps split by whether a long prefill ran meanwhile."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .runner import RequestRecord

LONG_PROMPT_TOKENS = 512  # default --long-prompt-tokens: an uncached prompt this long is a long prefill


def percentiles(xs: Sequence[float], ps: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    """mean, median, std, max and each percentile p ("p99", "p99.9") of xs times scale; all None for no xs."""
    import numpy as np

    keys = ["mean", "median", "std", "max", *(f"p{p:g}" for p in ps)]
    if not xs:
        return dict.fromkeys(keys)
    a = np.asarray(xs, dtype=float) * scale
    values = [a.mean(), np.median(a), a.std(), a.max(), *np.percentile(a, list(ps))]
    return {k: float(v) for k, v in zip(keys, values)}


def _pcts(xs: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    p = percentiles(xs, (50, 90, 99), scale)
    return {k: p[k] for k in ("p50", "p90", "p99", "mean", "max")}


def tpot_s(r: RequestRecord) -> float | None:
    """Mean gap between token-carrying chunks of one request (None with fewer than two chunks)."""
    return sum(r.itl_s) / len(r.itl_s) if r.itl_s else None


def long_prefills(reqs: Sequence[RequestRecord], min_new_tokens: int) -> list[tuple[float, float]]:
    """(send, first token) in seconds since the run's start, of each ok request whose uncached prompt
    has at least `min_new_tokens` tokens: the spans in which a long prompt was being prefilled."""
    return sorted(
        (r.start_s, r.start_s + r.ttft_s)
        for r in reqs
        if r.status == "ok"
        and r.start_s is not None
        and r.ttft_s is not None
        and (r.prompt_tokens or 0) - (r.cached_tokens or 0) >= min_new_tokens
    )


def gap_spans(r: RequestRecord) -> list[tuple[float, float]]:
    """(begin, end) of each inter-token gap of a request, in seconds since the run's start."""
    if r.start_s is None or r.ttft_s is None:
        return []
    t, out = r.start_s + r.ttft_s, []
    for g in r.itl_s:
        out.append((t, t + g))
        t += g
    return out


def split_gaps(
    reqs: Sequence[RequestRecord], windows: Sequence[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """Inter-token gaps (s) of the ok requests that overlap one of `windows`, and those that overlap none."""
    inside: list[float] = []
    outside: list[float] = []
    for r in reqs:
        if r.status != "ok":
            continue
        for a, b in gap_spans(r):
            # NOTE: a request's own prefill ends at its first token, before its first gap begins
            (inside if any(a < w1 and b > w0 for w0, w1 in windows) else outside).append(b - a)
    return inside, outside


def is_good(r: RequestRecord, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> bool:
    if r.status != "ok" or r.ttft_s is None:
        return False
    if slo_ttft_ms is not None and r.ttft_s * 1e3 > slo_ttft_ms:
        return False
    t = tpot_s(r)
    return slo_itl_ms is None or t is None or t * 1e3 <= slo_itl_ms


def summarize(
    reqs: Sequence[RequestRecord],
    slo_ttft_ms: float | None = None,
    slo_itl_ms: float | None = None,
    long_prompt_tokens: int = LONG_PROMPT_TOKENS,
) -> dict[str, Any]:
    """The run's numbers: counts, latency percentiles (ms), throughput over the busy span, goodput,
    and the inter-token gaps split by whether a long prefill ran meanwhile."""
    ok = [r for r in reqs if r.status == "ok"]
    sent = [r for r in reqs if r.start_s is not None]
    ends = [r.start_s + r.e2e_s for r in ok if r.start_s is not None and r.e2e_s is not None]
    span_s = (max(ends) - min(r.start_s for r in sent if r.start_s is not None)) if ends else 0.0
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    completion = sum(r.completion_tokens or 0 for r in ok)
    num_good = sum(is_good(r, slo_ttft_ms, slo_itl_ms) for r in ok)
    windows = long_prefills(reqs, long_prompt_tokens)
    gaps_in, gaps_out = split_gaps(reqs, windows)

    def per_s(x: float) -> float | None:
        return x / span_s if span_s > 0 else None

    return {
        "num_planned": len(reqs),
        "num_sent": len(sent),
        "num_ok": len(ok),
        "num_errors": sum(r.status == "error" for r in reqs),
        "num_cancelled": sum(r.status == "cancelled" for r in reqs),
        "num_skipped": sum(r.status == "skipped" for r in reqs),
        "duration_s": span_s,
        "ttft_ms": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _pcts([g for r in ok for g in r.itl_s]),
        "itl_in_long_prefill_ms": _pcts(gaps_in),
        "itl_outside_long_prefill_ms": _pcts(gaps_out),
        "long_prompt_tokens": long_prompt_tokens,
        "num_long_prefills": len(windows),
        "tpot_ms": _pcts([t for r in ok if (t := tpot_s(r)) is not None]),
        "e2e_ms": _pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "output_tokens_per_s": per_s(completion),
        "total_tokens_per_s": per_s(prompt + completion),
        "requests_per_s": per_s(len(ok)),
        "goodput_requests_per_s": per_s(num_good),
        "goodput_fraction": num_good / len(ok) if ok else None,
        "prefix_cache_hit_rate": cached / prompt if prompt else None,
    }
