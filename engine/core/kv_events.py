"""KV cache events: what an engine's prefix caches gained and lost, for a router to know where a prefix's
KV is (vLLM's `--kv-events-config`; pd/kv_events/ publishes them and keeps the cluster's index).

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, medium)   pages newly indexed, a run
        of one hash chain: block_hashes[0] follows parent_block_hash (None: it is the chain's first page)
    BlockRemoved(block_hashes, medium)                                             pages no longer indexed
    AllBlocksCleared()                                                             nothing is indexed

A page's hash is engine/core/prefix_cache.py's chain_hashes over token ids: the same function on every
engine and in every consumer. The medium is the tier: "GPU" for the decode cache (pages kept in the
engine's own pool), "CPU" for the host prefix cache. A page enters the log once its KV is usable there
(the host cache: once its copy is committed) and leaves when it is evicted.
Bookkeeping only (ints, bytes, lists); CPU-testable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The events of one engine since the last drain(); records nothing unless enabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._events: list[KVEvent] = [AllBlocksCleared()] if enabled else []  # a (re)started engine holds nothing

    def stored(self, keys: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int, medium: str) -> None:
        if self.enabled and keys:
            self._events.append(BlockStored(tuple(keys), parent, tuple(token_ids), block_size, medium))

    def removed(self, keys: list[bytes], medium: str) -> None:
        if self.enabled and keys:
            self._events.append(BlockRemoved(tuple(keys), medium))

    def drain(self) -> list[KVEvent]:
        out, self._events = self._events, []
        return out


def stored_runs(keys: list[bytes], new: list[bool]) -> list[tuple[int, int]]:
    """[(start, end)]: the runs of consecutive pages of a chain that are new (a BlockStored each)."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, is_new in enumerate([*new, False]):
        if is_new and start is None:
            start = i
        elif not is_new and start is not None:
            runs.append((start, i))
            start = None
    return runs


def log_runs(log: KVEventLog, keys: list[bytes], new: list[bool], token_ids: list[int], block_size: int, medium: str) -> None:
    """One BlockStored per run of new pages of the chain keys (page i: token_ids[i*bs:(i+1)*bs])."""
    for start, end in stored_runs(keys, new):
        parent = keys[start - 1] if start else None
        log.stored(keys[start:end], parent, token_ids[start * block_size : end * block_size], block_size, medium)


def for_engine(enabled: bool, host_cache: Any, decode_cache: Any) -> KVEventLog:
    """The engine's log, given to its caches (None where absent): the host prefix cache's index and the
    decode cache record into it."""
    log = KVEventLog(enabled)
    for index in (None if host_cache is None else host_cache.index, decode_cache):
        if index is not None:
            index.events = log
    return log
