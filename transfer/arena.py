"""Arena: one flat buffer a transport sets up once (exported for ipc, registered with NIXL) and a
first-fit allocator over it, so that a handoff's tensors live in memory the transport has already
made reachable for the peer.

    arena: | handoff a: pages | a: state | free ..... | handoff b: pages | free ......... |
           0                  slices ALIGN-aligned, first fit                      nbytes

A slice is free again once the tensor alloc() returned is collected (weakref.finalize). NOTE: that
tensor itself must stay referenced while its memory is in use: a view of it does not keep the slice
(a torch view holds the storage, not the Python tensor the finalizer watches).
"""

from __future__ import annotations

import math
import threading
import uuid
import weakref
from typing import Any

import torch

ALIGN = 4096  # arena slices start at multiples of this


class Arena:
    """A flat uint8 buffer and a thread-safe first-fit allocator over it (slices are taken on one
    thread and freed wherever their tensor is collected).

    fence_frees (CUDA): each free records an event on the freeing thread's current stream, and
    settle() waits for the last one: a slice's memory may still be read by device work queued before
    its tensor was dropped (an import's copy into the KV pool), which a writer outside the stream
    order (a one-sided NIXL write) must not overtake."""

    def __init__(self, buf: torch.Tensor, fence_frees: bool = False) -> None:
        self.buf = buf  # uint8, flat
        self.id = uuid.uuid4().hex
        self.nbytes = buf.numel()
        self.fence_frees = fence_frees and buf.is_cuda
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), sorted, coalesced
        self._used: dict[int, int] = {}  # offset -> size
        self._freed: Any = None  # the event recorded at the last free (fence_frees)
        self._lock = threading.Lock()

    @property
    def num_used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An empty tensor in the arena, freed when collected; None if it does not fit now."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return None
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            i = next((i for i, (_, n) in enumerate(self._free) if n >= size), None)
            if i is None:
                return None
            off, n = self._free[i]
            if n == size:
                del self._free[i]
            else:
                self._free[i] = (off + size, n - size)
            self._used[off] = size
        t = self.buf[off : off + nbytes].view(dtype).view(shape)
        weakref.finalize(t, self._release, off)
        return t

    def _release(self, off: int) -> None:
        freed = None
        if self.fence_frees:
            try:
                freed = torch.cuda.Event()
                freed.record(torch.cuda.current_stream(self.buf.device))
            except Exception:  # at interpreter exit: nothing is written any more
                freed = None
        with self._lock:
            size = self._used.pop(off, None)
            if size is None:
                return
            if freed is not None:
                self._freed = freed
            free = sorted([*self._free, (off, size)])
            merged: list[tuple[int, int]] = []
            for o, n in free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((o, n))
            self._free = merged

    def settle(self) -> None:
        """Waits for the device work queued before the last free (fence_frees; else returns at once)."""
        with self._lock:
            freed = self._freed
        if freed is not None:
            freed.synchronize()

    def offset_of(self, t: torch.Tensor) -> int | None:
        """t's byte offset if it is a contiguous tensor inside one live slice, else None."""
        if t.device != self.buf.device or not t.is_contiguous() or t.numel() == 0:
            return None
        off, n = t.data_ptr() - self.buf.data_ptr(), t.numel() * t.element_size()
        if off < 0 or off + n > self.nbytes:
            return None
        with self._lock:
            live = any(o <= off and off + n <= o + size for o, size in self._used.items())
        return off if live else None

    def holds(self, segments: list[torch.Tensor]) -> bool:
        """Whether every segment lies inside a live slice of the arena."""
        return bool(segments) and all(self.offset_of(t) is not None for t in segments)
