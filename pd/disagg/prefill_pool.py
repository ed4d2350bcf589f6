"""The CE coordinator's prefill engines: one PrefillClient per PE (each with its own health watch and
in-flight count), and which PE a request's prefill goes to.

    --prefill-url http://pe-a:8889,http://pe-b:8889          fixed PEs
    --prefill-url dns+http://pdserve-pe.ns.svc:8889         every address the name resolves to, looked
                                                            up again every --pe-dns-refresh-s

Choice (--pe-routing):
- affinity (default): rendezvous (highest-random-weight) hashing of the conversation key over the PEs
  that are up. Every CE ranks the PEs the same way for a conversation without talking to the others, so
  its turns meet their prefix cache whichever CE takes them, and a PE going away moves only its own
  conversations. Bounded by load: a PE holding as many in-flight prefills as
  ceil((1 + --pe-load-slack) * (all in flight + 1) / PEs up) is passed over for the next in the
  conversation's order (reason "overflow").
- least-loaded: the PE with the fewest prefills in flight (ties: the conversation's order).
- round-robin: each PE in turn.
- kv-aware: the PE with the lowest cost, what it would still compute of the prompt after its cached prefix
  plus the work it has in flight (pd/disagg/kv_choice.py: its ranks' KV events feed a prefix
  index); ties keep the conversation's order. Reason "kv-hit" when the chosen PE holds some of the
  prompt, "kv-miss" when none does.
When no PE is known to be up (a probe can lag behind a restart), the PEs are tried in the same order
anyway (reason "fallback"). A failed first attempt goes once to the next PE of the order (reason
"failover"; pd/disagg/decode_path.py decides when that is safe).

A PE's identity is its URL as written (or, for dns+http, scheme://address:port): every CE must be given
the same list, so that their rankings agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import Iterator
from typing import Any

from pd.config import PE_ROUTING, Target, parse_prefill_urls
from pd.disagg.kv_choice import LOAD_WEIGHT, KVAwareChoice
from pd.disagg.membership import hrw_order, members
from pd.disagg.metrics import ClusterMetrics
from pd.disagg.prefill_client import PrefillClient

log = logging.getLogger(__name__)


class PrefillPool:
    """The PEs of a CE. A PrefillClient per PE (pd/disagg/prefill_client.py) watches its health; `choose` gives
    the PE for a request and `attempt` counts it in flight while its /prefill runs."""

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
        kv_load_weight: float = LOAD_WEIGHT,
    ) -> None:
        """block_size: the engines' page size (kv-aware: the prefix index hashes pages of it)."""
        if routing not in PE_ROUTING:
            raise ValueError(f"--pe-routing must be one of {PE_ROUTING}, got {routing!r}")
        self.targets = parse_prefill_urls(prefill_url)
        self.routing = routing
        self.load_slack = load_slack
        self.dns_refresh_s = dns_refresh_s
        self.metrics = metrics
        self._token = token
        self._timeout_s = timeout_s
        self._ssl_ca_certs = ssl_ca_certs
        self.clients: dict[str, PrefillClient] = {}  # by URL, in the order first seen
        self._retired: list[PrefillClient] = []  # gone from DNS, closed once nothing is in flight
        self._closing: set[asyncio.Task[None]] = set()
        self._dns_task: asyncio.Task[None] | None = None
        self._turn = itertools.count()
        self.dns_error: str | None = None
        self.kv = KVAwareChoice(block_size, token, kv_load_weight) if routing == "kv-aware" else None
        metrics.kv_choice = self.kv

    # ---- membership -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self._refresh(self.targets)
        if any(t.dns for t in self.targets):
            self._dns_task = asyncio.create_task(self._watch_dns())

    async def stop(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dns_task
        await asyncio.gather(*(c.stop() for c in [*self.clients.values(), *self._retired]))
        if self.kv is not None:
            await self.kv.stop()

    async def _refresh(self, targets: list[Target]) -> None:
        """Makes the clients match the targets (a dns target whose lookup fails keeps its PEs)."""
        known = {u: c.source for u, c in self.clients.items()}
        wanted, self.dns_error = await members(targets, known, "PE")
        for url, source in wanted.items():
            if url not in self.clients:
                await self._add(url, source)
        for url in [u for u in self.clients if u not in wanted]:
            log.info("prefill engine %s left %s", url, self.clients[url].source)
            self._retire(url)
        self._close_retired()

    async def _add(self, url: str, source: str) -> None:
        up = self.metrics.pe_up.labels(url)

        def on_state(is_up: bool) -> None:
            up.set(1.0 if is_up else 0.0)
            self._gauge_any_up()
            if is_up and self.kv is not None and url in self.clients:
                self.kv.sync(self.clients[url], again=True)  # its streams, as its /health names them, anew

        client = PrefillClient(
            url, self._token, self._timeout_s, on_state=on_state, ssl_ca_certs=self._ssl_ca_certs
        )
        client.source = source
        up.set(0.0)
        self.metrics.pe_inflight.labels(url).set(0)
        for reason in self.reasons:
            self.metrics.pe_selected.labels(url, reason)
        self.clients[url] = client
        await client.start()
        if source != url:
            log.info("prefill engine %s joined %s", url, source)

    def _retire(self, url: str) -> None:
        client = self.clients.pop(url)
        client.retired = True
        if self.kv is not None:
            self.kv.drop(url)
        self._retired.append(client)
        for m in (self.metrics.pe_up, self.metrics.pe_inflight):
            with contextlib.suppress(KeyError):
                m.remove(url)
        for reason in self.reasons:
            with contextlib.suppress(KeyError):
                self.metrics.pe_selected.remove(url, reason)
        self._gauge_any_up()

    def _close_retired(self) -> None:
        for c in [c for c in self._retired if c.num_inflight == 0]:
            self._retired.remove(c)
            task = asyncio.get_running_loop().create_task(c.stop())
            self._closing.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._closing.discard)

    async def _watch_dns(self) -> None:
        while True:
            await asyncio.sleep(self.dns_refresh_s)
            try:
                await self._refresh(self.targets)
            except Exception:  # a lookup must never end the watch
                log.exception("refreshing the prefill engines failed")

    def _gauge_any_up(self) -> None:
        self.metrics.prefill_engine_up.set(1.0 if self.any_up else 0.0)

    # ---- state --------------------------------------------------------------------------------------

    @property
    def any_up(self) -> bool:
        return any(c.is_up for c in self.clients.values())

    @property
    def all_up(self) -> bool:
        return bool(self.clients) and all(c.is_up for c in self.clients.values())

    def __len__(self) -> int:
        return len(self.clients)

    def describe(self) -> list[dict[str, Any]]:
        return [c.describe() for c in self.clients.values()]

    # ---- choice -------------------------------------------------------------------------------------

    def order(self, key: str | None, exclude: frozenset[str] = frozenset()) -> tuple[list[PrefillClient], bool]:
        """The PEs a request tries, best first, and whether any of them is known to be up (if none is,
        every PE is listed: reason "fallback")."""
        pool = [c for u, c in self.clients.items() if u not in exclude]
        up = [c for c in pool if c.is_up]
        if not up:
            return [self.clients[u] for u in hrw_order(key or "", [c.url for c in pool])], False
        by_url = {c.url: c for c in up}
        ranked = [by_url[u] for u in hrw_order(key or "", list(by_url))]
        if self.routing == "least-loaded" or (self.routing == "affinity" and key is None):
            ranked.sort(key=lambda c: c.num_inflight)  # stable: ties keep the conversation's order
        elif self.routing == "round-robin":
            turn = next(self._turn) % len(ranked)
            ranked = sorted(up, key=lambda c: c.url)
            ranked = ranked[turn:] + ranked[:turn]
        return ranked, True

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
        ranked, any_up = self.order(key, exclude)
        if not ranked:
            return None
        if not any_up:
            return ranked[0], "fallback"
        if self.kv is not None:
            _, cached, best = self.kv.rank(ranked, list(token_ids or ()))[0]
            return best, "kv-hit" if cached else "kv-miss"
        if self.routing != "affinity":
            return ranked[0], self.routing
        if key is None:  # no conversation to keep together
            return ranked[0], "least-loaded"
        total = sum(c.num_inflight for c in ranked)
        capacity = math.ceil((1.0 + self.load_slack) * (total + 1) / len(ranked))
        for c in ranked:
            if c.num_inflight < capacity:
                return c, "affinity" if c is ranked[0] else "overflow"
        return ranked[0], "affinity"  # not reached: some PE holds fewer than the mean

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

