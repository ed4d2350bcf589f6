"""The CEs a router sends requests to: one Backend per CE (its health, its requests in flight) and which
CE a request goes to.

Choice (pd/disagg/membership.py, as a CE chooses a PE): rendezvous hashing of the conversation key over the
CEs that are up, so that its turns meet the CE's decode cache, bounded by max(--load-floor, ceil((1 +
--load-slack) * (all in flight + 1) / CEs up)); --routing kv-aware: by cost (pd/disagg/kv_choice.py).

Health: each CE's /health/ready is probed every --health-interval-s while it is up and with doubling
backoff while it is down; a connection that fails under a request marks the CE down at once (the probe
brings it back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from pd.config import parse_targets
from pd.disagg.kv_choice import LOAD_WEIGHT, KVAwareChoice
from pd.disagg.membership import Peers, watch

log = logging.getLogger(__name__)
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
        self._task = asyncio.create_task(watch(lambda: self._check(session), self._poke, interval_s))

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

    async def _check(self, session: aiohttp.ClientSession) -> bool:
        self.set_state(*await self._probe(session))
        return self.is_up


class BackendPool:
    """The router's CEs: membership (fixed URLs and dns+ names), health, and the order a request tries
    (pd/disagg/membership.py)."""

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
        kv = KVAwareChoice(block_size, token, kv_load_weight) if routing == "kv-aware" else None
        self.peers: Peers[Backend] = Peers(
            parse_targets(decode_url, "--decode-url"), "decode engine", "CE", log, self._join, self._leave,
            dns_refresh_s, routing, load_slack, load_floor, kv,
        )  # fmt: skip
        self.kv = kv
        self.backends = self.peers.by_url  # by URL, in the order first seen
        self.health_interval_s = health_interval_s
        self.on_state = on_state
        self.on_leave = on_leave
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        await self.peers.start()

    async def stop(self) -> None:
        await self.peers.stop()
        if self._session is not None:
            await self._session.close()

    async def _join(self, url: str, source: str) -> Backend:
        assert self._session is not None
        b = Backend(url, source, self._on_state)
        b.reads_streams = self.kv is not None
        self.on_state(b)
        b.start(self._session, self.health_interval_s)
        return b

    async def _leave(self, b: Backend) -> None:
        await b.stop()
        self.on_leave(b)

    def _on_state(self, b: Backend) -> None:
        if b.is_up:
            self.peers.came_up(b.url)
        self.on_state(b)

    @property
    def any_up(self) -> bool:
        return self.peers.any_up

    def order(self, key: str | None, token_ids: list[int] | None = None) -> list[tuple[Backend, str]]:
        """The CEs a request tries, best first, each with why (pd/disagg/membership.py): affinity |
        overflow | least-loaded | kv-hit | kv-miss, then failover, then fallback (known down); kv-aware
        without the prompt's token_ids: as affinity."""
        return self.peers.order(key, token_ids or None)
