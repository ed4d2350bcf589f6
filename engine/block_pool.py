"""Refcounted allocator of fixed-size units: KV pages of the full-attention layers, or SWA state
slots. Plain ints and lists, no tensors: the runner owns the memory these ids index."""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        """Another owner takes a reference (prefix sharing)."""
        for i in ids:
            if self._refs[i] <= 0:
                raise ValueError(f"block {i} is free; cannot share it")
            self._refs[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self._refs[i] <= 0:
                raise ValueError(f"double free of block {i}")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)

    def refcount(self, i: int) -> int:
        return self._refs[i]

    def check_idle(self) -> None:
        """Every unit back in the free list with refcount 0; raises on a leak."""
        leaked = [i for i, r in enumerate(self._refs) if r]
        if leaked or len(self._free) != self.num_blocks or len(set(self._free)) != self.num_blocks:
            raise AssertionError(f"leak: {len(leaked)} units still referenced (e.g. {leaked[:8]}), {len(self._free)} free")
