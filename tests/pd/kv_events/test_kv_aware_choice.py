"""The kv-aware choice of PE (issue 51; pd/disagg/kv_choice.py): PEs here are PrefillClients whose state
the test sets, each naming a real KV event publisher on loopback as its /health would; the pool
subscribes to them and picks the PE with the least left to compute plus queued."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from engine.config import KVEventsConfig
from engine.core.kv_events import MEDIUM_CPU, BlockStored
from engine.core.prefix_cache import chain_hashes
from pd.disagg.kv_choice import HOST_TOKEN_COST, connectable
from pd.disagg.membership import hrw_order
from pd.disagg.metrics import ClusterMetrics
from pd.disagg.prefill_pool import PrefillPool
from pd.kv_events.publisher import KVEventPublisher
from pd.tools.server_process import free_port

BS = 16
TOKEN = b"kv-aware-test-token-0123456789abcdef"
PROMPT = list(range(1000, 1000 + 5 * BS + 3))


def publisher() -> KVEventPublisher:
    cfg = KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    return KVEventPublisher(cfg, rank=0, token=None)


def announce(pub: KVEventPublisher, tokens: list[int], num_pages: int) -> None:
    keys = chain_hashes(tokens[: num_pages * BS], BS)
    pub.publish([BlockStored(tuple(keys), None, tuple(tokens[: num_pages * BS]), BS, MEDIUM_CPU)])


async def until(cond: Any, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.05)


def test_a_wildcard_host_is_the_pes_own():
    assert connectable("tcp://*:5557", "http://127.0.0.5:8889") == "tcp://127.0.0.5:5557"
    assert connectable("tcp://0.0.0.0:5557", "http://[::1]:8889") == "tcp://[::1]:5557"
    assert connectable("tcp://127.0.0.9:5557", "http://127.0.0.5:8889") == "tcp://127.0.0.9:5557"


async def test_the_pe_holding_the_prefix_wins_until_its_queue_outweighs_it():
    pubs = [publisher(), publisher()]
    urls = [f"http://127.0.0.{i + 2}:{free_port()}" for i in range(2)]
    pool = PrefillPool(",".join(urls), TOKEN, 5.0, ClusterMetrics(CollectorRegistry()), "kv-aware", block_size=BS,
                       kv_load_weight=1.0)  # fmt: skip
    await pool.start()
    try:
        for c, pub in zip(pool.clients.values(), pubs):
            c._watch_task.cancel()  # type: ignore[union-attr]  # the test owns each PE's state
            c.kv_events = [{"rank": 0, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "topic": ""}]
            c.state = "up"
        assert pool.reasons[:2] == ("kv-hit", "kv-miss")
        # a key whose rendezvous order puts urls[0] first
        key = next(k for k in (f"conversation {i}" for i in range(100)) if hrw_order(k, urls)[0] == urls[0])
        # the second PE holds 4 of the prompt's 5 pages, announced before anyone subscribed
        announce(pubs[1], PROMPT, 4)
        await asyncio.sleep(0.2)
        # nothing known yet: the conversation's order decides (and the pool subscribes to both PEs, whose
        # history comes from their replay sockets)
        assert pool.choose(key, token_ids=PROMPT) == (pool.clients[urls[0]], "kv-miss")
        assert pool.kv is not None
        await until(lambda: pool.kv.cached_tokens([pool.clients[urls[1]]], PROMPT) == [4 * BS])
        second = pool.clients[urls[1]]
        assert pool.choose(key, token_ids=PROMPT) == (second, "kv-hit")
        # a queue on it: the cold PE computes the whole prompt (83 tokens), the warm one 19 + its copy
        # cost + what it has queued; past the difference the cold one is cheaper
        warm_cost = len(PROMPT) - 4 * BS + HOST_TOKEN_COST * 4 * BS
        with pool.attempt(second, "kv-hit", num_tokens=int(len(PROMPT) - warm_cost) - 1):
            assert pool.choose(key, token_ids=PROMPT)[0] is second
        with pool.attempt(second, "kv-hit", num_tokens=int(len(PROMPT) - warm_cost) + 1):
            assert pool.choose(key, token_ids=PROMPT) == (pool.clients[urls[0]], "kv-miss")
        # another prompt (no shared page): the conversation's order again
        assert pool.choose(key, token_ids=[7] * 40) == (pool.clients[urls[0]], "kv-miss")
        # a PE going away takes its entries with it
        await pool.peers.remove(urls[1])
        await asyncio.sleep(0.1)
        assert pool.kv.index.num_blocks() == 0
        assert pool.kv.describe()["streams"] == 1
    finally:
        await pool.stop()
        for pub in pubs:
            pub.close()


async def test_a_prompt_in_flight_draws_its_followers_and_loads_its_pe_by_its_work():
    """No events at all (the first prefill has not finished): a second prompt with the same head goes where
    the first went, a prompt that hit loads its PE by what it costs there, and the memory ends with the
    PE's retirement."""
    urls = [f"http://127.0.0.{i + 2}:{free_port()}" for i in range(2)]
    registry = CollectorRegistry()
    pool = PrefillPool(",".join(urls), TOKEN, 5.0, ClusterMetrics(registry), "kv-aware", block_size=BS,
                       kv_load_weight=1.0)  # fmt: skip
    await pool.start()
    try:
        for c in pool.clients.values():
            c._watch_task.cancel()  # type: ignore[union-attr]  # the test owns each PE's state
            c.state = "up"
        assert pool.kv is not None
        key = next(k for k in (f"conversation {i}" for i in range(100)) if hrw_order(k, urls)[0] == urls[0])
        home, other = pool.clients[urls[0]], pool.clients[urls[1]]
        first = PROMPT
        follower = PROMPT[: 4 * BS] + [5] * 30  # the first's 4 pages, then its own
        assert pool.choose(key, token_ids=first) == (home, "kv-miss")
        with pool.attempt(home, "kv-miss", token_ids=first):
            assert home.inflight_tokens == len(first)  # nothing cached: the whole prompt
            # home has the first prompt's work queued (83), other is idle; the follower's pages are
            # home's already: 30 + 2 tokens of work + 83 queued there, 94 on other
            assert pool.choose(key, token_ids=follower) == (other, "kv-miss")
            # a follower on a key whose order puts other first still finds home cheaper once the
            # shared head is long enough: 3 tokens of its own
            short = PROMPT[: 4 * BS] + [5] * 3
            assert pool.kv.cached_tokens([home, other], short) == [4 * BS, 0]
            with pool.attempt(home, "kv-hit", token_ids=short):
                assert home.inflight_tokens == len(first) + 3 + HOST_TOKEN_COST * 4 * BS
        assert home.inflight_tokens == 0 and other.inflight_tokens == 0
        # the pool's series: prompt tokens sent per PE, and those it expected to be cached there
        text = generate_latest(registry).decode()
        assert f'pdserve_pe_kv_sent_tokens_total{{pe="{home.url}"}} {float(len(first) + len(short))}' in text
        assert f'pdserve_pe_kv_sent_cached_tokens_total{{pe="{home.url}"}} {float(4 * BS)}' in text
        # once the first is done, the follower goes where its head is
        assert pool.choose(key, token_ids=follower) == (home, "kv-hit")
        # with a key that ranks other first too
        key2 = next(k for k in (f"conversation {i}" for i in range(100)) if hrw_order(k, urls)[0] == urls[1])
        assert pool.choose(key2, token_ids=follower) == (home, "kv-hit")
        assert pool.choose(key2, token_ids=[9] * 40) == (other, "kv-miss")
        await pool.peers.remove(urls[0])
        assert pool.kv.cached_tokens([home], follower) == [0]
    finally:
        await pool.stop()
