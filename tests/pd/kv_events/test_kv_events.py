"""KV cache events (issue 51): what the caches log, vLLM's wire format read with vLLM's published example
types (msgspec, array_like, tagged), and a publisher's stream into the prefix index over real ZeroMQ
sockets on loopback: gaps filled from the replay socket, a restarted publisher clearing its engine, and a
stream off loopback that only a holder of the cluster token can read."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from engine.config import KVEventsConfig
from engine.core.block_pool import BlockPool
from engine.core.decode_cache import DecodeCache
from engine.core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
    for_engine,
)
from engine.core.prefix_cache import PrefixIndex as HostIndex
from engine.core.prefix_cache import chain_hashes
from pd.kv_events.index import Cached, PrefixIndex, Subscription
from pd.kv_events.publisher import KVEventPublisher, curve_keys
from pd.kv_events.wire import decode_batch, encode_batch
from pd.tools.server_process import free_port

BS = 4
TOKENS = list(range(100, 118))  # 4 full pages and 2 tokens
KEYS = chain_hashes(TOKENS, BS)
TOKEN = b"kv-events-test-cluster-token-0123456789"


# ---- what the caches log -----------------------------------------------------------------------------


def test_the_host_cache_logs_pages_once_usable_and_when_evicted():
    index = HostIndex(num_pages=4, num_states=0, block_size=BS, needs_state=False)
    log = index.events = KVEventLog(enabled=True)
    assert log.drain() == [AllBlocksCleared()]  # a new engine holds nothing
    index.plan_store(TOKENS, 2, with_state=False)
    assert log.drain() == []  # not before the copies are done
    index.commit_store()
    assert log.drain() == [BlockStored(tuple(KEYS[:2]), None, tuple(TOKENS[:8]), BS, MEDIUM_CPU)]
    index.plan_store(TOKENS, 4, with_state=False)  # pages 2, 3 are new: a run whose parent is page 1
    index.commit_store()
    assert log.drain() == [BlockStored(tuple(KEYS[2:4]), KEYS[1], tuple(TOKENS[8:16]), BS, MEDIUM_CPU)]
    other = [7] * 8  # a full pool: the least recently used page goes for each new one
    index.plan_store(other, 1, with_state=False)
    index.commit_store()
    removed, stored = log.drain()
    assert isinstance(removed, BlockRemoved) and removed.medium == MEDIUM_CPU and len(removed.block_hashes) == 1
    assert removed.block_hashes[0] in KEYS
    assert stored == BlockStored((chain_hashes(other, BS)[0],), None, tuple(other[:4]), BS, MEDIUM_CPU)


def test_the_decode_cache_logs_retained_pages_and_evictions_on_the_gpu_tier():
    pool = BlockPool(4)
    cache = DecodeCache(pool, BS)
    log = cache.events = KVEventLog(enabled=True)
    log.drain()
    blocks = pool.allocate(4)
    assert cache.retain(TOKENS[:16], blocks) == 4
    pool.free(blocks)
    assert log.drain() == [BlockStored(tuple(KEYS), None, tuple(TOKENS[:16]), BS, MEDIUM_GPU)]
    pool.allocate(1)  # takes an evictable page
    (removed,) = log.drain()
    assert isinstance(removed, BlockRemoved) and removed.medium == MEDIUM_GPU and removed.block_hashes[0] in KEYS


def test_a_log_off_records_nothing_and_the_engine_log_reaches_both_caches():
    off = KVEventLog(enabled=False)
    off.stored(KEYS, None, TOKENS, BS, MEDIUM_GPU)
    assert off.drain() == []
    pool = BlockPool(4)
    cache = DecodeCache(pool, BS)
    log = for_engine(True, None, cache)
    assert cache.events is log


def test_the_config_is_vllms_and_refuses_what_it_cannot_honour():
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv-events"}')
    assert cfg.publishes and cfg.endpoint == "tcp://127.0.0.1:5557" and cfg.topic == "kv-events"
    for bad, word in [
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
        ('{"endpoint": "ipc:///tmp/x"}', "endpoint"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"enable_kv_events": true}', "unknown"),
        ("[1]", "object"),
        ("{", "JSON"),
    ]:
        with pytest.raises(ValueError, match=word):
            KVEventsConfig.parse(bad)


# ---- vLLM's wire format --------------------------------------------------------------------------------


# vLLM's published example types (examples/features/kv_events/kv_events_subscriber.py, vLLM 0.9-0.11's
# vllm/distributed/kv_events.py): what llm-d's and Dynamo's consumers decode
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class VllmBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VllmAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


def test_batches_decode_with_vllms_published_types():
    events = [
        AllBlocksCleared(),
        BlockStored(tuple(KEYS[:2]), None, tuple(TOKENS[:8]), BS, MEDIUM_GPU),
        BlockStored(tuple(KEYS[2:3]), KEYS[1], tuple(TOKENS[8:12]), BS, MEDIUM_CPU),
        BlockRemoved((KEYS[0],), MEDIUM_GPU),
    ]
    payload = encode_batch(events, dp_rank=3, ts=12.5)
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 3
    cleared, first, second, removed = batch.events
    assert isinstance(cleared, VllmAllBlocksCleared)
    assert first == VllmBlockStored(KEYS[:2], None, TOKENS[:8], BS, None, "GPU", None)
    assert second.parent_block_hash == KEYS[1] and second.medium == "CPU"
    assert removed == VllmBlockRemoved([KEYS[0]], "GPU")
    assert decode_batch(payload) == (12.5, events, 3)  # and our own reader gives back what was sent
    with pytest.raises(ValueError):
        decode_batch(b"\x93\x01")


# ---- the index -----------------------------------------------------------------------------------------


def test_the_index_matches_the_longest_held_run_per_engine_and_tier():
    index = PrefixIndex(BS)
    index.apply("a", [BlockStored(tuple(KEYS[:3]), None, tuple(TOKENS[:12]), BS, MEDIUM_GPU)])
    index.apply("b", [BlockStored(tuple(KEYS[:1]), None, tuple(TOKENS[:4]), BS, MEDIUM_GPU)])
    index.apply("b", [BlockStored(tuple(KEYS[1:4]), KEYS[0], tuple(TOKENS[4:16]), BS, MEDIUM_CPU)])
    got = index.match(TOKENS, ["a", "b", "c"])
    assert got == {"a": Cached(12, 12), "b": Cached(4, 16), "c": Cached(0, 0)}
    index.apply("a", [BlockRemoved((KEYS[1],), MEDIUM_GPU)])  # a hole ends the run
    assert index.match(TOKENS)["a"] == Cached(4, 4)
    index.apply("b", [BlockStored((KEYS[0],), None, (), 16, MEDIUM_GPU)])  # another page size: not ours
    index.apply("b", [AllBlocksCleared()])
    assert index.match(TOKENS)["b"] == Cached(0, 0) and index.num_blocks("b") == 0
    index.forget("a")
    assert index.engines == ["b"]


def test_the_index_is_bounded_per_engine_and_tier():
    index = PrefixIndex(BS, max_blocks=2)
    index.apply("a", [BlockStored(tuple(KEYS), None, tuple(TOKENS[:16]), BS, MEDIUM_GPU)])
    assert index.num_blocks("a") == 2 and index.match(TOKENS)["a"] == Cached(0, 0)  # the oldest went


# ---- a publisher into the index, over ZeroMQ -----------------------------------------------------------


def stored(i: int) -> list[Any]:
    return [BlockStored((KEYS[i],), KEYS[i - 1] if i else None, tuple(TOKENS[i * BS : (i + 1) * BS]), BS, MEDIUM_GPU)]


async def until(cond: Any, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)


async def rebind(make: Any) -> KVEventPublisher:
    """make() once the closed publisher's ports are free again (ZeroMQ releases them on its I/O thread)."""
    for _ in range(50):
        try:
            return make()
        except ValueError:
            await asyncio.sleep(0.1)
    return make()


