"""The router's own /metrics: requests per CE and outcome, the reason each CE was chosen, failovers,
each CE's health and requests in flight."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pd.disagg.kv_choice import KVAwareChoice, KVIndexCollector

REASONS = ("affinity", "overflow", "least-loaded", "kv-hit", "kv-miss", "failover", "fallback")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pdserve_router_requests",
            "Requests the router answered, by the CE that answered (none: no CE could) and HTTP status",
            ["backend", "status"],
            registry=r,
        )
        self.selected = Counter(
            "pdserve_router_backend_selected",
            "Attempts sent to each CE, by reason: affinity (the conversation's CE), overflow (it was over "
            "its load bound), least-loaded (no conversation key), kv-hit / kv-miss (--routing kv-aware: the "
            "cheapest CE holds some of the prompt / none does), failover (an earlier CE failed), "
            "fallback (no CE known up)",
            ["backend", "reason"],
            registry=r,
        )
        self.failovers = Counter(
            "pdserve_router_failovers",
            "Requests moved off a CE before anything was streamed, by the CE that failed",
            ["backend"],
            registry=r,
        )
        self.stream_errors = Counter(
            "pdserve_router_stream_errors",
            "Answers cut because the CE's connection broke after bytes had reached the client",
            ["backend"],
            registry=r,
        )
        self.backend_up = Gauge("pdserve_router_backend_up", "1 while the CE answers /health/ready", ["backend"],
                                registry=r)  # fmt: skip
        self.inflight = Gauge(
            "pdserve_router_backend_inflight",
            "Requests the router has in flight at each CE",
            ["backend"],
            registry=r,
        )

        self.prompt_ids = Counter(
            "pdserve_router_prompt_ids",
            "Requests by where --routing kv-aware got their prompt's token ids: body (a completions "
            "prompt of ids), tokenize (a CE's /tokenize), none (neither: routed by the conversation key)",
            ["source"],
            registry=r,
        )
        for source in ("body", "tokenize", "none"):
            self.prompt_ids.labels(source)
        self.kv_choice: KVAwareChoice | None = None  # --routing kv-aware: the pool's
        r.register(KVIndexCollector(lambda: self.kv_choice, "pdserve_router", "backend", "CE"))

    def add_backend(self, url: str) -> None:
        """Every series of a CE, at 0, from the moment it is known."""
        for reason in REASONS:
            self.selected.labels(url, reason)
        self.failovers.labels(url)
        self.stream_errors.labels(url)
        self.inflight.labels(url).set(0)

    def remove_backend(self, url: str) -> None:
        for g in (self.backend_up, self.inflight, self.failovers, self.stream_errors):
            with contextlib.suppress(KeyError):
                g.remove(url)
        for reason in REASONS:
            with contextlib.suppress(KeyError):
                self.selected.remove(url, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
