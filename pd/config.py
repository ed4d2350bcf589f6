"""ServerConfig: everything `python -m pd.server` is told on its command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_PORT = 8888
DEFAULT_PE_PORT = 8889
DEFAULT_KV_PORT_BASE = 8900
ROUTING_POLICIES = ("affinity", "least-loaded")
ROLES = ("single", "pe", "ce")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server and the engine ranks it starts. role: single (colocated prefill and decode), pe
    (prefill engine: POST /prefill) or ce (decode engine: the user-facing coordinator and KV receivers)."""

    model: str = DEFAULT_MODEL
    role: str = "single"
    served_model_name: str | None = None  # name clients use; defaults to `model`
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    dp: int = 1  # engine ranks (processes); one per GPU on CUDA
    device: str = "auto"
    deterministic: bool = False
    enforce_eager: bool = False  # CUDA: no decode graphs (vLLM's --enforce-eager)
    routing: str = "affinity"
    chat_template: str | None = None  # path of a Jinja file that replaces the checkpoint's template
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 128
    kv_cache_gb: float | None = None
    hicache_gb: float | None = None  # host prefix cache per rank; 0 turns it off; None: the engine's default
    hicache_state_slots: int | None = None  # SWA state slots in it; None: the engine's default
    dtype: str = "auto"
    load_format: str = "auto"  # auto | dummy (random weights: smoke tests without a checkpoint's weights)
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    max_body_bytes: int = 4 * 1024 * 1024
    rank_start_timeout_s: float = 600.0
    log_level: str = "info"
    # ---- P/D (--role pe|ce) ----
    prefill_url: str = f"http://127.0.0.1:{DEFAULT_PE_PORT}"  # CE: the PE's prefill server
    kv_host: str = "127.0.0.1"  # CE: address the KV receivers bind
    kv_advertise_host: str | None = None  # CE: address the PE sends KV to (default: kv_host)
    kv_port_base: int = DEFAULT_KV_PORT_BASE  # CE: rank i receives on kv_port_base + i
    transport: str = "tcp"  # PE: tcp | nccl | ipc
    ipc_arena_gb: float = 4.0  # PE, ipc: GPU buffer exported once that exports are gathered into; 0: off
    handoff_lease_s: float = 30.0  # PE: KV kept at most this long for the CE's ack
    prefill_timeout_s: float = 600.0  # CE: a /prefill answer (PE queue, prefill and handoff) within this
    fallback_local_prefill: bool = False  # CE: prefill locally when the PE fails or is unreachable
    max_queued_requests: int = 256  # CE: requests waiting for decode memory; more get 429
    queue_timeout_s: float = 120.0  # CE: a request waits this long for decode memory, then 503
    cluster_token_file: str | None = None  # else $PDSERVE_CLUSTER_TOKEN / $PDSERVE_CLUSTER_TOKEN_FILE

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {ROLES}, got {self.role!r}")
        if not (0 < self.kv_port_base and self.kv_port_base + self.dp <= 65536):
            raise ValueError(f"--kv-port-base must leave a port per rank, got {self.kv_port_base}")
        if min(self.handoff_lease_s, self.prefill_timeout_s, self.queue_timeout_s) <= 0:
            raise ValueError("--handoff-lease-s, --prefill-timeout-s and --queue-timeout-s must be > 0")
        if self.ipc_arena_gb < 0:
            raise ValueError(f"--ipc-arena-gb must be >= 0, got {self.ipc_arena_gb}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
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

    @property
    def is_pd(self) -> bool:
        return self.role != "single"

    def kv_address(self, rank: int) -> str:
        """Where the PE sends rank's handoffs ("host:port")."""
        host = self.kv_advertise_host or self.kv_host
        if host in ("0.0.0.0", "::", ""):
            import socket

            host = socket.getfqdn()
        return f"[{host}]:{self.kv_port_base + rank}" if ":" in host else f"{host}:{self.kv_port_base + rank}"

    def role_config(self, rank: int) -> dict[str, Any]:
        """What a P/D rank process is told about its role (pd/pe_rank.py, pd/ce_rank.py)."""
        if self.role == "pe":
            return {
                "token_file": self.cluster_token_file,
                "transport": self.transport,
                "ipc_arena_bytes": int(self.ipc_arena_gb * 2**30),
            }
        if self.role == "ce":
            return {
                "token_file": self.cluster_token_file,
                "kv_host": self.kv_host,
                "kv_port": self.kv_port_base + rank,
            }
        return {}

    def engine_kwargs(self) -> dict[str, Any]:
        """The EngineConfig fields a rank builds its engine from (device is resolved per rank)."""
        return {
            "model": self.model,
            "device": self.device,
            "deterministic": self.deterministic,
            "enforce_eager": self.enforce_eager,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "kv_cache_gb": self.kv_cache_gb,
            "hicache_gb": self.hicache_gb,
            "hicache_state_slots": self.hicache_state_slots,
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
        p.add_argument("--role", choices=ROLES, default="single", help="single | pe (prefill) | ce (decode)")
        p.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=None, help="default 8888 (8889 for --role pe)")
        p.add_argument("--dp", type=int, default=1, help="engine ranks (one process each)")
        p.add_argument("--device", default="auto", help="auto | cpu | cuda")
        p.add_argument("--deterministic", action="store_true", help="batch-invariant numerics")
        p.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs")
        p.add_argument("--routing", choices=ROUTING_POLICIES, default="affinity")
        p.add_argument("--chat-template", default=None, help="Jinja chat template file")
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
        p.add_argument("--block-size", type=int, default=128)
        p.add_argument("--kv-cache-gb", type=float, default=None, help="KV pool per rank (default: engine's)")
        p.add_argument(
            "--hicache-gb", "--hicache-size-gb", type=float, default=None, help="host prefix cache per rank; 0: off"
        )
        p.add_argument("--hicache-state-slots", type=int, default=None, help="SWA state slots of the host cache")
        p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        p.add_argument("--load-format", default="auto", help="auto | dummy (random weights)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
        p.add_argument("--rank-start-timeout-s", type=float, default=600.0)
        p.add_argument("--log-level", default="info")
        g = p.add_argument_group("P/D cluster (--role pe|ce)")
        g.add_argument(
            "--prefill-url", default=f"http://127.0.0.1:{DEFAULT_PE_PORT}", help="CE: the PE server"
        )
        g.add_argument("--kv-host", default="127.0.0.1", help="CE: address the KV receivers bind")
        g.add_argument("--kv-advertise-host", default=None, help="CE: address the PE sends KV to")
        g.add_argument(
            "--kv-port-base", type=int, default=DEFAULT_KV_PORT_BASE, help="CE: rank i on base + i"
        )
        g.add_argument("--transport", choices=("tcp", "nccl", "ipc"), default="tcp", help="PE: KV transport")
        g.add_argument(
            "--ipc-arena-gb", type=float, default=4.0, help="PE, ipc: exported GPU buffer for exports; 0: off"
        )
        g.add_argument("--handoff-lease-s", type=float, default=30.0, help="PE: KV kept for the CE's ack")
        g.add_argument("--prefill-timeout-s", type=float, default=600.0, help="CE: wait for /prefill")
        g.add_argument(
            "--fallback-local-prefill", action="store_true", help="CE: prefill locally if the PE fails"
        )
        g.add_argument(
            "--max-queued-requests", type=int, default=256, help="CE: waiting for memory; more: 429"
        )
        g.add_argument("--queue-timeout-s", type=float, default=120.0, help="CE: wait for memory; then 503")
        g.add_argument("--cluster-token-file", default=None, help="else $PDSERVE_CLUSTER_TOKEN(_FILE)")
        ns = vars(p.parse_args(argv))
        if ns["port"] is None:
            ns["port"] = DEFAULT_PE_PORT if ns["role"] == "pe" else DEFAULT_PORT
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in ns.items() if k in names})
