"""The cluster's prefix index: which engine holds which pages, per tier, fed by the engines' KV events
(pd/kv_events/wire.py), and asked how much of a prompt each engine has cached.

    engine -> tier ("GPU" | "CPU") -> {block hash}        at most max_blocks per engine and tier (oldest go)
    match(token_ids): per engine, the tokens of the prompt's longest run of pages, from the first, held in
    each tier (chain_hashes: the engines' own function, so the keys agree)

An engine's stream (Subscription) keeps it current: joining late, it asks the replay socket for the history
it still buffers; a gap in sequence numbers asks it for what was missed (and clears the engine when the
replay cannot cover it); a sequence that starts again (the engine restarted) or AllBlocksCleared clears
it; an engine that leaves is dropped (forget).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from engine.core.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from engine.core.prefix_cache import chain_hashes
from pd.kv_events.wire import END_SEQ, decode_batch, seq_bytes

log = logging.getLogger(__name__)
TIERS = (MEDIUM_GPU, MEDIUM_CPU)
DEFAULT_MAX_BLOCKS = 1 << 20  # per engine and tier: 16 bytes a key, ~50 MB with the dict's overhead


@dataclass(frozen=True)
class Cached:
    """One engine's cached prefix of a prompt: tokens on its device pool, and tokens in either tier."""

    gpu_tokens: int
    any_tokens: int


@dataclass
class _Engine:
    tiers: dict[str, OrderedDict[bytes, None]] = field(default_factory=lambda: {t: OrderedDict() for t in TIERS})

    def clear(self) -> None:
        for blocks in self.tiers.values():
            blocks.clear()


