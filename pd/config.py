"""ServerConfig: everything `python -m pd.server` is told on its command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_PORT = 8888
ROUTING_POLICIES = ("affinity", "least-loaded")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP coordinator and the engine ranks it starts (single-engine mode)."""

    model: str = DEFAULT_MODEL
    served_model_name: str | None = None  # name clients use; defaults to `model`
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    dp: int = 1  # engine ranks (processes); one per GPU on CUDA
    device: str = "auto"
    deterministic: bool = False
    routing: str = "affinity"
    chat_template: str | None = None  # path of a Jinja file that replaces the checkpoint's template
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 128
    kv_cache_gb: float | None = None
    hicache_gb: float | None = None  # host prefix cache per rank; 0 turns it off; None: the engine's default
    dtype: str = "auto"
    load_format: str = "auto"  # auto | dummy (random weights: smoke tests without a checkpoint's weights)
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    max_body_bytes: int = 4 * 1024 * 1024
    rank_start_timeout_s: float = 600.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ValueError(f"--dp must be >= 1, got {self.dp}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_kwargs(self) -> dict[str, Any]:
        """The EngineConfig fields a rank builds its engine from (device is resolved per rank)."""
        return {
            "model": self.model,
            "device": self.device,
            "deterministic": self.deterministic,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "kv_cache_gb": self.kv_cache_gb,
            "hicache_gb": self.hicache_gb,
            "dtype": self.dtype,
            "load_format": self.load_format,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "seed": self.seed,
        }

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> ServerConfig:
        p = argparse.ArgumentParser(
            prog="python -m pd.server", description="pdserve OpenAI-compatible server"
        )
        p.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name or Hugging Face folder")
        p.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=DEFAULT_PORT)
        p.add_argument("--dp", type=int, default=1, help="engine ranks (one process each)")
        p.add_argument("--device", default="auto", help="auto | cpu | cuda")
        p.add_argument("--deterministic", action="store_true", help="batch-invariant numerics")
        p.add_argument("--routing", choices=ROUTING_POLICIES, default="affinity")
        p.add_argument("--chat-template", default=None, help="Jinja chat template file")
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
        p.add_argument("--block-size", type=int, default=128)
        p.add_argument("--kv-cache-gb", type=float, default=None, help="KV pool per rank (default: engine's)")
        p.add_argument("--hicache-gb", type=float, default=None, help="host prefix cache per rank; 0: off")
        p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        p.add_argument("--load-format", default="auto", help="auto | dummy (random weights)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
        p.add_argument("--rank-start-timeout-s", type=float, default=600.0)
        p.add_argument("--log-level", default="info")
        ns = vars(p.parse_args(argv))
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in ns.items() if k in names})
