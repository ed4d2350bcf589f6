"""The CEs a router sends requests to: one Backend per CE (its health, its requests in flight) and which
CE a request goes to.

Choice: rendezvous (highest-random-weight) hashing of the conversation key over the CEs that are up,
the same function and key the CEs use for the PEs (pd/disagg/membership.py, which also resolves the
dns+ entries for both), so every router replica given the same --decode-url list picks the same CE for a
conversation without talking to the others, its turns meet the CE's decode cache, and a CE going away
moves only its own conversations. Bounded load: a CE holding max(--load-floor, ceil((1 + --load-slack) *
(all in flight + 1) / CEs up)) requests is passed over for the next in the conversation's order (reason
"overflow"): the floor keeps conversations on their CE at low load, where the bound alone would spread
them after one request in flight. A request without a key goes to the least loaded CE.

--routing kv-aware: the CEs by cost (pd/disagg/kv_choice.py: what the prompt would cost each, after the
prefix its KV events say it holds, plus the work it has in flight), the cheapest first; a request whose
token ids are unknown is ordered as affinity orders it.

Health: each CE's /health/ready is probed every --health-interval-s while it is up and with doubling
backoff while it is down; a connection that fails under a request marks the CE down at once (the probe
brings it back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from pd.config import Target, parse_targets
from pd.disagg.kv_choice import LOAD_WEIGHT, KVAwareChoice
from pd.disagg.membership import hrw_order, members

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 2.0  # a CE that starts or comes back is seen within this of its readiness
PROBE_TIMEOUT_S = 5.0


class Backend:
    """One CE: its URL (its identity in the hashing), health and requests in flight."""

    def __init__(self, url: str, source: str, on_state: Callable[[Backend], None]) -> None:
        self.url = url
        self.source = source  # the --decode-url entry it comes from
        self.is_up = False
        self.error: str | None = "not probed yet"
        self.num_inflight = 0
        self.inflight_tokens = 0.0  # the work of their prompts (kv-aware's load term)
        self.kv_events: list[dict[str, Any]] = []  # its ranks' KV event streams (read when kv-aware)
        self.reads_streams = False
        self.on_state = on_state
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        self._task = asyncio.create_task(self._watch(session, interval_s))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def poke(self) -> None:
        """Probe now (a request saw the connection break)."""
        self._poke.set()

    def set_state(self, is_up: bool, error: str | None) -> None:
        changed = is_up != self.is_up
        self.is_up, self.error = is_up, error
        if changed:
            if is_up:
                log.info("decode engine %s is up", self.url)
            else:
                log.warning("decode engine %s is down: %s", self.url, error)
            self.on_state(self)
        if not is_up:
            self._poke.set()  # probe again soon (with backoff), not at the next period

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "state": "up" if self.is_up else "down", "inflight": self.num_inflight,
                "error": self.error}  # fmt: skip

    async def _probe(self, session: aiohttp.ClientSession) -> tuple[bool, str | None]:
        try:
            async with session.get(
                self.url + "/health/ready", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as r:
                body = await r.read()
                if r.status != 200:
                    return False, f"/health/ready answered {r.status}: {body[:200]!r}"
            if self.reads_streams:
                async with session.get(
                    self.url + "/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
                ) as r:
                    with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                        self.kv_events = list(orjson.loads(await r.read()).get("kv_events") or [])
            return True, None
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            return False, f"{type(e).__name__}: {e}"

    async def _watch(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        backoff_s = 0.25
        while True:
            is_up, error = await self._probe(session)
            self.set_state(is_up, error)
            if is_up:
                backoff_s, wait_s = 0.25, interval_s
            else:
                wait_s, backoff_s = backoff_s, min(backoff_s * 2, MAX_BACKOFF_S)
            self._poke.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._poke.wait(), wait_s)


class BackendPool:
    """The router's CEs: membership (fixed URLs and dns+ names), health, and the order a request tries."""

    def __init__(
        self,
        decode_url: str,
        load_slack: float,
        load_floor: int,
        health_interval_s: float,
        dns_refresh_s: float,
        on_state: Callable[[Backend], None] = lambda b: None,
        on_leave: Callable[[Backend], None] = lambda b: None,
        routing: str = "affinity",
        block_size: int | None = None,
        token: bytes | None = None,
        kv_load_weight: float = LOAD_WEIGHT,
    ) -> None:
        """routing kv-aware: block_size is the engines' page size (None: as the CEs' /health names it),
        token the cluster token (a CE's KV event stream off loopback needs it)."""
        self.targets = parse_targets(decode_url, "--decode-url")
        self.routing = routing
        self.kv = KVAwareChoice(block_size, token, kv_load_weight) if routing == "kv-aware" else None
        self.load_slack = load_slack
        self.load_floor = load_floor
        self.health_interval_s = health_interval_s
        self.dns_refresh_s = dns_refresh_s
        self.on_state = on_state
        self.on_leave = on_leave
        self.backends: dict[str, Backend] = {}  # by URL, in the order first seen
        self._session: aiohttp.ClientSession | None = None
        self._dns_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        await self._refresh(self.targets)
        if any(t.dns for t in self.targets):
            self._dns_task = asyncio.create_task(self._watch_dns())

    async def stop(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dns_task
        await asyncio.gather(*(b.stop() for b in self.backends.values()))
        if self.kv is not None:
            await self.kv.stop()
        if self._session is not None:
            await self._session.close()

    async def _refresh(self, targets: list[Target]) -> None:
        """Makes the backends match the targets (a dns target whose lookup fails keeps its CEs)."""
        assert self._session is not None
        wanted, _ = await members(targets, {u: b.source for u, b in self.backends.items()}, "CE")
        for url, source in wanted.items():
            if url not in self.backends:
                b = Backend(url, source, self._on_state)
                b.reads_streams = self.kv is not None
                self.backends[url] = b
                self.on_state(b)
                b.start(self._session, self.health_interval_s)
                if source != url:
                    log.info("decode engine %s joined %s", url, source)
        for url in [u for u in self.backends if u not in wanted]:
            log.info("decode engine %s left %s", url, self.backends[url].source)
            b = self.backends.pop(url)
            await b.stop()
            if self.kv is not None:
                self.kv.drop(url)
            self.on_leave(b)

    async def _watch_dns(self) -> None:
        while True:
            await asyncio.sleep(self.dns_refresh_s)
            try:
                await self._refresh(self.targets)
            except Exception:  # a lookup must never end the watch
                log.exception("refreshing the decode engines failed")

    def _on_state(self, b: Backend) -> None:
        if b.is_up and self.kv is not None:
            self.kv.sync(b, again=True)  # its streams, as its /health names them, anew
        self.on_state(b)

    @property
    def any_up(self) -> bool:
        return any(b.is_up for b in self.backends.values())

    def order(self, key: str | None, token_ids: list[int] | None = None) -> list[tuple[Backend, str]]:
        """The CEs a request tries, best first, each with the reason it is tried for: the conversation's
        CE (affinity) unless it is over the load bound (then overflow to the next of its order, the CEs
        passed over coming after), least-loaded without a key, and the CEs known down last (fallback: a
        probe can lag behind a restart). kv-aware with the prompt's token_ids: the CEs by cost
        (pd/disagg/kv_choice.py), the cheapest first (kv-hit when it holds some of the prompt, else
        kv-miss); without them, as affinity."""
        up = [b for b in self.backends.values() if b.is_up]
        down = [b for b in self.backends.values() if not b.is_up]
        fallback = [(self.backends[u], "fallback") for u in hrw_order(key or "", [b.url for b in down])]
        if not up:
            return fallback
        by_url = {b.url: b for b in up}
        ranked = [by_url[u] for u in hrw_order(key or "", list(by_url))]
        if self.kv is not None and token_ids:
            costs = self.kv.rank(ranked, token_ids)
            best = (costs[0][2], "kv-hit" if costs[0][1] else "kv-miss")
            return [best, *((b, "failover") for _, _, b in costs[1:]), *fallback]
        if key is None:
            ranked.sort(key=lambda b: b.num_inflight)  # stable: ties keep the hash order
            return [(b, "least-loaded") for b in ranked] + fallback
        total = sum(b.num_inflight for b in ranked)
        capacity = max(self.load_floor, math.ceil((1.0 + self.load_slack) * (total + 1) / len(ranked)))
        first = next((i for i, b in enumerate(ranked) if b.num_inflight < capacity), 0)
        chosen = [(ranked[first], "affinity" if first == 0 else "overflow")]
        rest = [(b, "failover") for i, b in enumerate(ranked) if i != first]
        return chosen + rest + fallback