class PrefixIndex:
    def __init__(self, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._engines: dict[str, _Engine] = {}
        self.num_events = 0

    @property
    def engines(self) -> list[str]:
        return list(self._engines)

    def num_blocks(self, engine: str | None = None) -> int:
        chosen = self._engines.values() if engine is None else [self._engines.get(engine, _Engine())]
        return sum(len(b) for e in chosen for b in e.tiers.values())

    def apply(self, engine: str, events: list[KVEvent]) -> None:
        e = self._engines.setdefault(engine, _Engine())
        for ev in events:
            self.num_events += 1
            if isinstance(ev, AllBlocksCleared):
                e.clear()
            elif isinstance(ev, BlockStored):
                if ev.block_size != self.block_size:
                    continue  # another page size: its hashes are not ours
                blocks = e.tiers.get(ev.medium or MEDIUM_GPU)
                if blocks is None:
                    continue
                for h in ev.block_hashes:
                    blocks[h] = None
                    blocks.move_to_end(h)
                while len(blocks) > self.max_blocks:
                    blocks.popitem(last=False)
            elif isinstance(ev, BlockRemoved):
                removed = e.tiers.get(ev.medium or MEDIUM_GPU, OrderedDict())
                for h in ev.block_hashes:
                    removed.pop(h, None)

    def clear(self, engine: str) -> None:
        if engine in self._engines:
            self._engines[engine].clear()

    def forget(self, engine: str) -> None:
        self._engines.pop(engine, None)

    def match(self, token_ids: list[int], engines: list[str] | None = None) -> dict[str, Cached]:
        """Per engine (those given, else every known one): its cached prefix of token_ids."""
        return self.match_keys(chain_hashes(token_ids, self.block_size), engines)

    def match_keys(self, keys: list[bytes], engines: list[str] | None = None) -> dict[str, Cached]:
        """match() for a prompt whose page hashes (chain_hashes) the caller has already."""
        out: dict[str, Cached] = {}
        for name in self._engines if engines is None else engines:
            e = self._engines.get(name)
            if e is None:
                out[name] = Cached(0, 0)
                continue
            gpu, cpu = e.tiers[MEDIUM_GPU], e.tiers[MEDIUM_CPU]
            num_gpu = num_any = 0
            for k in keys:
                in_gpu = k in gpu
                if not (in_gpu or k in cpu):
                    break
                num_any += 1
                if in_gpu and num_gpu == num_any - 1:
                    num_gpu += 1
            out[name] = Cached(num_gpu * self.block_size, num_any * self.block_size)
        return out


class Subscription:
    """One engine rank's stream into the index: SUB on its endpoint, REQ on its replay endpoint."""

    def __init__(
        self,
        index: PrefixIndex,
        engine: str,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "",
        server_key: bytes | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        """server_key: the publishers' CURVE public key (pd/kv_events/publisher.py curve_keys) where the
        stream leaves its host."""
        self.index = index
        self.engine = engine
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.server_key = server_key
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.last_seq = -1
        self.num_gaps = 0
        self.num_replayed = 0
        self.num_restarts = 0
        self.last_event_ts = 0.0  # the publisher's clock at its last batch
        self.lag_s = 0.0  # its arrival here minus that (wall clocks: one host's, or synchronized hosts')
        self._task: asyncio.Task[None] | None = None

    def _socket(self, kind: int, endpoint: str) -> zmq.asyncio.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if self.server_key is not None:
            s.curve_serverkey = self.server_key
            s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
        s.connect(endpoint)
        return s

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.engine}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        sub = self._socket(zmq.SUB, self.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        try:
            if self.replay_endpoint is not None:  # the history the publisher still buffers, first
                await self._replay(0, None)
            while True:
                _, seq_frame, payload = await sub.recv_multipart()
                await self.receive(int.from_bytes(seq_frame, "big"), payload)
        finally:
            sub.close(linger=0)

    async def receive(self, seq: int, payload: bytes) -> None:
        """One published batch: a duplicate skipped, a restart or a gap handled first, then applied."""
        batch = self._decode(seq, payload)
        if seq <= self.last_seq:
            if batch is not None and batch[0] <= self.last_event_ts:
                return  # one the replay gave already (a publisher's clock only goes forward)
            self.num_restarts += 1  # the publisher counts from 0 again: a new process, its caches empty
            self.index.clear(self.engine)
        elif self.last_seq < 0 and seq > 0:  # joined late (this router or CE started after the engine)
            await self._replay(0, seq)  # what the replay buffer still holds; the rest is unknown here
        elif seq > self.last_seq + 1:
            self.num_gaps += 1
            if not await self._replay(self.last_seq + 1, seq):
                self.index.clear(self.engine)  # what was missed is gone: forget rather than guess
        self._apply(seq, batch)

    def _decode(self, seq: int, payload: bytes) -> tuple[float, list[KVEvent], int | None] | None:
        try:
            return decode_batch(payload)
        except ValueError as e:
            log.warning("KV events from %s: batch %d dropped: %s", self.engine, seq, e)
            return None

    def _apply(self, seq: int, batch: tuple[float, list[KVEvent], int | None] | None) -> None:
        if batch is None:
            self.index.clear(self.engine)  # what it said is unknown
        else:
            self.index.apply(self.engine, batch[1])
            self.last_event_ts = batch[0]
            self.lag_s = max(0.0, time.time() - batch[0])
        self.last_seq = seq

    async def _replay(self, first: int, upto: int | None) -> bool:
        """Applies batches [first, upto) (upto None: every one buffered) from the replay socket; True
        when all of them came."""
        if self.replay_endpoint is None:
            return False
        req = self._socket(zmq.DEALER, self.replay_endpoint)  # a REQ takes one answer; the replay sends many
        try:
            await req.send_multipart((b"", seq_bytes(first)))
            while True:
                if not await req.poll(1000):
                    return False
                _, seq_frame, payload = await req.recv_multipart()
                if seq_frame == END_SEQ:
                    return upto is None or self.last_seq >= upto - 1
                seq = int.from_bytes(seq_frame, "big")
                if (upto is None or seq < upto) and (seq == self.last_seq + 1 or self.last_seq < 0):
                    self._apply(seq, self._decode(seq, payload))
                    self.num_replayed += 1
        except zmq.ZMQError as e:
            log.warning("KV events from %s: replay failed: %s", self.engine, e)
            return False
        finally:
            req.close(linger=0)
