"""Rank selection policies: `affinity` (a conversation stays on one rank), `least-loaded`, and `kv-aware`
(the rank whose caches hold most of the prompt, weighed against its load).

A policy's `pick` gives the rank for a request and why (the reason pdserve_rank_selected_total counts);
`hold` counts the request there while it runs (kv-aware's load term); `sync` reads what the ranks say
(kv-aware: their KV event streams, anew for a rank that came back), and `stop` ends that.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from pd.disagg.kv_choice import LOAD_WEIGHT, KVAwareChoice


class RankLoad(Protocol):
    """What a policy may look at: identity, liveness and load of a rank."""

    @property
    def index(self) -> int: ...
    @property
    def is_up(self) -> bool: ...
    @property
    def num_inflight(self) -> int: ...
    @property
    def num_restarts(self) -> int: ...


def _least_loaded(up: Sequence[RankLoad]) -> list[RankLoad]:
    return sorted(up, key=lambda r: (r.num_inflight, r.index))


def rendezvous(key: str, up: Sequence[RankLoad]) -> list[RankLoad]:
    """The ranks by rendezvous weight for key (blake2b of the key salted with the rank's index), highest
    first: a conversation keeps its rank, and a rank going down moves only its own conversations."""
    data = key.encode("utf-8", "surrogatepass")
    return sorted(
        up,
        key=lambda r: hashlib.blake2b(data, digest_size=8, salt=r.index.to_bytes(8, "little")).digest(),
        reverse=True,
    )


class _Stateless:
    """A policy that reads nothing from the ranks and holds nothing: sync, hold and stop do nothing."""

    kv: KVAwareChoice | None = None

    def sync(self, ranks: Sequence[RankLoad]) -> None:
        pass

    def hold(self, rank: RankLoad, token_ids: list[int]) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    async def stop(self) -> None:
        pass


class LeastLoadedRouter(_Stateless):
    name = "least-loaded"
    reasons = ("least-loaded",)

    def pick(
        self, key: str | None, ranks: Sequence[RankLoad], token_ids: list[int] | None = None
    ) -> tuple[RankLoad, str] | None:
        up = [r for r in ranks if r.is_up]
        return (_least_loaded(up)[0], "least-loaded") if up else None


class AffinityRouter(_Stateless):
    """Rendezvous hashing of the key over the ranks that are up (a request without a key goes to the least
    loaded): a conversation keeps its rank (and so its prefix cache) across turns."""

    name = "affinity"
    reasons = ("affinity", "least-loaded")

    def pick(
        self, key: str | None, ranks: Sequence[RankLoad], token_ids: list[int] | None = None
    ) -> tuple[RankLoad, str] | None:
        up = [r for r in ranks if r.is_up]
        if not up:
            return None
        if key is None:
            return _least_loaded(up)[0], "least-loaded"
        return rendezvous(key, up)[0], "affinity"


@dataclass
class RankPeer:
    """A rank as the kv-aware choice sees it (pd/disagg/kv_choice.py Peer): its name in the index and the
    series (its index), its one stream, and the work of the requests sent to it in flight."""

    url: str
    kv_events: list[dict[str, Any]]
    inflight_tokens: float = 0.0


class KVAwareRouter:
    """The rank with the lowest cost (pd/disagg/kv_choice.py: what it would still compute of the prompt,
    from its KV events, plus its work in flight at weight 1: a server's ranks compute apart, so the least
    time to the first token); ties, and a cold index, keep affinity's order ("kv-hit": the chosen rank
    holds some of the prompt; "kv-miss")."""

    name = "kv-aware"
    reasons = ("kv-hit", "kv-miss")

    def __init__(self, streams: list[dict[str, Any]], token: bytes | None = None) -> None:
        """streams: each rank's KV event stream (Coordinator.kv_event_streams); token: the cluster token,
        whose keys a stream bound off loopback needs."""
        if not streams:
            raise ValueError("--routing kv-aware reads the ranks' KV events: none are published")
        self.kv = KVAwareChoice(None, token, LOAD_WEIGHT)
        self._peers = {int(s["rank"]): RankPeer(str(s["rank"]), [s]) for s in streams}
        self._restarts: dict[int, int] = {}  # per rank, its restarts when its stream was last read

    def sync(self, ranks: Sequence[RankLoad]) -> None:
        """Reads the stream of every rank up; anew for one that restarted since (a new process, whose first
        batch may have gone before the old subscription reconnected: forgotten, replayed from the start)."""
        for r in ranks:
            seen = self._restarts.get(r.index)
            if r.is_up and r.index in self._peers and seen != r.num_restarts:
                self.kv.sync(self._peers[r.index], again=seen is not None)
                self._restarts[r.index] = r.num_restarts

    def pick(
        self, key: str | None, ranks: Sequence[RankLoad], token_ids: list[int] | None = None
    ) -> tuple[RankLoad, str] | None:
        self.sync(ranks)
        up = [r for r in ranks if r.is_up and r.index in self._peers]
        if not up:
            return None
        ordered = _least_loaded(up) if key is None else rendezvous(key, up)
        by_name = {self._peers[r.index].url: r for r in ordered}
        _, cached, peer = self.kv.rank([self._peers[r.index] for r in ordered], token_ids or [])[0]
        return by_name[peer.url], "kv-hit" if cached else "kv-miss"

    @contextlib.contextmanager
    def hold(self, rank: RankLoad, token_ids: list[int]) -> Iterator[None]:
        """Counts the prompt's work (its cost on rank, just computed by pick) in rank's load while it runs."""
        peer = self._peers[rank.index]
        work = self.kv.send(peer, token_ids)
        peer.inflight_tokens += work
        try:
            yield
        finally:
            peer.inflight_tokens -= work

    async def stop(self) -> None:
        await self.kv.stop()


Router = AffinityRouter | LeastLoadedRouter | KVAwareRouter
ROUTERS: dict[str, type[AffinityRouter | LeastLoadedRouter]] = {r.name: r for r in (AffinityRouter, LeastLoadedRouter)}


def make_router(name: str, streams: list[dict[str, Any]] | None = None, token: bytes | None = None) -> Router:
    """The policy `name`; kv-aware reads streams (each rank's KV events) with token (see KVAwareRouter)."""
    if name == KVAwareRouter.name:
        return KVAwareRouter(streams or [], token)
    if name not in ROUTERS:
        raise ValueError(f"unknown routing policy {name!r}; one of {sorted([*ROUTERS, KVAwareRouter.name])}")
    return ROUTERS[name]()
