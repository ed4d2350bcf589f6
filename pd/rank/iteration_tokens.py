"""Tokens per engine step, counted as vLLM counts them for `vllm:iteration_tokens_total` (its
IterationStats): a step's generated tokens plus the prompt of each sequence whose prefill the step began
(cache hits included, as the engine's prompt counter counts them), so a request of P prompt tokens and G
output tokens adds P + G over G steps. Steps that add nothing (an expert-parallel group's idle forward) are
not observed. The rank keeps the histogram; its stats carry it to the server (pd/frontend/vllm_metrics.py)."""

from __future__ import annotations

import bisect
from typing import Any

# vLLM v1's buckets for the series (vllm/v1/metrics/loggers.py; its --enforce-eager list: pdserve's CUDA
# graphs are bucketed by sequences, not by tokens)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STATS_KEY = "iteration_tokens"


class IterationTokens:
    """A histogram of the steps' token counts, from the engine's cumulative token counters."""

    def __init__(self, num_tokens_total: int = 0) -> None:
        self.last_total = num_tokens_total
        self.counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)  # per bucket (not cumulative), +Inf last
        self.sum = 0

    def observe(self, num_tokens_total: int) -> None:
        """After a step: num_tokens_total, the engine's prompt plus generated tokens counted so far."""
        n, self.last_total = num_tokens_total - self.last_total, num_tokens_total
        if n > 0:
            self.counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, n)] += 1
            self.sum += n

    def stats(self) -> dict[str, Any]:
        return {STATS_KEY: {"counts": list(self.counts), "sum": self.sum}}


def cumulative_buckets(stats: dict[str, Any]) -> tuple[list[tuple[float, int]], int] | None:
    """A rank's histogram as Prometheus writes it, ([(le, observations <= le), ..., (inf, all)], sum);
    None before the rank has reported one."""
    h = stats.get(STATS_KEY)
    if not isinstance(h, dict):
        return None
    out, total = [], 0
    for le, n in zip((*ITERATION_TOKENS_BUCKETS, float("inf")), h["counts"]):
        total += n
        out.append((float(le), total))
    return out, int(h["sum"])
