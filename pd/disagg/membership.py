"""The peers of a list-of-servers flag (a router's --decode-url: its CEs; a CE's --prefill-url: its PEs), one
pool for both hops; each side brings its own peer (its probe, its requests) and its join and leave.

Membership: the targets' URLs, a dns+ name for every address it resolves to, looked up again every
dns_refresh_s; a lookup that fails keeps the URLs it had (a resolver's hiccup must not empty a pool). A
URL's identity is scheme://address:port, so that every member given the same list ranks the same way.

Order (`Peers.order`): rendezvous (highest-random-weight) hashing of the conversation key over the peers
that are up, so every CE and router replica ranks them alike without talking to the others, a
conversation's turns meet the peer's cache, and a peer going away moves only its own conversations.
affinity passes over a peer holding max(load_floor, ceil((1 + load_slack) * (all in flight + 1) / peers
up)) requests for the next in the order ("overflow"; the floor keeps conversations on their peer at low
load); a request without a key goes to the least loaded. least-loaded: the fewest in flight (ties: the
order); round-robin: each in turn; kv-aware with the prompt's token ids: by cost (pd/disagg/kv_choice.py,
"kv-hit" or "kv-miss"), else as affinity. The rest follow ("failover"), then the peers known down
("fallback": a probe can lag behind a restart), all there is while none is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import itertools
import logging
import math
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, Protocol, TypeVar

from pd.config import Target
from pd.disagg.kv_choice import KVAwareChoice
from pd.disagg.kv_choice import Peer as KVPeer

log = logging.getLogger(__name__)


async def resolve(host: str, port: int) -> list[str]:
    """Every address host resolves to (sorted, so that the order does not depend on the resolver)."""
    if _is_ip(host):
        return [host]
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def url_of(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


async def members(
    targets: list[Target], known: Mapping[str, str], what: str
) -> tuple[dict[str, str], str | None]:
    """URL -> the target (as written) it comes from, for every target in order, each dns one looked up
    now; and the error of the last lookup that failed (None if none did). known: the URLs held so far,
    each with its target: a target whose lookup fails keeps them. what names a member in the log."""
    wanted: dict[str, str] = {}
    error: str | None = None
    for t in targets:
        if not t.dns:
            wanted.setdefault(t.url, t.url)
            continue
        try:
            urls = [url_of(t.scheme, a, t.port) for a in await resolve(t.host, t.port)]
        except OSError as e:
            error = f"{t.url}: {e}"
            urls = [u for u, source in known.items() if source == t.url]
            log.warning("cannot resolve %s (keeping its %d %s(s)): %s", t.url, len(urls), what, e)
        for url in urls:
            wanted.setdefault(url, t.url)
    return wanted, error


def hrw_order(key: str, urls: list[str]) -> list[str]:
    """The urls by rendezvous weight for key, highest first (the same on every CE and router)."""
    data = key.encode("utf-8", "surrogatepass")

    def weight(url: str) -> bytes:
        return hashlib.blake2b(data, digest_size=8, key=url.encode()[:64]).digest()

    return sorted(urls, key=weight, reverse=True)


MAX_BACKOFF_S = 2.0  # a peer that starts or comes back is seen within this of its readiness


async def watch(check: Callable[[], Awaitable[bool]], poke: asyncio.Event, interval_s: float) -> None:
    """Runs check (a peer's probe, which records what it found; True: up) every interval_s while the peer
    is up, with doubling backoff (to MAX_BACKOFF_S) while not (a dead one is probed no more often than an
    up one), and at once when poke is set."""
    backoff_s = 0.25
    while True:
        if await check():
            backoff_s, wait_s = 0.25, interval_s
        else:
            wait_s, backoff_s = backoff_s, min(backoff_s * 2, MAX_BACKOFF_S)
        poke.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(poke.wait(), wait_s)


class Peer(KVPeer, Protocol):
    source: str  # the flag's entry it comes from (a dns+ name, or its own URL)
    num_inflight: int

    @property
    def is_up(self) -> bool: ...

    async def stop(self) -> None: ...


P = TypeVar("P", bound=Peer)


class Peers(Generic[P]):
    """The peers of one flag, by URL in the order first seen. name: a peer in log's lines ("prefill
    engine"); what: its short name ("PE"); join(url, source) starts a peer, leave(peer) ends one that left."""

    def __init__(
        self,
        targets: list[Target],
        name: str,
        what: str,
        log: logging.Logger,
        join: Callable[[str, str], Awaitable[P]],
        leave: Callable[[P], Awaitable[None]],
        dns_refresh_s: float,
        routing: str = "affinity",
        load_slack: float = 0.5,
        load_floor: int = 0,
        kv: KVAwareChoice | None = None,
    ) -> None:
        self.targets, self.name, self.what, self.log = targets, name, what, log
        self._join, self._leave = join, leave
        self.dns_refresh_s = dns_refresh_s
        self.routing, self.load_slack, self.load_floor, self.kv = routing, load_slack, load_floor, kv
        self.by_url: dict[str, P] = {}
        self.dns_error: str | None = None  # the last failed lookup's
        self._turn = itertools.count()
        self._dns_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresh()
        if any(t.dns for t in self.targets):
            self._dns_task = asyncio.create_task(self._watch_dns())

    async def stop(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dns_task
        await asyncio.gather(*(p.stop() for p in self.by_url.values()))
        if self.kv is not None:
            await self.kv.stop()

    async def refresh(self) -> None:
        """Makes the peers match the targets (a dns target whose lookup fails keeps its peers)."""
        known = {u: p.source for u, p in self.by_url.items()}
        wanted, self.dns_error = await members(self.targets, known, self.what)
        for url, source in wanted.items():
            if url not in self.by_url:
                self.by_url[url] = await self._join(url, source)
                if source != url:
                    self.log.info("%s %s joined %s", self.name, url, source)
        for url in [u for u in self.by_url if u not in wanted]:
            await self.remove(url)

    async def remove(self, url: str) -> None:
        self.log.info("%s %s left %s", self.name, url, self.by_url[url].source)
        peer = self.by_url.pop(url)
        if self.kv is not None:
            self.kv.drop(url)
        await self._leave(peer)

    async def _watch_dns(self) -> None:
        while True:
            await asyncio.sleep(self.dns_refresh_s)
            try:
                await self.refresh()
            except Exception:  # a lookup must never end the watch
                self.log.exception("refreshing the %ss failed", self.name)

    def came_up(self, url: str) -> None:
        """A peer is up: the kv-aware choice reads its streams, as its /health names them, anew (perhaps a
        new process, whose first batch was published before this subscriber reconnected)."""
        peer = self.by_url.get(url)
        if peer is not None and self.kv is not None:
            self.kv.sync(peer, again=True)

    @property
    def any_up(self) -> bool:
        return any(p.is_up for p in self.by_url.values())

    def order(
        self, key: str | None, token_ids: list[int] | None = None, exclude: frozenset[str] = frozenset()
    ) -> list[tuple[P, str]]:
        """The peers (less those in exclude) a request tries, best first, each with the reason it is tried
        for (see the module's docstring); token_ids: the prompt's, for kv-aware."""
        pool = [p for u, p in self.by_url.items() if u not in exclude]
        by_url = {p.url: p for p in pool if p.is_up}
        down_urls = [p.url for p in pool if not p.is_up]
        down = [(self.by_url[u], "fallback") for u in hrw_order(key or "", down_urls)]
        if not by_url:
            return down
        ranked = [by_url[u] for u in hrw_order(key or "", list(by_url))]
        first, reason = 0, self.routing
        if self.kv is not None and token_ids is not None:
            costs = self.kv.rank(ranked, token_ids)
            ranked, reason = [p for _, _, p in costs], "kv-hit" if costs[0][1] else "kv-miss"
        elif self.routing == "round-robin":
            turn = next(self._turn) % len(ranked)
            ranked = sorted(ranked, key=lambda p: p.url)
            ranked = ranked[turn:] + ranked[:turn]
        elif self.routing == "least-loaded" or key is None:
            ranked.sort(key=lambda p: p.num_inflight)  # stable: ties keep the conversation's order
            reason = "least-loaded"
        else:
            total = sum(p.num_inflight for p in ranked)
            bound = max(self.load_floor, math.ceil((1.0 + self.load_slack) * (total + 1) / len(ranked)))
            first = next((i for i, p in enumerate(ranked) if p.num_inflight < bound), 0)
            reason = "affinity" if first == 0 else "overflow"
        rest = [(p, "failover") for i, p in enumerate(ranked) if i != first]
        return [(ranked[first], reason), *rest, *down]
