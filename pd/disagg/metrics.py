"""Prometheus metrics of the P/D roles, in the server's registry next to ServerMetrics.

CE coordinator: TTFT split by phase, handoffs as the PE reported them, reservations in flight, the PE's
reachability (each PE's, its in-flight prefills and why it was chosen). PE server: the handoffs it made (bytes, duration, failures by transport and code).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pd.disagg.kv_choice import KVAwareChoice, KVIndexCollector

_PHASE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT_PHASES = ("queue", "prefill", "transfer", "transfer_after_prefill", "first_decode")


class ClusterMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str = "") -> None:
        """model_name: the served name, which the TTFT phases carry as the request series do."""
        self.model_name = model_name
        r = registry
        self.ttft_phase_s = Histogram(
            "pdserve_ttft_phase_seconds",
            "TTFT split: queue (arrival to decode memory reserved), prefill (PE: request to first token), "
            "transfer (the whole KV handoff to the CE's ack; streamed (--kv-stream): from its first part, "
            "overlapping the prefill), transfer_after_prefill (PE's first token to the CE's ack: what the "
            "handoff adds to TTFT), first_decode (ack to the first token out of the CE)",
            ["phase", "model_name"],
            buckets=_PHASE_BUCKETS_S,
            registry=r,
        )
        self.handoff_bytes = Counter(
            "pdserve_handoff_bytes", "KV payload bytes handed off", ["transport"], registry=r
        )
        self.handoff_skipped_tokens = Counter(
            "pdserve_handoff_skipped_tokens",
            "Leading prompt tokens whose KV pages were not handed off: the CE's decode cache held them",
            ["transport"],
            registry=r,
        )
        self.handoff_streamed_pages = Counter(
            "pdserve_handoff_streamed_pages",
            "KV pages handed off in parts while their prompt was still being prefilled (--kv-stream)",
            ["transport"],
            registry=r,
        )
        self.handoff_early_pages = Counter(
            "pdserve_handoff_early_pages",
            "Of the streamed pages, those whose bytes had gone before the prefill ended",
            ["transport"],
            registry=r,
        )
        self.handoff_s = Histogram(
            "pdserve_handoff_duration_seconds",
            "One handoff: export checksum, transfer, verification and import, until the ack",
            ["transport"],
            buckets=_PHASE_BUCKETS_S,
            registry=r,
        )
        self.handoffs = Counter(
            "pdserve_handoffs", "Handoffs acknowledged by the CE", ["transport"], registry=r
        )
        self.handoff_failures = Counter(
            "pdserve_handoff_failures",
            "Prefills that did not end in a handoff, by transport and reason (transfer.errors codes, "
            "pe_unreachable, prefill_timeout, ...)",
            ["transport", "code"],
            registry=r,
        )
        self.reservations = Gauge(
            "pdserve_reservations_inflight",
            "CE: requests waiting for decode memory (waiting) or holding it until their handoff (held)",
            ["state"],
            registry=r,
        )
        self.kv_choice: KVAwareChoice | None = None  # --pe-routing kv-aware: the pool's
        r.register(KVIndexCollector(lambda: self.kv_choice, "pdserve_pe", "pe", "PE"))
        self.local_prefills = Counter(
            "pdserve_local_prefills",
            "CE: requests prefilled on the CE, by reason: fallback (the PE failed: --fallback-local-prefill), "
            "short (at most --local-prefill-max-tokens left after the CE's cached prefix)",
            ["reason"],
            registry=r,
        )
        for reason in ("fallback", "short"):
            self.local_prefills.labels(reason)
        self.prefill_engine_up = Gauge(
            "pdserve_prefill_engine_up", "CE: 1 while any PE answers its health check", registry=r
        )
        self.pe_up = Gauge(
            "pdserve_pe_up", "CE: 1 while this PE answers its health check", ["pe"], registry=r
        )
        self.pe_inflight = Gauge(
            "pdserve_pe_inflight", "CE: this CE's /prefill requests in flight at this PE", ["pe"], registry=r
        )
        self.pe_selected = Counter(
            "pdserve_pe_selected",
            "CE: prefills sent to this PE, by why it was chosen: affinity (the conversation's first PE), "
            "overflow (the first was over its load bound), least-loaded | round-robin (--pe-routing), kv-hit | "
            "kv-miss (kv-aware: the cheapest PE holds some of the prompt | none does), "
            "failover (the retry after a failed first attempt), fallback (no PE was known to be up)",
            ["pe", "reason"],
            registry=r,
        )
        self.unauthenticated = Counter(
            "pdserve_unauthenticated_requests", "Requests refused for lacking the cluster token", registry=r
        )
        for state in ("waiting", "held"):
            self.reservations.labels(state).set(0)

    def observe_phase(self, phase: str, seconds: float) -> None:
        """One request's time in one TTFT phase (TTFT_PHASES)."""
        self.ttft_phase_s.labels(phase, self.model_name).observe(seconds)
