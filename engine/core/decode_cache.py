"""DecodeCache (CE side of P/D): the KV pages of finished requests, kept in the engine's own pool as
evictable pages and indexed by the prefix cache's hash chain, so that the next turn of a conversation
is handed over with only the pages this engine lacks.

    page i covers tokens [i*bs, (i+1)*bs);   key_i = chain_hashes(tokens)[i]   (engine/core/prefix_cache.py)
    retain: the FULL pages of a finished sequence's COMPUTED tokens [0, num_computed)
    match:  pages 0..k-1 while key_i is indexed AND its stored tokens equal the asked ones, token by
            token: an edited history matches up to its first differing page

Keys are the PE's (same seed, same bytes), so "k pages held" means the same tokens on both sides.
The pool owns a page's life (referenced / evictable / free: engine/core/block_pool.py); this index owns only
key -> page. A page enters through retain() (pool.mark_cached) and leaves only when the pool evicts it
for an allocation (on_evict). An indexed page is never written: every sequence that holds it has all of
its tokens computed, and a sequence writes only positions >= its num_computed.
Bookkeeping only (ints, bytes, lists); CPU-testable.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_pool import BlockPool
from engine.core.kv_events import MEDIUM_GPU, KVEventLog, log_runs
from engine.core.prefix_cache import chain_hashes
from engine.core.sequence import Sequence


@dataclass
class DecodeCacheCounters:
    lookups: int = 0
    query_tokens: int = 0  # the tokens lookups were asked for (vLLM's prefix-cache queries)
    hit_tokens: int = 0
    evictions: int = 0


@dataclass(frozen=True)
class _Entry:
    block_id: int
    tokens: tuple[int, ...]


class DecodeCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.block_size = block_size
        self._pool = pool
        self._entries: dict[bytes, _Entry] = {}
        self._keys: dict[int, bytes] = {}  # block id -> its key
        self.counters = DecodeCacheCounters()
        self.events = KVEventLog(enabled=False)  # engine/core/kv_events.py attach() gives it the engine's
        pool.set_on_evict(self._evicted)

    @property
    def num_retained_pages(self) -> int:
        return len(self._entries)

    def match(self, token_ids: list[int]) -> tuple[int, list[int]]:
        """(num_tokens, block_ids): the longest run of whole pages of token_ids held here, from the
        first page on. Nothing is pinned: the caller shares (pins) the pages it keeps."""
        self.counters.lookups += 1
        self.counters.query_tokens += len(token_ids)
        bs = self.block_size
        block_ids: list[int] = []
        for i, key in enumerate(chain_hashes(token_ids, bs)):
            e = self._entries.get(key)
            if e is None or e.tokens != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            block_ids.append(e.block_id)
        num_tokens = len(block_ids) * bs
        self.counters.hit_tokens += num_tokens
        return num_tokens, block_ids

    def retain(self, token_ids: list[int], block_ids: list[int]) -> int:
        """A sequence ends: indexes its full pages. token_ids: its COMPUTED tokens (the last sampled
        token has no KV); block_ids: its pages, still referenced (the caller frees them right after,
        and the indexed ones become evictable). A page whose key is indexed already (this very page,
        pinned from here; or another page with the same tokens) is not indexed twice: it is simply
        freed. Returns the number of pages newly indexed."""
        bs = self.block_size
        num_pages = min(len(token_ids) // bs, len(block_ids))
        keys = chain_hashes(token_ids[: num_pages * bs], bs)
        new: list[bool] = []
        for i, key in enumerate(keys):
            b = block_ids[i]
            new.append(key not in self._entries and b not in self._keys)
            if not new[-1]:
                continue
            self._entries[key] = _Entry(b, tuple(token_ids[i * bs : (i + 1) * bs]))
            self._keys[b] = key
            self._pool.mark_cached(b)
        log_runs(self.events, keys, new, token_ids, bs, MEDIUM_GPU)
        return sum(new)

    def adopt(self, seq: Sequence) -> int:
        """A CE's own prefill of seq (a local prefill, just admitted with fresh pages): its first pages
        become the held ones its prompt matches (shared: never written, seq computes from their end on),
        the fresh ones they replace go back. Returns the tokens so held. Not for a sequence that wants
        prompt logprobs (it computes its whole prompt), skips the cache, or keeps a sliding-window state
        (pages alone do not give it)."""
        if seq.num_computed or not seq.use_prefix_cache or seq.prompt_logprobs is not None or seq.state_slot >= 0:
            return 0
        bs = self.block_size
        num_tokens, block_ids = self.match(seq.prompt_token_ids[: (seq.num_prompt_tokens - 1) // bs * bs])
        if block_ids:
            self._pool.share(block_ids)
            self._pool.free(seq.block_ids[: len(block_ids)])
            seq.block_ids[: len(block_ids)] = block_ids
            seq.num_computed = seq.num_cached_prompt = num_tokens
        return num_tokens

    def _evicted(self, block_id: int) -> None:
        """The pool's on_evict: the page is reused; its key goes (pages after it in the chain stay
        until evicted themselves: the pool evicts a chain tail first, so this is rare)."""
        key = self._keys.pop(block_id)
        del self._entries[key]
        self.counters.evictions += 1
        self.events.removed([key], MEDIUM_GPU)

    def check_idle(self) -> None:
        """With nothing referenced, the indexed pages are exactly the pool's evictable ones."""
        if not (len(self._entries) == len(self._keys) == self._pool.num_evictable):
            raise AssertionError(
                f"decode cache: {len(self._entries)} keys, {len(self._keys)} pages, "
                f"{self._pool.num_evictable} evictable in the pool"
            )
        stray = [b for b in self._keys if not self._pool.is_cached(b)]
        if stray:
            raise AssertionError(f"decode cache indexes pages the pool does not keep: {stray[:8]}")
