"""How a rank's KV memory is sized at start (MemoryPlan, engine/config.py).

    budget   --kv-cache-gb if given; else on CUDA what --gpu-memory-utilization leaves of the device
             once the weights are loaded and the activation peak of one full-budget prefill (measured
             on a scratch cache, plus 10%) is set aside; else 2 GiB on the CPU
    slots    SWA state slots first: one per sequence (and one spare) by default, but never more than
             half the budget (all of it for a model with no full-attention layers)
    pages    the rest, in whole pages; fewer than two is an error"""

from __future__ import annotations

import logging
import time

import torch

from engine.arch import ModelArch
from engine.config import EngineConfig, ForwardConfig, MemoryPlan
from engine.core.kv_cache import KVCache
from engine.core.sequence import Sequence
from engine.execution.runner import ModelRunner
from engine.handoff import KVLayout
from engine.layers.numerics import Numerics
from engine.models.decoder import CausalLM
from engine.request import SamplingParams

log = logging.getLogger(__name__)
DEFAULT_CPU_KV_GB = 2.0


def plan_memory(
    config: EngineConfig,
    arch: ModelArch,
    layout: KVLayout,
    model: CausalLM,
    numerics: Numerics,
    device: torch.device,
    max_model_len: int,
) -> MemoryPlan:
    """The pages and SWA state slots the engine's KV memory gets (the module docstring's rules); logged."""
    t0 = time.monotonic()
    lo, cfg = layout, config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = 0
    if cfg.kv_cache_gb is not None:
        kv_bytes = int(cfg.kv_cache_gb * 2**30)
    elif device.type == "cuda":
        num_tokens = min(cfg.max_num_batched_tokens, max_model_len)
        peak = _profile_peak_bytes(model, numerics, cfg.forward, arch, layout, device, num_tokens)
        free, total = torch.cuda.mem_get_info(device)
        kv_bytes = int(free - total * (1 - cfg.gpu_memory_utilization) - peak)
    else:
        kv_bytes = int(DEFAULT_CPU_KV_GB * 2**30)
    slots = 0
    if arch.has_sliding:
        # By default one slot per sequence, but never more than half the KV memory (all of it
        # for a model with no full-attention layers).
        share = 0.5 if arch.has_full else 1.0
        slots = cfg.num_swa_slots or max(1, min(cfg.max_num_seqs + 1, int(share * kv_bytes / lo.state_bytes)))
    kv_bytes -= slots * lo.state_bytes
    blocks = kv_bytes // lo.page_bytes if arch.has_full else 0
    if (arch.has_full and blocks < 2) or kv_bytes < 0:
        raise MemoryError(f"not enough memory for the KV cache ({kv_bytes / 2**30:.2f} GiB left for pages)")
    log.info(
        "memory plan in %.1f s: weights %.2f GiB, peak activations %.2f GiB, %d KV blocks of %d tokens (%.2f GiB)",
        time.monotonic() - t0, weight_bytes / 2**30, peak / 2**30, blocks, cfg.block_size, blocks * lo.page_bytes / 2**30,
    )  # fmt: skip
    return MemoryPlan(blocks, slots, lo.page_bytes, lo.state_bytes, weight_bytes, peak)


def _profile_peak_bytes(
    model: CausalLM, numerics: Numerics, forward: ForwardConfig, arch: ModelArch, layout: KVLayout, device: torch.device,
    num_tokens: int,
) -> int:
    """Activation peak of a prefill of num_tokens, measured on a scratch cache."""
    num_blocks = -(-num_tokens // layout.block_size) + 1 if arch.has_full else 0
    scratch = KVCache(layout, num_blocks, 1 if arch.has_sliding else 0, device)
    seq = Sequence("profile", [1] * num_tokens, SamplingParams(), 0, 0.0, block_ids=list(range(num_blocks)))
    seq.state_slot = 0 if arch.has_sliding else -1
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ModelRunner(model, scratch, numerics, forward).run([seq], [num_tokens])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch
    torch.cuda.empty_cache()
    return int(peak * 1.1)