def config(port: int, replay: int | None, host: str = "127.0.0.1") -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://{host}:{port}",
        replay_endpoint=None if replay is None else f"tcp://{host}:{replay}",
        topic="kv-events",
    )


async def publish_until(pub: KVEventPublisher, events: list[Any], seen: Any) -> None:
    """Publishes events every 0.1 s until seen() (a subscription connecting misses what PUB sent before)."""
    end = time.monotonic() + 20
    while not seen():
        assert time.monotonic() < end, "timed out"
        pub.publish(events)
        await asyncio.sleep(0.1)


async def test_a_stream_fills_the_index_replays_a_gap_and_a_restart_clears_it():
    port, replay = free_port(), free_port()
    pub = KVEventPublisher(config(port - 1, replay - 1), rank=1, token=None)  # ports + the rank
    assert pub.endpoint == f"tcp://127.0.0.1:{port}"
    index = PrefixIndex(BS)
    sub = Subscription(index, "ce0", pub.endpoint, pub.replay_endpoint, topic="kv-events")
    sub.start()
    try:
        await publish_until(pub, stored(0), lambda: sub.last_seq >= 0)
        assert index.match(TOKENS)["ce0"] == Cached(4, 4)
        # pages 1 and 2 go out while the subscriber is away: coming back, it catches up from the replay socket
        await asyncio.sleep(0.3)
        await sub.stop()
        last = sub.last_seq
        pub.publish(stored(1))
        pub.publish(stored(2))
        await asyncio.sleep(0.3)
        sub.start()
        await until(lambda: sub.last_seq >= last + 2)
        assert sub.num_replayed >= 2 and index.match(TOKENS)["ce0"] == Cached(12, 12)
        await publish_until(pub, stored(3), lambda: sub.last_seq > last + 2)
        assert index.match(TOKENS)["ce0"] == Cached(16, 16)
        for _ in range(30):  # the old publisher's sequence runs well ahead of the new one's
            pub.publish(stored(3))
        await until(lambda: sub.last_seq >= last + 30)
        # the engine restarts: a new publisher on the same ports counts from 0 again, its caches empty
        pub.close()
        pub = await rebind(lambda: KVEventPublisher(config(port - 1, replay - 1), rank=1, token=None))
        await publish_until(pub, [AllBlocksCleared(), *stored(0)], lambda: sub.num_restarts > 0)
        assert sub.num_restarts == 1 and index.match(TOKENS)["ce0"] == Cached(4, 4)
    finally:
        await sub.stop()
        pub.close()


