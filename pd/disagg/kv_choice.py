"""The kv-aware choice of PE (--pe-routing kv-aware): each PE's cost for a prompt is what it would still
compute plus what it has queued, read from the prefix index its ranks' KV events keep (pd/kv_events/).

    work(PE)  = (prompt tokens - its cached prefix) + HOST_TOKEN_COST * its cached prefix
    cost(PE)  = work(PE) + load_weight * the work of the prompts it has in flight   (--kv-load-weight)

A PE's cached prefix is the longest one any of its ranks holds (a PE's own rank choice may still send the
request to another of its ranks), or the longest one this CE sent it within ROUTED_TTL_S: a prompt's
pages reach the index only once its prefill is done, and a second prompt with the same head arriving
meanwhile belongs where the first went. A cached token costs HOST_TOKEN_COST of a computed one: a PE's
cache is its host tier, copied to the device (about a tenth of a prefill token's time on the CPU runs
here). The load term counts each in-flight prompt at the work it was chosen for (a prompt that hit costs
its PE little), and spreads a hot prefix: once the PE that holds it has more work queued than a cold PE
would do, the next request goes to the cold one (which then caches the prefix too). Ties keep the
conversation's rendezvous order.

A PE's streams come from its /health ("kv_events": each rank's endpoint, replay endpoint and topic; a
wildcard host is the PE's own host). A PE that publishes none has nothing cached here: its cost is the
whole prompt plus its load.

The same choice serves the router's CE choice (`pdserve router --routing kv-aware`, pd/router/backends.py)
and a server's rank choice (`--routing kv-aware`, pd/frontend/router.py: each rank a peer of one stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.core.prefix_cache import chain_hashes
from pd.kv_events.index import PrefixIndex, Subscription
from pd.kv_events.publisher import curve_keys, endpoint_host, is_loopback

log = logging.getLogger(__name__)


class Peer(Protocol):
    """An engine a choice ranks: a PE (pd/disagg/prefill_client.py) or, at the router, a CE."""

    url: str
    kv_events: list[dict[str, Any]]  # its ranks' KV event streams, as its /health last named them
    inflight_tokens: float  # the work of the prompts it has in flight


P = TypeVar("P", bound=Peer)

HOST_TOKEN_COST = 0.1
LOAD_WEIGHT = 1.0  # a queued token of work against one of this prompt's (--kv-load-weight; a CE's PE choice: 0.25)
ROUTED_TTL_S = 30.0  # a prompt sent to a PE counts as held there this long (its events come after its prefill)
MAX_ROUTED_PAGES = 1 << 16  # per PE
WILDCARDS = ("*", "0.0.0.0", "::", "")


def connectable(endpoint: str, url: str) -> str:
    """endpoint with a wildcard host replaced by the host of url (the PE as this CE reaches it)."""
    host, port = endpoint_host(endpoint), endpoint.rsplit(":", 1)[1]
    if host in WILDCARDS:
        host = urlsplit(url).hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port}"


def is_exposed(stream: dict[str, Any]) -> bool:
    """Whether a stream's publisher speaks CURVE: it binds an address other than loopback (a wildcard
    too, reached here through loopback or not; pd/kv_events/publisher.py)."""
    bound = (stream.get("endpoint"), stream.get("replay_endpoint"))
    return any(isinstance(e, str) and not is_loopback(e) for e in bound)


class KVAwareChoice:
    def __init__(self, block_size: int | None, token: bytes | None, load_weight: float = LOAD_WEIGHT) -> None:
        """block_size: the engines' page size (None: the first stream's, as its /health names it); token:
        the cluster token, whose CURVE keys a stream off loopback needs (None: such streams are left out)."""
        self.index = PrefixIndex(block_size or 0)
        self.load_weight = load_weight
        self._token = token
        self._subs: dict[str, tuple[tuple[Any, ...], list[Subscription]]] = {}  # PE URL -> (its streams, subs)
        self._stopping: set[asyncio.Task[None]] = set()
        self._routed: dict[str, OrderedDict[bytes, float]] = {}  # PE URL -> {page hash: when sent}, oldest first
        self._last: tuple[list[int] | None, list[bytes]] = (None, [])
        self._ranked: tuple[list[int] | None, dict[str, int]] = (None, {})  # the last rank(): prompt, URL -> cached
        self.sent_tokens: Counter[str] = Counter()  # per engine URL: prompt tokens sent to it
        self.sent_cached_tokens: Counter[str] = Counter()  # of those, what the index said it held

    def sync(self, client: Peer, again: bool = False) -> None:
        """Subscribes to the streams client's /health names (again, if they changed, or if `again`: the
        engine came back up, perhaps a new process whose first batch, AllBlocksCleared, was published
        before this subscriber reconnected; a new subscription forgets the engine and replays its
        stream from the start)."""
        streams = tuple(
            (int(s["rank"]), connectable(s["endpoint"], client.url),
             None if s.get("replay_endpoint") is None else connectable(s["replay_endpoint"], client.url),
             str(s.get("topic") or ""), s.get("block_size") if isinstance(s.get("block_size"), int) else None,
             is_exposed(s))
            for s in client.kv_events
            if isinstance(s, dict) and isinstance(s.get("endpoint"), str)
        )  # fmt: skip
        known = self._subs.get(client.url)
        if known is not None and known[0] == streams and not again:
            return
        self.drop(client.url)
        subs = []
        for rank, endpoint, replay, topic, block_size, exposed in streams:
            if block_size is not None and self.index.block_size in (0, block_size):
                self.index.block_size = block_size
            elif block_size is not None or not self.index.block_size:
                log.warning("KV events of %s at %s left out: pages of %s tokens, this index's are %s", client.url,
                            endpoint, block_size, self.index.block_size or "unknown")  # fmt: skip
                continue
            key = None
            if exposed:
                if self._token is None:
                    log.warning("KV events of %s at %s left out: no cluster token (PDSERVE_CLUSTER_TOKEN) for "
                                "their keys", client.url, endpoint)  # fmt: skip
                    continue
                key = curve_keys(self._token)[0]
            sub = Subscription(self.index, f"{client.url}#{rank}", endpoint, replay, topic, server_key=key)
            sub.start()
            subs.append(sub)
        self._subs[client.url] = (streams, subs)

    def drop(self, url: str) -> None:
        """Forgets a PE (it left): its subscriptions stop, its entries go."""
        _, subs = self._subs.pop(url, ((), []))
        self._routed.pop(url, None)
        for sub in subs:
            self.index.forget(sub.engine)
            task = asyncio.get_running_loop().create_task(sub.stop())
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def stop(self) -> None:
        for url in list(self._subs):
            self.drop(url)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._stopping)

    def _keys(self, token_ids: list[int]) -> list[bytes]:
        """The prompt's page hashes, computed once for its choice and its attempt (the same list)."""
        if self._last[0] is not token_ids:
            self._last = (token_ids, chain_hashes(token_ids, self.index.block_size))
        return self._last[1]

    def _routed_tokens(self, url: str, keys: list[bytes], now: float) -> int:
        """The prompt's prefix sent to url's PE within ROUTED_TTL_S (its events may not have come yet)."""
        routed = self._routed.get(url)
        if not routed:
            return 0
        while routed and next(iter(routed.values())) < now - ROUTED_TTL_S:
            routed.popitem(last=False)
        n = 0
        for k in keys:
            if k not in routed:
                break
            n += 1
        return n * self.index.block_size

    def cached_tokens(self, clients: Sequence[Peer], token_ids: list[int]) -> list[int]:
        """Per PE of clients, the longest prefix of token_ids any of its ranks holds (one index lookup) or
        that was sent to it within ROUTED_TTL_S."""
        if not self.index.block_size:
            return [0] * len(clients)  # no stream known yet, and none sent
        keys, now = self._keys(token_ids), time.monotonic()
        engines = {c.url: [s.engine for s in self._subs.get(c.url, ((), []))[1]] for c in clients}
        found = self.index.match_keys(keys, [e for group in engines.values() for e in group])
        held = [max((found[e].any_tokens for e in engines[c.url]), default=0) for c in clients]
        return [min(len(token_ids), max(h, self._routed_tokens(c.url, keys, now))) for c, h in zip(clients, held)]

    def send(self, client: Peer, token_ids: list[int]) -> float:
        """token_ids go to client's engine: its pages count as held there for ROUTED_TTL_S from now.
        Returns what they cost it, in prompt tokens (its cached prefix at HOST_TOKEN_COST a token: the
        work its load term counts while the request runs)."""
        prompt, known = self._ranked
        cached = known[client.url] if prompt is token_ids and client.url in known else (
            self.cached_tokens([client], token_ids)[0])  # fmt: skip
        self.sent_tokens[client.url] += len(token_ids)
        self.sent_cached_tokens[client.url] += cached
        work = len(token_ids) - cached + HOST_TOKEN_COST * cached
        if not self.index.block_size:
            return work
        routed = self._routed.setdefault(client.url, OrderedDict())
        now = time.monotonic()
        for k in self._keys(token_ids):
            routed[k] = now
            routed.move_to_end(k)
        while len(routed) > MAX_ROUTED_PAGES:
            routed.popitem(last=False)
        return work

    def rank(self, ranked: list[P], token_ids: list[int]) -> list[tuple[float, int, P]]:
        """[(cost, cached tokens, PE)], cheapest first; ties keep ranked's order (the rendezvous order)."""
        n = len(token_ids)
        for c in ranked:
            self.sync(c)
        costs = []
        for i, (c, cached) in enumerate(zip(ranked, self.cached_tokens(ranked, token_ids))):
            work = n - cached + HOST_TOKEN_COST * cached
            costs.append((work + self.load_weight * c.inflight_tokens, i, cached, c))
        self._ranked = (token_ids, {c.url: cached for _, _, cached, c in costs})  # send() follows at once
        costs.sort(key=lambda t: (t[0], t[1]))
        return [(cost, cached, c) for cost, _, cached, c in costs]

    def subscriptions(self) -> Iterator[tuple[str, Subscription]]:
        """(engine URL, one of its ranks' subscriptions), for every stream read now."""
        for url, (_, subs) in self._subs.items():
            for s in subs:
                yield url, s

    def describe(self) -> dict[str, Any]:
        subs = [s for _, s in self.subscriptions()]
        return {
            "blocks": self.index.num_blocks(),
            "streams": len(subs),
            "gaps": sum(s.num_gaps for s in subs),
            "restarts": sum(s.num_restarts for s in subs),
        }


