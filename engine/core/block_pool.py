"""Refcounted allocator of fixed-size units: KV pages of the full-attention layers, or SWA state
slots. Plain ints and lists, no tensors: the runner owns the memory these ids index.

A unit is in exactly one of three places:

    referenced   refcount >= 1: owned by sequences (and reservations)
    free         refcount 0, in the free deque: content meaningless
    evictable    refcount 0, in the LRU (oldest first): content kept, because an index (the decode
                 cache, engine/core/decode_cache.py) marked it cached; share() takes it back, allocate()
                 reuses it when no free unit is left, telling the index through on_evict first

Evictable units count as free (num_free, can_allocate): cached content never blocks an admission, a
reservation or a decode step. A pool whose units are never marked cached is a plain free list.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._refs = [0] * num_blocks
        self._is_cached = [False] * num_blocks
        self._on_evict: Callable[[int], None] | None = None

    def set_on_evict(self, on_evict: Callable[[int], None]) -> None:
        """The index of cached units: told (unit id) when allocate() takes one of its evictable units."""
        if self._on_evict is not None:
            raise ValueError("this pool already has an index")
        self._on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Units allocate() can hand out now: free and evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        """Referenced units."""
        return self.num_blocks - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n units with refcount 1: free ones first, then the least recently used evictable ones."""
        if n > self.num_free:
            raise OutOfBlocksError(f"asked for {n} blocks, {self.num_free} free")
        ids = []
        for _ in range(n):
            if self._free:
                i = self._free.popleft()
            else:
                i, _ = self._evictable.popitem(last=False)
                self._is_cached[i] = False
                assert self._on_evict is not None
                self._on_evict(i)
            self._refs[i] = 1
            ids.append(i)
        return ids

    def share(self, ids: list[int]) -> None:
        """Another owner takes a reference (prefix sharing); an evictable unit is pinned (it leaves the
        LRU with refcount 1). A free unit cannot be shared."""
        for i in ids:
            if self._refs[i] <= 0:
                if i not in self._evictable:
                    raise ValueError(f"block {i} is free; cannot share it")
                del self._evictable[i]
            self._refs[i] += 1

    def mark_cached(self, i: int) -> None:
        """An index keeps unit i's content: when its last reference goes it becomes evictable, not free."""
        if self._refs[i] <= 0:
            raise ValueError(f"block {i} is not referenced; cannot mark it cached")
        self._is_cached[i] = True

    def is_cached(self, i: int) -> bool:
        return self._is_cached[i]

    def free(self, ids: list[int]) -> None:
        """Drops one reference of each. Cached units whose last reference goes enter the LRU in
        reverse order, so a chain's tail (a sequence's last pages) is evicted before its head."""
        to_lru = []
        for i in ids:
            if self._refs[i] <= 0:
                raise ValueError(f"double free of block {i}")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                if self._is_cached[i]:
                    to_lru.append(i)
                else:
                    self._free.append(i)
        for i in reversed(to_lru):
            self._evictable[i] = None

    def refcount(self, i: int) -> int:
        return self._refs[i]

    def check_idle(self) -> None:
        """Every unit unreferenced, in the free list or the LRU, once; raises on a leak."""
        leaked = [i for i, r in enumerate(self._refs) if r]
        held = [*self._free, *self._evictable]
        stray = [i for i in self._free if self._is_cached[i]]  # cached content must be evictable
        if leaked or stray or len(held) != self.num_blocks or len(set(held)) != self.num_blocks:
            raise AssertionError(
                f"leak: {len(leaked)} units still referenced (e.g. {leaked[:8]}), {len(stray)} cached but free, "
                f"{len(self._free)} free + {len(self._evictable)} evictable of {self.num_blocks}"
            )