async def test_a_gap_in_the_sequence_is_filled_from_the_replay_socket():
    pub = KVEventPublisher(config(free_port(), free_port()), rank=0, token=None)
    index = PrefixIndex(BS)
    sub = Subscription(index, "pe0", pub.endpoint, pub.replay_endpoint)  # fed by hand: not started
    try:
        for i in range(4):
            pub.publish(stored(i))  # buffered as batches 0..3 (nobody subscribes)
        await sub.receive(0, encode_batch(stored(0), 0))
        await asyncio.sleep(0.3)  # the publisher's thread has sent all four
        await sub.receive(3, encode_batch(stored(3), 0))  # 1 and 2 missed
        assert (sub.num_gaps, sub.num_replayed, sub.last_seq) == (1, 2, 3)
        assert index.match(TOKENS)["pe0"] == Cached(16, 16)
        await sub.receive(2, encode_batch(stored(2), 0, ts=0.0))  # a batch seen already: skipped
        assert sub.num_restarts == 0 and sub.last_seq == 3
    finally:
        pub.close()


async def test_a_gap_the_replay_cannot_cover_clears_the_engine():
    pub = KVEventPublisher(config(free_port(), None), rank=0, token=None)  # no replay socket
    index = PrefixIndex(BS)
    sub = Subscription(index, "pe0", pub.endpoint, None)
    try:
        await sub.receive(0, encode_batch(stored(0) + stored(1), 0))
        assert index.match(TOKENS)["pe0"] == Cached(8, 8)
        await sub.receive(5, encode_batch(stored(3), 0))  # 1..4 lost: what the index holds may be stale
        assert index.match(TOKENS)["pe0"] == Cached(0, 0) and sub.num_gaps == 1
    finally:
        pub.close()


def test_a_stream_off_loopback_needs_the_cluster_token():
    with pytest.raises(ValueError, match="cluster token"):
        KVEventPublisher(config(free_port(), None, host="*"), rank=0, token=None)


async def test_off_loopback_only_a_holder_of_the_token_reads_the_stream():
    port = free_port()
    pub = KVEventPublisher(config(port, None, host="*"), rank=0, token=TOKEN)  # every interface: CURVE
    endpoint = f"tcp://127.0.0.1:{port}"
    holder, stranger = PrefixIndex(BS), PrefixIndex(BS)
    subs = [
        Subscription(holder, "x", endpoint, None, server_key=curve_keys(TOKEN)[0]),
        Subscription(stranger, "x", endpoint, None, server_key=curve_keys(b"another-token-0123456789")[0]),
    ]
    plain = zmq.asyncio.Context.instance().socket(zmq.SUB)  # no CURVE at all
    plain.setsockopt(zmq.SUBSCRIBE, b"")
    plain.connect(endpoint)
    for s in subs:
        s.start()
    try:
        for _ in range(30):  # until the holder's handshake is done, a batch every 0.1 s
            pub.publish(stored(0))
            await asyncio.sleep(0.1)
            if holder.num_events:
                break
        assert holder.match(TOKENS)["x"] == Cached(4, 4)
        assert stranger.num_events == 0 and subs[1].last_seq == -1
        assert not await plain.poll(300)
    finally:
        plain.close(linger=0)
        for s in subs:
            await s.stop()
        pub.close()