class KVIndexCollector:
    """A kv-aware chooser's state as Prometheus series at scrape time (its registry's collector): per
    engine rank, the pages its index holds, the last event batch's lag, gaps and restarts; per engine,
    the prompt tokens sent to it and how many of them the index said it held (the hit ratio the choice
    expected; the engine's own vllm:prefix_cache_hits say what it found)."""

    def __init__(self, choice: Callable[[], KVAwareChoice | None], prefix: str, label: str | None, what: str) -> None:
        """label: the label naming an engine (its URL), beside each stream's rank; None: the engines are
        this server's own ranks (a rank's URL is its index, one stream each), labelled by rank alone."""
        self.choice, self.prefix, self.label, self.what = choice, prefix, label, what

    def collect(self) -> Iterator[Metric]:
        p = self.prefix
        one, engine = (f"{self.what} rank", self.what) if self.label else ("rank", "rank")
        ranked = [self.label, "rank"] if self.label else ["rank"]
        engines = [self.label or "rank"]
        blocks = GaugeMetricFamily(f"{p}_kv_index_blocks", f"Pages the kv-aware index holds for each {one} "
                                   "(both tiers), from its KV events", labels=ranked)  # fmt: skip
        lag = GaugeMetricFamily(f"{p}_kv_events_lag_seconds", f"Arrival of each {one}'s last KV event batch "
                                "minus its publisher's timestamp (wall clocks)", labels=ranked)  # fmt: skip
        gaps = CounterMetricFamily(f"{p}_kv_events_gaps", f"Gaps in a {one}'s KV event sequence (filled from "
                                   "its replay socket, or the rank's entries cleared)", labels=ranked)  # fmt: skip
        restarts = CounterMetricFamily(f"{p}_kv_events_restarts", f"Restarts seen in a {one}'s KV event "
                                       "stream (its entries cleared)", labels=ranked)  # fmt: skip
        sent = CounterMetricFamily(f"{p}_kv_sent_tokens", f"Prompt tokens the kv-aware choice sent to each {engine}",
                                   labels=engines)  # fmt: skip
        cached = CounterMetricFamily(f"{p}_kv_sent_cached_tokens", f"Of the prompt tokens sent to each {engine}, "
                                     "those the index said it held (over the above: the hit ratio the choice "
                                     "expected)", labels=engines)  # fmt: skip
        c = self.choice()
        if c is not None:
            for url, s in c.subscriptions():
                rank = s.engine.rpartition("#")[2]
                values = [url, rank] if self.label else [rank]
                blocks.add_metric(values, c.index.num_blocks(s.engine))
                lag.add_metric(values, s.lag_s)
                gaps.add_metric(values, s.num_gaps)
                restarts.add_metric(values, s.num_restarts)
            for url, n in c.sent_tokens.items():
                sent.add_metric([url], n)
                cached.add_metric([url], c.sent_cached_tokens[url])
        yield from (blocks, lag, gaps, restarts, sent, cached)
