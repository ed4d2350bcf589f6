"""The host prefix cache's memory and its copies: a pinned host pool of pages and SWA state slots (a
KVCache on the CPU, `--hicache-gb`) under a PrefixIndex (engine/core/prefix_cache.py, the bookkeeping).

    restore   on admission: the longest cached prefix of the prompt into the sequence's fresh pages
              (and the SWA state at its end), so its prefill starts after it
    store     once the prompt's full pages are computed: written through to the host, with the SWA
              state at the last page boundary

The engine calls both (LLMEngine._admit, LLMEngine._complete) and fails only the sequence whose copy
raised; every copy is counted in the index's counters.

In a tensor-parallel group (engine/parallel/tensor_parallel.py) every process holds a host pool of its own KV
heads, of hicache_gb / N; only the first keeps the index. It records its copies (`records`) and the
engine broadcasts them before the next forward; the others replay them, in order, on their pools."""

from __future__ import annotations

import torch

from engine.arch import ModelArch
from engine.config import EngineConfig
from engine.core.kv_cache import KVCache
from engine.core.prefix_cache import PrefixIndex
from engine.core.sequence import Sequence
from pdkernels.page_copy import copy_units

DEFAULT_CPU_HICACHE_GB = 1.0
DEFAULT_CUDA_HICACHE_GB = 32.0
NUM_STATELESS_CACHE_PAGES = 1 << 16  # index entries for a model with no full-attention layers


# a copy between the host pool and the device: (pool "pages" | "swa", to the device?, source ids, destination ids)
CopyOp = tuple[str, bool, list[int], list[int]]


class HostPrefixCache:
    def __init__(self, host: KVCache, index: PrefixIndex, has_sliding: bool, records: bool = False) -> None:
        """records: keep every copy made (take_copies) for a tensor-parallel group's other processes."""
        self.host = host
        self.index = index
        self.has_sliding = has_sliding  # the model has SWA layers: a prefix carries its state too
        self.copies: list[CopyOp] | None = [] if records else None

    @classmethod
    def sized(
        cls, config: EngineConfig, arch: ModelArch, kv: KVCache, num_shares: int = 1, records: bool = False
    ) -> HostPrefixCache | None:
        """The cache config.hicache_gb asks for beside kv (pinned when kv is on CUDA), or None when off
        (--hicache-gb 0, --no-enable-prefix-caching); num_shares: a tensor-parallel group's processes, each
        holding its share of it."""
        lo, device = kv.layout, kv.device
        gb = config.hicache_gb if config.enable_prefix_caching else 0.0
        if gb is None:
            gb = DEFAULT_CUDA_HICACHE_GB if device.type == "cuda" else DEFAULT_CPU_HICACHE_GB
        if gb <= 0:
            return None
        gb /= num_shares
        budget = int(gb * 2**30)
        states = 0
        if arch.has_sliding:
            states = config.hicache_state_slots or max(1, budget // 4 // lo.state_bytes)
            budget -= states * lo.state_bytes
        pages = budget // lo.page_bytes if arch.has_full else NUM_STATELESS_CACHE_PAGES
        if pages < 1 or budget < 0:
            raise MemoryError(f"hicache_gb={gb} holds no page of {lo.page_bytes} bytes")
        host = KVCache(lo, pages, states, torch.device("cpu"), pin_memory=device.type == "cuda")
        index = PrefixIndex(pages, states, lo.block_size, needs_state=arch.has_sliding)
        return cls(host, index, arch.has_sliding, records)

    def _copy(self, kv: KVCache, pool: str, to_device: bool, src_ids: list[int], dst_ids: list[int]) -> int:
        """Copies units of a pool ("pages" | "swa") between the host and kv; returns the bytes moved."""
        host, dev = getattr(self.host, pool), getattr(kv, pool)
        moved = copy_units(host, src_ids, dev, dst_ids) if to_device else copy_units(dev, src_ids, host, dst_ids)
        if self.copies is not None:
            self.copies.append((pool, to_device, list(src_ids), list(dst_ids)))
        return moved

    def take_copies(self) -> list[CopyOp]:
        """The copies recorded since the last call, in order."""
        if self.copies is None:
            return []
        copies, self.copies = self.copies, []
        return copies

    def replay(self, copies: list[CopyOp], kv: KVCache) -> None:
        """Another process's copies, in order, on this one's pool and kv (a tensor-parallel follower)."""
        for pool, to_device, src_ids, dst_ids in copies:
            self._copy(kv, pool, to_device, src_ids, dst_ids)

    def restore(self, seq: Sequence, kv: KVCache) -> None:
        """On admission: copy the longest cached prefix of the prompt into seq's fresh memory in kv,
        and mark the prompt's last page boundary for store() when pages past the prefix end there. A
        sequence that asks for prompt logprobs computes its whole prompt (as vLLM, it reads nothing from
        the cache), and its pages are stored all the same."""
        if not seq.use_prefix_cache or seq.num_computed:
            return
        if seq.prompt_logprobs is None:
            self._restore(seq, kv)
        block_size = kv.layout.block_size
        boundary = seq.num_prompt_tokens // block_size * block_size
        seq.cache_store_upto = boundary if boundary > seq.num_computed else 0

    def _restore(self, seq: Sequence, kv: KVCache) -> None:
        index = self.index
        match = index.match(seq.prompt_token_ids)
        try:
            if match.num_pages:
                moved = 0
                if kv.layout.num_full_layers:  # a model of sliding layers only: its prefix is the state alone
                    moved = self._copy(kv, "pages", True, [e.page for e in match.entries], seq.block_ids[: match.num_pages])
                if self.has_sliding:
                    moved += self._copy(kv, "swa", True, [match.entries[-1].state], [seq.state_slot])
                index.counters.bytes_to_device += moved
                seq.num_computed = seq.num_cached_prompt = match.num_tokens
        finally:
            index.release(match)

    def store(self, seq: Sequence, kv: KVCache) -> None:
        """Write-through of the prompt's full pages and the SWA state at its last page boundary."""
        index = self.index
        num_pages = seq.cache_store_upto // kv.layout.block_size
        seq.cache_store_upto = 0
        plan, state = index.plan_store(seq.prompt_token_ids, num_pages, with_state=self.has_sliding)
        try:
            moved = 0
            if kv.layout.num_full_layers:  # a model of sliding layers only has no pages to copy
                moved = self._copy(kv, "pages", False, [seq.block_ids[i] for i, _ in plan], [p for _, p in plan])
            if state >= 0:
                moved += self._copy(kv, "swa", False, [seq.state_slot], [state])
            index.counters.bytes_to_host += moved
        finally:
            index.commit_store()
