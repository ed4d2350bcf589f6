"""The series vLLM's tooling reads, under vLLM's names, types, labels and buckets: production-stack's
router and dashboards, KEDA examples and llm-d's endpoint picker scrape these and nothing else.

Names and buckets follow vLLM v1's Prometheus logger (vllm/v1/metrics/loggers.py, the "Production
Metrics" page of docs.vllm.ai): labels `model_name` (the served name) and `engine` (the engine core's
index: a rank here). The values are the ones behind pdserve's own series: the request histograms and
token counters are observed at the same points as pdserve_*, the gauges, the preemption counter, the
tokens-per-step histogram (pd/rank/iteration_tokens.py) and the speculative-decoding counters are read from
each rank's latest stats at scrape time. The speculative-decoding
series (vllm/v1/spec_decode/metrics.py) exist only for ranks that speculate (--speculative-config), as vLLM
registers them only then: mean accepted length = 1 + accepted / drafts, acceptance rate = accepted / draft
tokens, position k's rate = accepted_per_pos{position=k} / drafts.

Prefix caches, in tokens as vLLM counts them (queries: the tokens each lookup was asked for; hits: those found):
vllm:prefix_cache_* is the engine's own KV pool (a decode engine's decode cache, --decode-cache),
vllm:external_prefix_cache_* the host tier (--hicache-gb), as vLLM names a KV connector's tier such as
CPU offloading. A single-engine server or a prefill engine looks prompts up in its host tier only; its
vllm:prefix_cache_* stay at 0 and its hits are vllm:external_prefix_cache_hits. Every vllm: series carries
model_name (vLLM's vllm:cache_config_info does not; here it does, so one selector serves the dashboard)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from pd.rank.iteration_tokens import cumulative_buckets

LABELS = ["model_name", "engine"]
# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip




def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class RankView(Protocol):
    """What the gauges read of a rank (frontend/metrics.py's RankSnapshot)."""

    index: int
    stats: dict[str, Any]
    max_model_len: int


@dataclass(frozen=True)
class CacheConfigInfo:
    """The settings vllm:cache_config_info shows as labels (vLLM's CacheConfig names); the pool's sizes
    come from each rank's stats."""

    block_size: int
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    cache_dtype: str = "auto"  # the KV cache is kept in the model's dtype (vLLM's "auto")

    def labels(self, rank: RankView) -> dict[str, str]:
        """vLLM's label values (str() of each value) for one rank."""
        num_gpu_blocks = int(rank.stats.get("num_total_blocks", 0))
        size_tokens = num_gpu_blocks * self.block_size
        concurrency = size_tokens / rank.max_model_len if rank.max_model_len else 0.0
        return {
            "block_size": str(self.block_size),
            "cache_dtype": self.cache_dtype,
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "gpu_memory_utilization": str(self.gpu_memory_utilization),
            "num_gpu_blocks": str(num_gpu_blocks),
            "num_cpu_blocks": str(int(rank.stats.get("cache_total_pages", 0))),  # the host tier's pages
            "kv_cache_size_tokens": str(size_tokens),
            "kv_cache_max_concurrency": f"{concurrency:.2f}",  # requests of max_model_len tokens the pool holds
        }


def accepted_per_position(stats: dict[str, Any]) -> list[int]:
    """A rank's accepted drafts per draft position, position 0 first (EngineStats.spec_accepted_per_position,
    a list once it has crossed msgpack); [] for a rank that does not speculate (one that does has
    num_speculative_tokens entries from its start)."""
    return list(stats.get("spec_accepted_per_position") or ())


class VllmRequestSeries:
    """Request-level series, observed where pdserve's are (frontend/generation.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ttft_s = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LABELS,
            buckets=TTFT_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.itl_s = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", LABELS,
            buckets=ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        # vLLM's older name of the same observations (deprecated there, still read by older dashboards)
        r.register(
            Alias(self.itl_s, "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.")
        )
        self.e2e_s = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LABELS,
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.queue_s = Histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LABELS,
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*LABELS, "finished_reason"],
            registry=r,
        )  # fmt: skip

        self._registry = r
        # per-request token counts, in vLLM's 1-2-5 buckets up to max_model_len: sized once the ranks
        # have told it (size_token_histograms), before the first request
        self.request_prompt_tokens: Histogram | None = None
        self.request_generation_tokens: Histogram | None = None

    def size_token_histograms(self, max_model_len: int) -> None:
        if self.request_prompt_tokens is not None:
            return
        buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", LABELS, buckets=buckets,
            registry=self._registry,
        )  # fmt: skip
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", LABELS,
            buckets=buckets, registry=self._registry,
        )  # fmt: skip

    def observe_token_gap(self, labels: tuple[str, str], gap_s: float) -> None:
        self.itl_s.labels(*labels).observe(gap_s)

    def observe_finished(self, labels: tuple[str, str], num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A finished request's token counts."""
        if self.request_prompt_tokens is not None and self.request_generation_tokens is not None:
            self.request_prompt_tokens.labels(*labels).observe(num_prompt_tokens)
            self.request_generation_tokens.labels(*labels).observe(num_output_tokens)


class Alias:
    """A collector that exports another's series once more under a second name (vLLM keeps deprecated
    names beside the new ones): the same samples, observed once."""

    def __init__(self, source: Any, name: str, documentation: str) -> None:
        self.source = source  # a collector: its collect() yields one metric family
        self.name = name
        self.documentation = documentation

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            yield renamed(family, self.name, self.documentation)


def renamed(family: Metric, name: str, documentation: str) -> Metric:
    """family's samples under another family name (a sample's suffix, _bucket, _total and the like, kept)."""
    out = Metric(name, documentation, family.type, family.unit)
    out.samples = [s._replace(name=name + s.name.removeprefix(family.name)) for s in family.samples]
    return out


class VllmEngineCollector:
    """Engine-level series read from each rank's latest stats at scrape time."""

    def __init__(
        self, snapshot: Callable[[], Iterable[RankView]], model_name: str, cache: CacheConfigInfo | None = None
    ) -> None:
        """cache: the settings of vllm:cache_config_info; None: no such series."""
        self.snapshot = snapshot
        self.model_name = model_name
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "num_running": GaugeMetricFamily(
                "vllm:num_requests_running", "Number of requests in model execution batches.", labels=LABELS
            ),
            "num_waiting": GaugeMetricFamily(
                "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=LABELS
            ),
        }
        kv_usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=LABELS
        )
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels=LABELS
        )
        for r in self.snapshot():
            if not r.stats:  # a rank that has not reported yet
                continue
            labels = [self.model_name, str(r.index)]
            for key, family in gauges.items():
                family.add_metric(labels, float(r.stats.get(key, 0)))
            kv_usage.add_metric(labels, float(r.stats.get("kv_usage", 0.0)))
            preemptions.add_metric(labels, float(r.stats.get("num_preemptions_total", 0)))
        yield from gauges.values()
        yield kv_usage
        yield renamed(
            kv_usage,
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        )
        yield preemptions
        yield from self._waiting_by_reason()
        yield from self._prefix_caches()
        yield from self._cache_config_info()
        yield self._iteration_tokens()
        yield from self._speculation()

    def _waiting_by_reason(self) -> Iterator[Metric]:
        """vLLM's split of the waiting requests: capacity (waiting for KV memory, a sequence slot or the
        step's token budget) or deferred (held back for another reason). The scheduler admits in arrival
        order as room allows and holds nothing back otherwise, so every waiting request waits for capacity."""
        family = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Number of requests waiting, by the reason they wait.",
            labels=[*LABELS, "reason"],
        )  # fmt: skip
        for r in self.snapshot():
            if r.stats:
                labels = [self.model_name, str(r.index)]
                family.add_metric([*labels, "capacity"], float(r.stats.get("num_waiting", 0)))
                family.add_metric([*labels, "deferred"], 0.0)
        yield family

    def _prefix_caches(self) -> Iterator[Metric]:
        """The engine pool's prefix cache (the decode cache) as vLLM's local one, the host tier as its
        external one; the external series only for ranks that have a host tier."""
        tiers = {
            "decode_cache": ("vllm:prefix_cache", "Prefix cache"),
            "cache": ("vllm:external_prefix_cache", "External prefix cache"),
        }
        for key, (name, what) in tiers.items():
            queries = CounterMetricFamily(
                f"{name}_queries", f"{what} queries, in terms of number of queried tokens.", labels=LABELS
            )
            hits = CounterMetricFamily(f"{name}_hits", f"{what} hits, in terms of number of cached tokens.", labels=LABELS)
            for r in self.snapshot():
                if not r.stats or (key == "cache" and not r.stats.get("cache_total_pages")):
                    continue
                labels = [self.model_name, str(r.index)]
                queries.add_metric(labels, float(r.stats.get(f"{key}_query_tokens_total", 0)))
                hits.add_metric(labels, float(r.stats.get(f"{key}_hit_tokens_total", 0)))
            if key == "decode_cache" or queries.samples:
                yield queries
                yield hits

    def _cache_config_info(self) -> Iterator[Metric]:
        """vLLM's info-style gauge: 1, with the cache settings as labels, per rank."""
        if self.cache is None:
            return
        family: GaugeMetricFamily | None = None
        for r in self.snapshot():
            if not r.stats:
                continue
            labels = {"model_name": self.model_name, "engine": str(r.index), **self.cache.labels(r)}
            if family is None:
                family = GaugeMetricFamily(
                    "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(labels)
                )
            family.add_metric(list(labels.values()), 1.0)
        if family is not None:
            yield family

    def _iteration_tokens(self) -> Metric:
        """vLLM's tokens per engine step, each rank's histogram as the rank keeps it."""
        family = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels=LABELS
        )
        for r in self.snapshot():
            h = cumulative_buckets(r.stats)
            if h is not None:
                buckets, total = h
                family.add_metric(
                    [self.model_name, str(r.index)], [(floatToGoString(le), n) for le, n in buckets], total
                )
        return family

    def _speculation(self) -> Iterator[Metric]:
        """vLLM's SpecDecodingProm counters, for the ranks that speculate; nothing when none does."""
        counters = {
            "spec_num_drafts_total": CounterMetricFamily(
                "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels=LABELS
            ),
            "spec_num_draft_tokens_total": CounterMetricFamily(
                "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels=LABELS
            ),
            "spec_num_accepted_tokens_total": CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels=LABELS
            ),
        }
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )  # fmt: skip
        any_rank = False
        for r in self.snapshot():
            positions = accepted_per_position(r.stats)
            if not positions:
                continue
            any_rank = True
            labels = [self.model_name, str(r.index)]
            for key, family in counters.items():
                family.add_metric(labels, float(r.stats.get(key, 0)))
            for k, n in enumerate(positions):
                per_position.add_metric([*labels, str(k)], float(n))
        if any_rank:
            yield from counters.values()
            yield per_position
