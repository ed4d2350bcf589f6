"""Host-memory prefix cache: pinned pages of full-attention KV and SWA state slots, indexed by a
hash chain over page tokens, LRU-evicted.

    page i covers tokens [i*bs, (i+1)*bs);   h_i = H(h_{i-1} || tokens of page i),  h_{-1} = SEED
    the state stored with page i is the SWA ring after (i+1)*bs tokens

Hashes are blake2b over little-endian int64 token ids with a fixed seed, so every host computes the
same keys; a hit is confirmed against the stored tokens, so a collision can only cost a miss.
Eviction takes the least recently used unpinned entry; a chain is touched tail first, so its tail
pages are older than its head and go first (a head page alone would orphan everything after it).
Bookkeeping only (ints, bytes, lists); engine/core/host_prefix_cache.py holds and moves the tensors.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from engine.core.kv_events import MEDIUM_CPU, KVEventLog, log_runs

HASH_SEED = b"pdserve-prefix-v1"


def chain_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """Hashes of every full page of token_ids."""
    out: list[bytes] = []
    prev = HASH_SEED
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        page = token_ids[start : start + block_size]
        prev = hashlib.blake2b(prev + struct.pack(f"<{block_size}q", *page), digest_size=16).digest()
        out.append(prev)
    return out


@dataclass
class Entry:
    key: bytes
    tokens: tuple[int, ...]
    page: int  # host page id
    state: int = -1  # host state slot with the SWA ring at this page's end, or -1
    pins: int = 0  # readers copying from it now


@dataclass(frozen=True)
class Match:
    """A usable hit: `entries[i]` holds page i; the SWA state (if any) is the last entry's."""

    entries: tuple[Entry, ...]
    num_tokens: int

    @property
    def num_pages(self) -> int:
        return len(self.entries)


@dataclass
class CacheCounters:
    lookups: int = 0
    query_tokens: int = 0  # the tokens lookups were asked for (vLLM's prefix-cache queries)
    hit_tokens: int = 0
    stored_pages: int = 0
    stored_states: int = 0
    evictions: int = 0
    bytes_to_device: int = 0
    bytes_to_host: int = 0


class PrefixIndex:
    def __init__(self, num_pages: int, num_states: int, block_size: int, needs_state: bool) -> None:
        self.block_size = block_size
        self.needs_state = needs_state
        self.num_pages = num_pages
        self.num_states = num_states
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # LRU order: oldest first
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._free_states = list(range(num_states - 1, -1, -1))
        self._state_owner: dict[int, bytes] = {}
        self._pending: list[Entry] = []
        self._pending_new: tuple[list[bytes], list[bool], list[int]] = ([], [], [])  # for the events at commit
        self.counters = CacheCounters()
        self.events = KVEventLog(enabled=False)  # engine/core/kv_events.py attach() gives it the engine's

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    @property
    def num_used_states(self) -> int:
        return self.num_states - len(self._free_states)

    def _touch(self, entries: list[Entry]) -> None:
        for e in reversed(entries):  # tail first: the head ends up most recent
            self._entries.move_to_end(e.key)

    # ---- lookup -------------------------------------------------------------------------------

    def match(self, token_ids: list[int]) -> Match:
        """The longest usable cached prefix, pinned until release(); at least one token is left
        to compute, and with sliding layers the hit ends where a state is stored."""
        self.counters.lookups += 1
        self.counters.query_tokens += len(token_ids)
        bs = self.block_size
        max_pages = (len(token_ids) - 1) // bs
        found: list[Entry] = []
        for i, key in enumerate(chain_hashes(token_ids[: max_pages * bs], bs)):
            e = self._entries.get(key)
            if e is None or e.tokens != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            found.append(e)
        if self.needs_state:
            while found and found[-1].state < 0:
                found.pop()
        for e in found:
            e.pins += 1
        self._touch(found)
        self.counters.hit_tokens += len(found) * bs
        return Match(tuple(found), len(found) * bs)

    def release(self, match: Match) -> None:
        for e in match.entries:
            e.pins -= 1
            assert e.pins >= 0

    # ---- store --------------------------------------------------------------------------------

    def plan_store(self, token_ids: list[int], num_pages: int, with_state: bool) -> tuple[list[tuple[int, int]], int]:
        """Reserves host memory for pages [0, num_pages) of token_ids not cached yet and, if
        with_state, for the state at the end of page num_pages - 1.

        Returns ([(page index in the sequence, host page)], host state slot or -1). Entries are
        pinned until commit_store(); what cannot get memory is skipped (the chain is cut there).
        """
        bs = self.block_size
        keys = chain_hashes(token_ids[: num_pages * bs], bs)
        plan: list[tuple[int, int]] = []
        chain: list[Entry] = []
        new: list[bool] = []
        for i, key in enumerate(keys):
            e = self._entries.get(key)
            new.append(e is None)
            if e is None:
                page = self._take(self._free_pages, is_state=False)
                if page is None:
                    new.pop()
                    break
                e = Entry(key, tuple(token_ids[i * bs : (i + 1) * bs]), page)
                self._entries[key] = e
                plan.append((i, page))
                self.counters.stored_pages += 1
            e.pins += 1
            chain.append(e)
        state = -1
        if with_state and chain and len(chain) == num_pages and chain[-1].state < 0:
            taken = self._take(self._free_states, is_state=True)
            if taken is not None:
                state = taken
                chain[-1].state = state
                self._state_owner[state] = chain[-1].key
                self.counters.stored_states += 1
        self._pending = chain
        if self.events.enabled:
            self._pending_new = (keys[: len(new)], new, token_ids[: len(new) * bs])
        self._touch(chain)
        return plan, state

    def commit_store(self) -> None:
        """The copies of the last plan_store are done: unpin (and the new pages are usable: logged)."""
        for e in self._pending:
            e.pins -= 1
        self._pending = []
        keys, new, token_ids = self._pending_new
        if keys:
            live = [k in self._entries for k in keys]  # NOTE: a page evicted meanwhile is not announced
            log_runs(self.events, keys, [n and ok for n, ok in zip(new, live)], token_ids, self.block_size, MEDIUM_CPU)
            self._pending_new = ([], [], [])

    # ---- eviction -----------------------------------------------------------------------------

    def _take(self, free: list[int], is_state: bool) -> int | None:
        while not free:
            if not self._evict_one(want_state=is_state):
                return None
        return free.pop()

    def _evict_one(self, want_state: bool) -> bool:
        for e in self._entries.values():
            if e.pins:
                continue
            if want_state:
                if e.state < 0:
                    continue
                self._drop_state(e)
            else:
                self._drop_entry(e)
            self.counters.evictions += 1
            return True
        return False

    def _drop_state(self, e: Entry) -> None:
        del self._state_owner[e.state]
        self._free_states.append(e.state)
        e.state = -1

    def _drop_entry(self, e: Entry) -> None:
        if e.state >= 0:  # a state is useless without its pages
            self._drop_state(e)
        del self._entries[e.key]
        self._free_pages.append(e.page)
        self.events.removed([e.key], MEDIUM_CPU)

    def check_idle(self) -> None:
        pinned = [e for e in self._entries.values() if e.pins]
        assert not pinned, f"{len(pinned)} cache entries still pinned"
        assert len(self._entries) + len(self._free_pages) == self.num_pages, "host page leak"
        assert len(self._state_owner) + len(self._free_states) == self.num_states, "host state leak"
