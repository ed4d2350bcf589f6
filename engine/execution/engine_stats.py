"""EngineStats (engine/config.py) read from an engine's parts: its queues and pools, its token and
launch-ahead counters, and the host prefix cache, decode cache and MoE layers where it has them (a part
it lacks leaves its fields at their defaults). Reading only: nothing here changes a counter."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.arch import ModelArch
from engine.config import EngineStats
from engine.core.block_pool import BlockPool
from engine.core.decode_cache import DecodeCache
from engine.core.host_prefix_cache import HostPrefixCache
from engine.core.scheduler import Scheduler
from engine.execution.launch_ahead import LaunchAhead
from engine.layers.eplb import RebalanceStats
from engine.models.decoder import CausalLM
from engine.parallel.tensor_parallel import TensorGroup
from engine.speculative.speculator import Speculator


class StatsSource(Protocol):
    """What the stats read of an engine (LLMEngine)."""

    scheduler: Scheduler
    blocks: BlockPool
    slots: BlockPool
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    ahead: LaunchAhead
    prefix_cache: HostPrefixCache | None
    decode_cache: DecodeCache | None
    model: CausalLM
    arch: ModelArch
    eplb: RebalanceStats
    speculator: Speculator | None


# per MoE layer: tokens per logical expert, rows the experts computed
MoeCounters = tuple[list[list[int]], list[int]]


def engine_stats(engine: StatsSource, moe_counters: MoeCounters | None = None) -> EngineStats:
    """A snapshot of engine's counters and occupancy (LLMEngine.stats). moe_counters: the MoE layers'
    counters when the model's own are not the engine rank's (`--tp` with `--ep`: summed over the group)."""
    blocks, slots = engine.blocks, engine.slots
    total = blocks.num_blocks
    return EngineStats(
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        num_free_blocks=blocks.num_free,
        num_total_blocks=total,
        num_free_swa_slots=slots.num_free,
        num_total_swa_slots=slots.num_blocks,
        kv_usage=(blocks.num_used / total) if total else (slots.num_used / max(1, slots.num_blocks)),
        num_prompt_tokens_total=engine.num_prompt_tokens_total,
        num_generation_tokens_total=engine.num_generation_tokens_total,
        num_preemptions_total=engine.scheduler.num_preemptions,
        num_launched_ahead_total=engine.ahead.num_launched_ahead,
        num_fed_ahead_total=engine.ahead.num_fed_ahead,
        **_speculation_stats(engine.speculator),
        **_prefix_cache_stats(engine.prefix_cache),
        **_decode_cache_stats(engine.decode_cache),
        **_moe_stats(engine.model, engine.arch, engine.eplb, moe_counters),
    )


def _speculation_stats(spec: Speculator | None) -> dict[str, Any]:
    if spec is None:
        return {}
    return dict(
        spec_num_drafts_total=spec.num_drafts,
        spec_num_draft_tokens_total=spec.num_draft_tokens,
        spec_num_accepted_tokens_total=spec.num_accepted_tokens,
        spec_accepted_per_position=tuple(spec.accepted_per_position),
        # pure decode steps with and without drafts as the switch chose them (engine/speculative/switch.py)
        spec_switch_drafted_steps_total=spec.switch.num_drafted_steps if spec.switch is not None else 0,
        spec_switch_plain_steps_total=spec.switch.num_plain_steps if spec.switch is not None else 0,
    )


def moe_counters(model: CausalLM) -> MoeCounters:
    """This process's MoE counters (engine/layers/moe.py SparseMoE.tokens_per_expert, rows_computed)."""
    mlps = model.sparse_layers()
    counts = [m.tokens_per_expert.tolist() if m.tokens_per_expert is not None else [0] * m.num_experts for m in mlps]
    return counts, [m.rows_computed for m in mlps]


def _moe_stats(
    model: CausalLM, arch: ModelArch, eplb: RebalanceStats, counters: MoeCounters | None
) -> dict[str, Any]:
    if not model.sparse_layers():
        return {}
    counts, rows = counters if counters is not None else moe_counters(model)
    return dict(
        moe_layers=arch.sparse_layers,
        moe_tokens_per_expert=tuple(tuple(c) for c in counts),
        moe_rows_computed=tuple(rows),
        eplb_rebalances_total=eplb.num_rebalances,
        eplb_experts_moved_total=eplb.num_experts_moved,
        eplb_seconds_total=eplb.seconds,
    )


def _prefix_cache_stats(cache: HostPrefixCache | None) -> dict[str, Any]:
    if cache is None:
        return {}
    index = cache.index
    c = index.counters
    return dict(
        cache_lookups_total=c.lookups,
        cache_query_tokens_total=c.query_tokens,
        cache_hit_tokens_total=c.hit_tokens,
        cache_stored_pages_total=c.stored_pages,
        cache_evictions_total=c.evictions,
        cache_bytes_to_device_total=c.bytes_to_device,
        cache_bytes_to_host_total=c.bytes_to_host,
        cache_used_pages=index.num_used_pages,
        cache_total_pages=index.num_pages,
        cache_used_states=index.num_used_states,
        cache_total_states=index.num_states,
    )


def _decode_cache_stats(cache: DecodeCache | None) -> dict[str, Any]:
    if cache is None:
        return {}
    c = cache.counters
    return dict(
        decode_cache_lookups_total=c.lookups,
        decode_cache_query_tokens_total=c.query_tokens,
        decode_cache_hit_tokens_total=c.hit_tokens,
        decode_cache_retained_pages=cache.num_retained_pages,
        decode_cache_evictions_total=c.evictions,
    )


def group_moe_counters(tp: TensorGroup, model: CausalLM, device: torch.device, num_experts: int) -> MoeCounters | None:
    """--tp with --ep: every process of the group routes and computes its share of the tokens, so the
    engine rank's MoE counters are the sum of its processes' (a gather: rank 0 gets them, the others None)."""
    counts, rows = moe_counters(model)
    flat = torch.tensor([n for c in counts for n in c] + rows, dtype=torch.int64, device=device)
    parts = tp.gather(flat)
    if parts is None:
        return None
    total = torch.stack(parts).sum(0).tolist()
    return [total[i * num_experts : (i + 1) * num_experts] for i in range(len(rows))], total[len(rows) * num_experts :]
