"""The CE coordinator's prefill engines: one PrefillClient per PE (each with its own health watch and
in-flight count), and which PE a request's prefill goes to.

    --prefill-url http://pe-a:8889,http://pe-b:8889          fixed PEs
    --prefill-url dns+http://pdserve-pe.ns.svc:8889         every address the name resolves to, looked
                                                            up again every --pe-dns-refresh-s

Choice (--pe-routing; pd/disagg/membership.py, as the router chooses a CE): affinity's bound is ceil((1 +
--pe-load-slack) * (all in flight + 1) / PEs up), no floor. A failed first attempt goes once to the next
PE of the order ("failover"; pd/disagg/decode_path.py decides when that is safe).

A PE's identity is its URL as written (or, for dns+http, scheme://address:port): every CE must be given
the same list, so that their rankings agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from pd.config import PE_LOAD_WEIGHT, PE_ROUTING, parse_prefill_urls
from pd.disagg.kv_choice import KVAwareChoice
from pd.disagg.membership import Peers
from pd.disagg.metrics import ClusterMetrics
from pd.disagg.prefill_client import PrefillClient

log = logging.getLogger(__name__)


class PrefillPool:
    """The PEs of a CE (pd/disagg/membership.py: membership and order). A PrefillClient per PE
    (pd/disagg/prefill_client.py) watches its health; `choose` gives the PE for a request and `attempt`
    counts it in flight while its /prefill runs."""

    def __init__(
        self,
        prefill_url: str,
        token: bytes,
        timeout_s: float,
        metrics: ClusterMetrics,
        routing: str = "affinity",
        load_slack: float = 0.5,
        dns_refresh_s: float = 10.0,
        ssl_ca_certs: str | None = None,
        block_size: int = 128,
        kv_load_weight: float = PE_LOAD_WEIGHT,
    ) -> None:
        """block_size: the engines' page size (kv-aware: the prefix index hashes pages of it)."""
        if routing not in PE_ROUTING:
            raise ValueError(f"--pe-routing must be one of {PE_ROUTING}, got {routing!r}")
        self.routing = routing
        self.metrics = metrics
        self._token = token
        self._timeout_s = timeout_s
        self._ssl_ca_certs = ssl_ca_certs
        self.kv = KVAwareChoice(block_size, token, kv_load_weight) if routing == "kv-aware" else None
        metrics.kv_choice = self.kv
        self.peers: Peers[PrefillClient] = Peers(
            parse_prefill_urls(prefill_url), "prefill engine", "PE", log, self._add, self._leave,
            dns_refresh_s, routing, load_slack, kv=self.kv,
        )  # fmt: skip
        self.clients = self.peers.by_url  # by URL, in the order first seen
        self._retired: list[PrefillClient] = []  # gone from DNS, closed once nothing is in flight
        self._closing: set[asyncio.Task[None]] = set()

    # ---- membership -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.peers.start()

    async def stop(self) -> None:
        await asyncio.gather(self.peers.stop(), *(c.stop() for c in self._retired))

    @property
    def dns_error(self) -> str | None:
        return self.peers.dns_error

    async def _add(self, url: str, source: str) -> PrefillClient:
        up = self.metrics.pe_up.labels(url)

        def on_state(is_up: bool) -> None:
            up.set(1.0 if is_up else 0.0)
            self._gauge_any_up()
            if is_up:
                self.peers.came_up(url)

        client = PrefillClient(
            url, self._token, self._timeout_s, on_state=on_state, ssl_ca_certs=self._ssl_ca_certs
        )
        client.source = source
        up.set(0.0)
        self.metrics.pe_inflight.labels(url).set(0)
        for reason in self.reasons:
            self.metrics.pe_selected.labels(url, reason)
        await client.start()
        return client

    async def _leave(self, client: PrefillClient) -> None:
        client.retired = True
        self._retired.append(client)
        for m in (self.metrics.pe_up, self.metrics.pe_inflight):
            with contextlib.suppress(KeyError):
                m.remove(client.url)
        for reason in self.reasons:
            with contextlib.suppress(KeyError):
                self.metrics.pe_selected.remove(client.url, reason)
        self._gauge_any_up()
        self._close_retired()

    def _close_retired(self) -> None:
        for c in [c for c in self._retired if c.num_inflight == 0]:
            self._retired.remove(c)
            task = asyncio.get_running_loop().create_task(c.stop())
            self._closing.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._closing.discard)

    def _gauge_any_up(self) -> None:
        self.metrics.prefill_engine_up.set(1.0 if self.any_up else 0.0)

    # ---- state --------------------------------------------------------------------------------------

    @property
    def any_up(self) -> bool:
        return self.peers.any_up

    @property
    def all_up(self) -> bool:
        return bool(self.clients) and all(c.is_up for c in self.clients.values())

    def __len__(self) -> int:
        return len(self.clients)

    def describe(self) -> list[dict[str, Any]]:
        return [c.describe() for c in self.clients.values()]

    # ---- choice -------------------------------------------------------------------------------------

    @property
    def reasons(self) -> tuple[str, ...]:
        """The reason labels a PE can be chosen for under this policy."""
        first = {"affinity": ("affinity", "overflow", "least-loaded"), "kv-aware": ("kv-hit", "kv-miss")}.get(
            self.routing, (self.routing,)
        )
        return (*first, "failover", "fallback")

    def choose(
        self, key: str | None, exclude: frozenset[str] = frozenset(), token_ids: list[int] | None = None
    ) -> tuple[PrefillClient, str] | None:
        """The PE for a request's prefill (token_ids: its prompt, for kv-aware) and why (affinity |
        overflow | least-loaded | round-robin | kv-hit | kv-miss | fallback); None: no PE left to try."""
        order = self.peers.order(key, [] if token_ids is None else token_ids, exclude)
        return order[0] if order else None

    @contextlib.contextmanager
    def attempt(
        self, client: PrefillClient, reason: str, num_tokens: float = 0, token_ids: list[int] | None = None
    ) -> Iterator[None]:
        """Counts a /prefill to client in flight while it runs, with its work (num_tokens, or what
        token_ids cost client: kv-aware's load term)."""
        if token_ids is not None:
            num_tokens = len(token_ids) if self.kv is None else self.kv.send(client, token_ids)
        self.metrics.pe_selected.labels(client.url, reason).inc()
        client.num_inflight += 1
        client.inflight_tokens += num_tokens
        self._gauge_inflight(client)
        try:
            yield
        finally:
            client.num_inflight -= 1
            client.inflight_tokens -= num_tokens
            self._gauge_inflight(client)
            if client.retired:
                self._close_retired()

    def _gauge_inflight(self, client: PrefillClient) -> None:
        if not client.retired:
            self.metrics.pe_inflight.labels(client.url).set(client.num_inflight)

