"""Rank selection policies: `affinity` (a conversation stays on one rank) and `least-loaded`."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol


class RankLoad(Protocol):
    """What a policy may look at: identity, liveness and load of a rank."""

    @property
    def index(self) -> int: ...
    @property
    def is_up(self) -> bool: ...
    @property
    def num_inflight(self) -> int: ...


def _least_loaded(up: Sequence[RankLoad]) -> RankLoad:
    return min(up, key=lambda r: (r.num_inflight, r.index))


class LeastLoadedRouter:
    name = "least-loaded"

    def pick(self, key: str | None, ranks: Sequence[RankLoad]) -> RankLoad | None:
        up = [r for r in ranks if r.is_up]
        return _least_loaded(up) if up else None


class AffinityRouter:
    """Rendezvous hashing of the key over the ranks that are up: a conversation keeps its rank (and so its
    prefix cache) across turns, and a rank going down moves only its own conversations."""

    name = "affinity"

    def pick(self, key: str | None, ranks: Sequence[RankLoad]) -> RankLoad | None:
        up = [r for r in ranks if r.is_up]
        if not up:
            return None
        if key is None:
            return _least_loaded(up)
        data = key.encode("utf-8", "surrogatepass")
        return max(
            up,
            key=lambda r: hashlib.blake2b(data, digest_size=8, salt=r.index.to_bytes(8, "little")).digest(),
        )


Router = AffinityRouter | LeastLoadedRouter
ROUTERS: dict[str, type[Router]] = {r.name: r for r in (AffinityRouter, LeastLoadedRouter)}


def make_router(name: str) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"unknown routing policy {name!r}; one of {sorted(ROUTERS)}")
    return ROUTERS[name]()
