"""--routing kv-aware (pd/frontend/router.py KVAwareRouter): a server's ranks as candidates of the kv-aware
choice, each with a real KV event publisher on loopback as Coordinator.kv_event_streams names it; the
ranks' liveness, load and restarts are the test's."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from typing import Any

import pytest

from engine.config import KVEventsConfig
from engine.core.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockStored
from engine.core.prefix_cache import chain_hashes
from pd.disagg.kv_choice import HOST_TOKEN_COST
from pd.frontend.router import KVAwareRouter, make_router, rendezvous
from pd.kv_events.publisher import KVEventPublisher, offset_endpoint
from pd.tools.server_process import free_port

BS = 16
PROMPT = list(range(1000, 1000 + 5 * BS + 3))
TOKEN = b"kv-aware-ranks-token-0123456789abcdef"


@dataclass
class _Rank:
    index: int
    is_up: bool = True
    num_inflight: int = 0
    num_restarts: int = 0


def streams(config: KVEventsConfig, n: int) -> list[dict[str, Any]]:
    """What Coordinator.kv_event_streams says for n ranks publishing with config."""
    return [{"rank": i, "endpoint": offset_endpoint(config.endpoint, i), "topic": "", "block_size": BS,
             "replay_endpoint": offset_endpoint(config.replay_endpoint or "", i)} for i in range(n)]  # fmt: skip


def free_ports(n: int) -> int:
    """The first of n consecutive free ports (a rank's KV event port is the configured one + its rank)."""
    while True:
        first = free_port()
        try:
            held = []
            for i in range(1, n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", first + i))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()


def config(host: str = "127.0.0.1") -> KVEventsConfig:
    """Endpoints for two ranks."""
    return KVEventsConfig(True, endpoint=f"tcp://{host}:{free_ports(2)}", replay_endpoint=f"tcp://{host}:{free_ports(2)}")


def announce(pub: KVEventPublisher, tokens: list[int], num_pages: int) -> None:
    keys = chain_hashes(tokens[: num_pages * BS], BS)
    pub.publish([BlockStored(tuple(keys), None, tuple(tokens[: num_pages * BS]), BS, MEDIUM_CPU)])


async def until(cond: Any, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.05)


def key_first(rank: int, ranks: list[_Rank]) -> str:
    """A conversation key whose rendezvous order puts rank first."""
    return next(k for k in (f"conversation {i}" for i in range(100)) if rendezvous(k, ranks)[0].index == rank)


def publish_again(cfg: KVEventsConfig, rank: int) -> KVEventPublisher:
    """A new publisher on rank's ports (a restarted rank's), once the old one's ports are free."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return KVEventPublisher(cfg, rank, None)
        except ValueError:  # the port is still bound
            assert time.monotonic() < deadline
            time.sleep(0.1)


async def test_the_rank_holding_the_prefix_wins_until_its_queue_outweighs_it():
    cfg = config()
    pubs = [KVEventPublisher(cfg, i, None) for i in range(2)]
    ranks = [_Rank(0), _Rank(1)]
    router = make_router("kv-aware", streams(cfg, 2))
    assert isinstance(router, KVAwareRouter) and router.kv is not None
    try:
        key = key_first(0, ranks)
        announce(pubs[1], PROMPT, 4)  # before anyone subscribed: the replay gives it
        router.sync(ranks)
        await until(lambda: router.kv.cached_tokens([router._peers[1]], PROMPT) == [4 * BS])
        assert router.pick(key, ranks, PROMPT) == (ranks[1], "kv-hit")
        # a prompt no rank holds: the conversation's order (affinity's), as without events
        other = [7] * 40
        assert router.pick(key, ranks, other) == (ranks[0], "kv-miss")
        # other work queued on rank 1: up to what its prefix saves (64 x 0.9), the warm rank still wins;
        # past it the cold rank is cheaper (a hot head spreads)
        saved = 4 * BS * (1 - HOST_TOKEN_COST)
        with router.hold(ranks[1], [9] * int(saved)):
            assert router.pick(key, ranks, PROMPT) == (ranks[1], "kv-hit")
        with router.hold(ranks[1], [8] * (int(saved) + 1)):  # (not the last filler: its pages count as there)
            assert router.pick(key, ranks, PROMPT) == (ranks[0], "kv-miss")
        assert router._peers[1].inflight_tokens == 0
        # the prompt's work counts in its rank's load while it runs: 19 tokens left, 64 at their copy cost
        # (and its pages count as held there from now: its events come after its prefill)
        assert router.pick(key, ranks, PROMPT) == (ranks[1], "kv-hit")
        with router.hold(ranks[1], PROMPT):
            assert router._peers[1].inflight_tokens == pytest.approx(19 + HOST_TOKEN_COST * 64)
        assert router._peers[1].inflight_tokens == 0
        assert router.kv.cached_tokens([router._peers[1]], PROMPT) == [5 * BS]
        # a rank down is no candidate; none up: no choice
        ranks[1].is_up = False
        assert router.pick(key, ranks, PROMPT)[0] is ranks[0]
        ranks[0].is_up = False
        assert router.pick(key, ranks, PROMPT) is None
    finally:
        await router.stop()
        for pub in pubs:
            pub.close()


async def test_a_rank_that_restarts_is_read_anew():
    """A restarted rank's first batch (AllBlocksCleared) may go before the old subscription reconnects:
    the router reads its stream from the start again, so the old process's pages are gone from the index."""
    cfg = config()
    pubs = [KVEventPublisher(cfg, i, None) for i in range(2)]
    ranks = [_Rank(0), _Rank(1)]
    router = make_router("kv-aware", streams(cfg, 2))
    assert router.kv is not None
    try:
        router.sync(ranks)
        await asyncio.sleep(0.3)  # PUB drops what it sends before a subscription reaches it
        old, new = PROMPT, [5] * (3 * BS)
        announce(pubs[1], old, 4)
        await until(lambda: router.kv.cached_tokens([router._peers[1]], old) == [4 * BS])
        pubs[1].close()
        ranks[1].is_up, ranks[1].num_restarts = False, 1
        pubs[1] = publish_again(cfg, 1)
        # the new process's sequence runs past the old one's (a subscription that missed its first batch
        # would fill the gap from the new replay without clearing the old pages)
        pubs[1].publish([AllBlocksCleared()])
        for _ in range(3):
            announce(pubs[1], [6] * BS, 1)
        announce(pubs[1], new, 3)
        await until(lambda: len(pubs[1]._buffer) == 5)  # the replay holds them
        ranks[1].is_up = True
        assert router.pick(None, ranks, new) is not None  # the choice sees the restart
        await until(lambda: router.kv.cached_tokens([router._peers[1]], new) == [3 * BS])
        assert router.kv.cached_tokens([router._peers[1]], old) == [0]
    finally:
        await router.stop()
        for pub in pubs:
            pub.close()


async def test_a_stream_bound_to_every_address_is_read_with_the_tokens_keys():
    """--kv-events-config's endpoint on a wildcard (the cluster guide's): the ranks' sockets are CURVE
    servers, reached here through loopback, and the router reads them with the cluster token's keys."""
    cfg = config("*")
    pub = KVEventPublisher(cfg, 0, TOKEN)
    ranks = [_Rank(0)]
    router = make_router("kv-aware", streams(cfg, 1), TOKEN)
    assert router.kv is not None
    try:
        announce(pub, PROMPT, 2)
        router.sync(ranks)
        await until(lambda: router.kv.cached_tokens([router._peers[0]], PROMPT) == [2 * BS])
    finally:
        await router.stop()
        pub.close()


def test_kv_aware_needs_the_ranks_events():
    from engine.config import EngineConfig
    from pd.config import ServerConfig

    with pytest.raises(ValueError, match="--kv-events-config"):
        ServerConfig(routing="kv-aware")
    with pytest.raises(ValueError, match="--kv-events-config"):
        ServerConfig(routing="kv-aware", engine=EngineConfig(kv_events_config='{"enable_kv_cache_events": false}'))
    with pytest.raises(ValueError, match="none are published"):
        make_router("kv-aware", [])
