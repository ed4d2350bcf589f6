"""Prometheus metrics of the server, per rank: latencies observed here, engine state as the ranks report it.
An engine stat named `*_total` is a counter (`# TYPE x_total counter`, as prometheus_client writes one); every
other numeric stat is a gauge. The speculative-decoding stats (`spec_*`) are exported only for ranks that
speculate, their per-position counts as pdserve_engine_spec_accepted_per_position{position}. The series vLLM's
tooling reads are in vllm_metrics.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pd.disagg.kv_choice import KVAwareChoice, KVIndexCollector
from pd.frontend.vllm_metrics import (
    CacheConfigInfo,
    VllmEngineCollector,
    VllmRequestSeries,
    accepted_per_position,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_REQUEST_LABELS = ["model_name", "rank"]  # model_name: the served name, as /v1/models lists it

# engine stats with a name of their own; every other numeric field is exported as pdserve_engine_<field>
_NAMED_STATS = {
    "num_running": ("pdserve_num_requests_running", "Requests the engine is running"),
    "num_waiting": ("pdserve_num_requests_waiting", "Requests waiting in the engine's queue"),
    "kv_usage": ("pdserve_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1)"),
    "num_free_blocks": ("pdserve_kv_free_blocks", "Free KV blocks"),
    "num_total_blocks": ("pdserve_kv_total_blocks", "KV blocks in the pool"),
}


@dataclass(frozen=True)
class RankSnapshot:
    index: int
    is_up: bool
    num_inflight: int
    stats: dict[str, Any] = field(default_factory=dict)
    num_restarts: int = 0  # times the server started the rank's process again after it died
    max_model_len: int = 0  # as the rank reported it when ready; 0 before


class _RankCollector:
    """Reads the latest per-rank state at scrape time."""

    def __init__(self, snapshot: Callable[[], list[RankSnapshot]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        ranks = self.snapshot()
        up = GaugeMetricFamily(
            "pdserve_rank_up", "1 if the rank's engine process is serving", labels=["rank"]
        )
        inflight = GaugeMetricFamily(
            "pdserve_num_requests_inflight", "Requests the server has sent to the rank", labels=["rank"]
        )
        restarts = CounterMetricFamily(
            "pdserve_rank_restarts", "Times the rank's dead engine process was started again", labels=["rank"]
        )
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for r in ranks:
            label = [str(r.index)]
            up.add_metric(label, 1.0 if r.is_up else 0.0)
            inflight.add_metric(label, float(r.num_inflight))
            restarts.add_metric(label, float(r.num_restarts))
            speculates = bool(accepted_per_position(r.stats))
            for key, value in sorted(r.stats.items()):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if key.startswith("spec_") and not speculates:
                    continue
                name, doc = _NAMED_STATS.get(key, (f"pdserve_engine_{key}", f"Engine stat {key}"))
                if name not in families:
                    kind = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
                    families[name] = kind(name, doc, labels=["rank"])
                families[name].add_metric(label, float(value))
        yield up
        yield inflight
        yield restarts
        yield from families.values()
        yield from _speculation_families(ranks)
        yield from _moe_families(ranks)


def _speculation_families(ranks: list[RankSnapshot]) -> Iterator[Metric]:
    """Ranks that speculate: the drafts accepted at each draft position (position 0 first)."""
    family = CounterMetricFamily(
        "pdserve_engine_spec_accepted_per_position",
        "Drafts whose token at this position was accepted (--speculative-config; position 0 first)",
        labels=["rank", "position"],
    )
    for r in ranks:
        for k, n in enumerate(accepted_per_position(r.stats)):
            family.add_metric([str(r.index), str(k)], float(n))
    if family.samples:
        yield family


def _moe_families(ranks: list[RankSnapshot]) -> Iterator[Metric]:
    """MoE models: the experts' load per layer, from every rank's counts (engine/layers/moe.py)."""
    tokens: dict[tuple[int, int], float] = {}  # (layer, expert) -> assignments, all ranks
    rows: dict[tuple[int, int], float] = {}  # (layer, rank) -> rows its experts computed
    for r in ranks:
        layers = r.stats.get("moe_layers") or ()
        for i, layer in enumerate(layers):
            for e, n in enumerate(r.stats["moe_tokens_per_expert"][i]):
                tokens[layer, e] = tokens.get((layer, e), 0.0) + n
            rows[layer, r.index] = float(r.stats["moe_rows_computed"][i])
    if not tokens:
        return
    expert_tokens = CounterMetricFamily(
        "pdserve_moe_expert_tokens", "Tokens routed to each expert (one per top-k slot), all ranks",
        labels=["layer", "expert"],
    )  # fmt: skip
    for (layer, e), n in sorted(tokens.items()):
        expert_tokens.add_metric([str(layer), str(e)], n)
    rank_rows = CounterMetricFamily(
        "pdserve_moe_rank_rows", "Rows each rank's experts computed (--ep: for every rank's tokens)",
        labels=["layer", "rank"],
    )  # fmt: skip
    for (layer, rank), n in sorted(rows.items()):
        rank_rows.add_metric([str(layer), str(rank)], n)
    yield expert_tokens
    yield rank_rows
    for name, doc, per_layer in (
        ("pdserve_moe_expert_imbalance", "Max over mean of the experts' tokens, per layer (1: even)", tokens),
        ("pdserve_moe_rank_imbalance", "Max over mean of the ranks' expert rows, per layer (--ep; 1: even)", rows),
    ):
        gauge = GaugeMetricFamily(name, doc, labels=["layer"])
        for layer in sorted({key[0] for key in per_layer}):
            values = [n for key, n in per_layer.items() if key[0] == layer]
            mean = sum(values) / len(values)
            gauge.add_metric([str(layer)], max(values) / mean if mean else 1.0)
        yield gauge


class ServerMetrics:
    """Request metrics are labelled with the served model's name, as vLLM's are, so one dashboard tells
    deployments of different models apart."""

    def __init__(
        self, snapshot: Callable[[], list[RankSnapshot]], model_name: str, cache: CacheConfigInfo | None = None
    ) -> None:
        """cache: the settings vllm:cache_config_info shows; None: no such series."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft_s = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Arrival to first token",
            _REQUEST_LABELS,
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl_s = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between output tokens",
            _REQUEST_LABELS,
            buckets=_ITL_BUCKETS_S,
            registry=r,
        )
        self.e2e_s = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Arrival to last token",
            _REQUEST_LABELS,
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_s = Histogram(
            "pdserve_request_queue_time_seconds",
            "Arrival to the engine's first scheduling of the request",
            _REQUEST_LABELS,
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests", _REQUEST_LABELS, registry=r
        )
        self.cached_tokens = Counter(
            "pdserve_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            _REQUEST_LABELS,
            registry=r,
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Generated tokens", _REQUEST_LABELS, registry=r
        )
        self.requests = Counter(
            "pdserve_requests", "Finished engine requests", [*_REQUEST_LABELS, "finish_reason"], registry=r
        )
        self.http_errors = Counter("pdserve_http_errors", "Error responses", ["status"], registry=r)
        self.rank_selected = Counter(
            "pdserve_rank_selected",
            "Requests sent to each engine rank, by why it was chosen (--routing): affinity (the conversation's "
            "rank), least-loaded (that policy, or a request without a conversation key), kv-hit | kv-miss "
            "(kv-aware: the cheapest rank holds some of the prompt | none does)",
            ["rank", "reason"],
            registry=r,
        )
        self.kv_choice: KVAwareChoice | None = None  # --routing kv-aware: the rank choice's (the PE choice's: pdserve_pe_kv_*)
        r.register(KVIndexCollector(lambda: self.kv_choice, "pdserve_rank", None, "rank"))
        r.register(_RankCollector(snapshot))  # type: ignore[arg-type]
        self.vllm = VllmRequestSeries(r)
        r.register(VllmEngineCollector(snapshot, model_name, cache))  # type: ignore[arg-type]

    def render(self) -> bytes:
        return generate_latest(self.registry)
