"""Choosing a rank (pd/frontend/router.py): affinity is sticky and spreads, least loaded, none when all are down."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pd.frontend.router import AffinityRouter, LeastLoadedRouter, make_router


@dataclass
class _Rank:
    index: int
    is_up: bool = True
    num_inflight: int = 0
    num_restarts: int = 0


def test_affinity_is_sticky_and_spreads():
    ranks = [_Rank(i) for i in range(4)]
    r = AffinityRouter()
    picks = {k: r.pick(f"conversation {k}", ranks)[0].index for k in range(200)}
    assert all(r.pick(f"conversation {k}", ranks) == (ranks[v], "affinity") for k, v in picks.items())
    assert len(set(picks.values())) == 4
    ranks[1].is_up = False  # only rank 1's conversations move
    for k, v in picks.items():
        now = r.pick(f"conversation {k}", ranks)[0].index
        assert now != 1 and (now == v or v == 1)
    assert r.pick(None, ranks) == (ranks[0], "least-loaded")


def test_least_loaded_and_all_down():
    ranks = [_Rank(0, num_inflight=3), _Rank(1, num_inflight=1), _Rank(2, is_up=False)]
    assert LeastLoadedRouter().pick("x", ranks) == (ranks[1], "least-loaded")
    for name in ("affinity", "least-loaded"):
        assert make_router(name).pick("x", [_Rank(0, is_up=False)]) is None
    with pytest.raises(ValueError):
        make_router("random")
