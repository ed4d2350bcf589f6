"""Engine configuration (what the user asks for) and measured results (what the engine found)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # catalogue name (engine.models) or a local Hugging Face folder
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto: float32 on the CPU, bfloat16 on CUDA
    load_format: str = "auto"  # auto | dummy (random weights from config.json alone)
    block_size: int = 128
    max_model_len: int | None = None  # default: the model's max positions, at most 32768
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    kv_cache_gb: float | None = None  # KV memory; default 2 GiB on the CPU, measured on CUDA
    num_swa_slots: int | None = None  # default: max_num_seqs + 1
    gpu_memory_utilization: float = 0.9
    hicache_gb: float | None = None  # host prefix cache; 0 turns it off; default 1 GiB (CPU) / 32 GiB (CUDA)
    hicache_state_slots: int | None = None  # default: what a quarter of hicache_gb holds
    is_deterministic: bool = False
    enforce_eager: bool = False  # CUDA: no decode graphs (every step launched kernel by kernel)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine measured and allocated at start."""

    num_blocks: int
    num_swa_slots: int
    page_bytes: int
    state_bytes: int
    weight_bytes: int
    peak_activation_bytes: int


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_free_swa_slots: int
    num_total_swa_slots: int
    kv_usage: float
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_preemptions_total: int
    cache_lookups_total: int = 0
    cache_hit_tokens_total: int = 0
    cache_stored_pages_total: int = 0
    cache_evictions_total: int = 0
    cache_bytes_to_device_total: int = 0
    cache_bytes_to_host_total: int = 0
    cache_used_pages: int = 0
    cache_total_pages: int = 0
    cache_used_states: int = 0
    cache_total_states: int = 0
