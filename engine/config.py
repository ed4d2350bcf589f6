"""Engine configuration (what the user asks for) and measured results (what the engine found).

Every setting is one field: its default, type and help (metadata "help"; pd/flags.py makes the
`python -m pd.server` flags from them, and a rank receives the whole EngineConfig through engine/codec.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from engine.quantization import QUANTIZATIONS

DEFAULT_MODEL = "smollm2-135m-instruct"
LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
PREFILL_SDPA_PATHS = ("fresh", "off", "flash", "cudnn")
GEMV_MAX_ROWS = 8  # pdkernels/gemv.py MAX_ROWS
FP8_GEMM_PATHS = ("auto", "triton", "dequantize")


MAX_DEFAULT_MODEL_LEN = 32768  # the context without --max-model-len: the model's, at most this

@dataclass(frozen=True)
class ForwardConfig:
    """How a forward pass runs on CUDA (the CPU path ignores it). It travels in the step's forward
    context (engine/layers/context.py), so a runner's may be replaced between steps; NOTE: decode CUDA graphs
    keep the one they were captured with (only chain_residuals matters to them)."""

    prefill_sdpa: str = field(
        default="fresh",
        metadata={
            "help": "default mode: which prefill chunks go through torch's SDPA instead of the Triton kernel: "
            "fresh (a chunk of --prefill-sdpa-fresh-min-tokens or more with nothing cached before it, on "
            "cuDNN), flash or cudnn (every large chunk, cached prefix or not; cudnn: cuDNN first where "
            "torch can), off (every chunk on the kernel)",
            "choices": PREFILL_SDPA_PATHS,
        },
    )
    prefill_sdpa_fresh_min_tokens: int = field(
        default=4096, metadata={"help": "fresh: a chunk's tokens from which it takes SDPA (measured on the H200)"}
    )
    prefill_sdpa_min_pairs: int = field(
        default=1 << 20,
        metadata={"help": "flash|cudnn: a chunk takes SDPA from this many queries x visible keys (2^20: 1k prompt)"},
    )
    prefill_sdpa_min_queries: int = field(
        default=128, metadata={"help": "flash|cudnn: and from this many queries (new tokens)"}
    )
    chain_residuals: bool = field(
        default=True, metadata={"help": "each residual add inside the next norm's kernel (same numbers)"}
    )
    decode_rope: bool = field(
        default=True,
        metadata={"help": "decode rows' q/k norms and rotary inside the attention kernel (one launch fewer per layer)"},
    )
    # NOTE: gemv_rows, pdl and EngineConfig.launch_ahead are on by default: measured on the H200 (issue 31,
    # bench/figures/speed-guard.md), each made the decode step faster at batch 1 and 64 with the same tokens
    gemv_rows: int = field(
        default=1,
        metadata={"help": "default mode: a projection of at most this many rows (a decode step's) runs as one "
                  "Triton matrix-vector kernel (the down projection with its activation fused) instead of "
                  "cuBLAS; 0: always cuBLAS"},
    )
    pdl: bool = field(
        default=True,
        metadata={"help": "Triton kernels start while the kernel before them ends (programmatic dependent launch, "
                  "Hopper and later; same numbers): hides a launch and a tail per kernel"},
    )

    fp8_gemm: str = field(
        default="auto",
        metadata={
            "help": "FP8 weights (an FP8 checkpoint, --quantization fp8), default mode on FP8 tensor cores: auto "
            "(cuBLAS's block-scaled FP8 GEMM on Hopper where N and K are whole 128-blocks, else the Triton "
            "kernel; rows up to --gemv-rows through the FP8 GEMV), triton (the Triton kernel always), "
            "dequantize (every FP8 linear's product on its weight dequantized to the dtype: the reference path; "
            "FP8 MoE experts keep the fused kernel, which dequantizes each weight tile in registers)",
            "choices": FP8_GEMM_PATHS,
        },
    )

    def __post_init__(self) -> None:
        if self.fp8_gemm not in FP8_GEMM_PATHS:
            raise ValueError(f"fp8_gemm must be one of {FP8_GEMM_PATHS}, got {self.fp8_gemm!r}")
        if self.prefill_sdpa not in PREFILL_SDPA_PATHS:
            raise ValueError(f"prefill_sdpa must be one of {PREFILL_SDPA_PATHS}, got {self.prefill_sdpa!r}")
        if not 0 <= self.gemv_rows <= GEMV_MAX_ROWS:
            raise ValueError(f"gemv_rows must be within 0..{GEMV_MAX_ROWS}, got {self.gemv_rows}")
        if min(self.prefill_sdpa_fresh_min_tokens, self.prefill_sdpa_min_pairs, self.prefill_sdpa_min_queries) < 1:
            raise ValueError("the prefill SDPA thresholds must be >= 1")


SPECULATIVE_METHODS = ("ngram", "mtp", "draft_model")
# vLLM's other names of the same methods
_METHOD_ALIASES = {"deepseek_mtp": "mtp", "draft": "draft_model"}
MAX_SPECULATIVE_TOKENS = 7  # drafts per sequence and step, at most (the verify widths CUDA graphs capture)


KV_EVENT_PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, the fields pdserve honours (another field is refused by name)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://127.0.0.1:5557"  # loopback unless told otherwise: the stream carries prompt tokens
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**raw)
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
        if cfg.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"--kv-events-config: publisher must be one of {KV_EVENT_PUBLISHERS}, got {cfg.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(cfg, name)
            if value is not None and (not isinstance(value, str) or not value.startswith("tcp://") or ":" not in value[6:]):
                raise ValueError(f"--kv-events-config: {name} must be tcp://HOST:PORT, got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(cfg, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--kv-events-config: {name} must be an integer >= 1, got {value!r}")
        if not isinstance(cfg.topic, str):
            raise ValueError("--kv-events-config: topic must be a string")
        return cfg

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, vLLM's JSON: which method drafts tokens and how many each step verifies.

    ngram: prompt lookup, no extra weights: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (prompt and output), n from prompt_lookup_max down to prompt_lookup_min.
    mtp: the checkpoint's own multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers).
    draft_model: a small model of the same tokenizer (`model`).
    disable_by_batch_size: a step with more running sequences than this does not speculate (a large batch
    is compute-bound: verifying drafts costs more than it saves).
    auto_disable (pdserve's own, default false): below that too, a batch size where drafted steps measure fewer
    tokens per second than plain ones stops drafting (engine/speculative/switch.py; not the default: on short
    CPU runs it lost to drafting always, bench/figures/speculative-decoding.md)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int | None = None
    auto_disable: bool = False  # pdserve's: stop drafting for a batch size where it measures slower (engine/speculative/switch.py)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be within 1..{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("a draft model is named by `model`, and only method draft_model takes one")
        if not isinstance(self.auto_disable, bool):
            raise ValueError(f"auto_disable must be true or false, got {self.auto_disable!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From vLLM's JSON ({"method": "ngram", "num_speculative_tokens": 3, ...}); a key it does not know is
        an error. Without "method", a "model" means draft_model."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config must be a JSON object: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown} (known: {sorted(known)})")
        values: dict[str, Any] = dict(raw)
        if "method" not in values:
            if "model" not in values:
                raise ValueError(
                    "--speculative-config needs a method (ngram, mtp, draft_model) or a draft model"
                )
            values["method"] = "draft_model"
        values["method"] = _METHOD_ALIASES.get(values["method"], values["method"])
        if "num_speculative_tokens" not in values:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        for key in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
        ):
            v = values.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"--speculative-config: {key} must be an integer, got {v!r}")
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(
        default=DEFAULT_MODEL,
        metadata={
            "help": "a local Hugging Face folder, a catalogue name (python -m engine.checkpoints list) or a Hugging "
            "Face hub id ORG/NAME[@REVISION] (downloaded once into huggingface_hub's cache: $HF_HOME, "
            "$HF_HUB_CACHE; $HF_TOKEN for gated models, $HF_HUB_OFFLINE=1 for the cache alone)"
        },
    )
    revision: str | None = field(
        default=None,
        metadata={"help": "hub ids: the branch, tag or commit to serve (as ORG/NAME@REVISION); default: main"},
    )
    download_dir: str | None = field(
        default=None,
        metadata={"help": "hub ids: the huggingface_hub cache to download into and read from; default: $HF_HUB_CACHE"},
    )
    device: str = field(
        default="auto", metadata={"help": "auto | cpu | cuda | cuda:N (a server gives each rank its own GPU)"}
    )
    dtype: str = field(
        default="auto", metadata={"help": "auto: float32 on the CPU, bfloat16 on CUDA", "choices": DTYPES}
    )
    load_format: str = field(
        default="auto",
        metadata={"help": "auto | dummy (random weights from config.json alone: smoke tests)", "choices": LOAD_FORMATS},
    )
    quantization: str | None = field(
        default=None,
        metadata={
            "help": "fp8: quantize a float checkpoint's projections (attention, MLP, experts) to block-scaled FP8 "
            "as they load (128x128 blocks, the format FP8 releases ship in); an FP8 checkpoint loads as FP8 "
            "without it",
            "choices": QUANTIZATIONS,
        },
    )
    block_size: int = field(default=128, metadata={"help": "tokens per KV page (one page = one KV block)"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "prompt + output tokens; default: the model's max positions, at most 32768"}
    )
    max_num_seqs: int = field(default=64, metadata={"help": "sequences a rank runs at once"})
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "tokens per engine step (the chunked-prefill budget)"}
    )
    kv_cache_gb: float | None = field(
        default=None, metadata={"help": "KV memory per rank, GiB; default 2 on the CPU, measured on CUDA"}
    )
    num_swa_slots: int | None = field(
        default=None, metadata={"help": "sliding-window state slots per rank; default --max-num-seqs + 1"}
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "CUDA: the fraction of the GPU's memory a rank may fill"}
    )
    hicache_gb: float | None = field(
        default=None,
        metadata={
            "help": "host prefix cache per rank, GiB; 0 turns it off; default 1 (CPU) / 32 (CUDA)",
            "aliases": ("hicache-size-gb",),
        },
    )
    hicache_state_slots: int | None = field(
        default=None, metadata={"help": "SWA state slots of the host cache; default: what a quarter of it holds"}
    )
    is_deterministic: bool = field(
        default=False,
        metadata={"help": "batch-invariant numerics (a sequence's logits do not depend on its batch)", "flag": "deterministic"},
    )
    enforce_eager: bool = field(
        default=False, metadata={"help": "CUDA: no decode graphs (every step launched kernel by kernel)"}
    )
    decode_cache: bool = field(
        default=True,
        metadata={
            "help": "decode: keep a finished request's KV pages as evictable cache so the next turn's handoff "
            "sends only the pages this rank lacks"
        },
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={
            "help": "vLLM's: --no-enable-prefix-caching turns every prefix cache off (the host prefix cache of "
            "--hicache-gb and the decode cache of --decode-cache): every prompt is computed or handed off whole"
        },
    )
    eplb_interval: int = field(
        default=0,
        metadata={
            "help": "MoE with --ep: every N engine steps the ranks rebalance their experts by the tokens "
            "each got (EPLB; every rank waits for the move); 0: never (the default: rebalancing after "
            "every prefill stalled all ranks for ~0.3 s under multi-turn traffic in the reference system)"
        },
    )
    launch_ahead: bool = field(
        default=True,
        metadata={
            "help": "steady decode: launch the next step's forward before this step's outputs are built and "
            "sent, so the device works while the host does (same tokens; a request arriving meanwhile "
            "starts a step later)"
        },
    )
    speculative_config: str | None = field(
        default=None,
        metadata={
            "help": "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
            "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1} (prompt lookup), {\"method\": \"mtp\", "
            "\"num_speculative_tokens\": 1} (the checkpoint's multi-token-prediction layers), {\"model\": DRAFT, "
            "\"num_speculative_tokens\": 4} (a draft model); \"disable_by_batch_size\": N stops it above N "
            "running sequences; \"auto_disable\": true stops it, below that too, for a batch size where drafted steps "
            "measure slower than plain ones (experimental). Lossless: the same tokens as without it"
        },
    )
    kv_events_config: str | None = field(
        default=None,
        metadata={
            "help": "KV cache events, vLLM's JSON: {\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
            "\"endpoint\": \"tcp://127.0.0.1:5557\", \"replay_endpoint\": \"tcp://127.0.0.1:5558\", \"topic\": "
            "\"kv-events\"}: every rank publishes what its prefix caches gain and lose (ZeroMQ PUB, msgpack; ports "
            "+ the rank), for a KV-aware router. The stream carries prompt token ids: it binds to loopback "
            "unless an endpoint says otherwise"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of dummy weights and of unseeded sampling"})
    forward: ForwardConfig = field(default_factory=ForwardConfig, metadata={"help": "model forward (CUDA)"})

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.eplb_interval < 0:
            raise ValueError(f"eplb_interval must be >= 0, got {self.eplb_interval}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        self.speculative()  # raises on a bad --speculative-config
        self.kv_events()  # raises on a bad --kv-events-config

    @property
    def uses_decode_cache(self) -> bool:
        """--decode-cache, unless --no-enable-prefix-caching turns every prefix cache off."""
        return self.decode_cache and self.enable_prefix_caching

    def kv_events(self) -> KVEventsConfig | None:
        return None if self.kv_events_config is None else KVEventsConfig.parse(self.kv_events_config)

    @property
    def records_kv_events(self) -> bool:
        cfg = self.kv_events()
        return cfg is not None and cfg.enable_kv_cache_events

    def speculative(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

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
    num_launched_ahead_total: int = 0  # decode batches launched before the step before them returned (--launch-ahead)
    num_fed_ahead_total: int = 0  # of those, launched before the last step's tokens reached the host (greedy rows)
    # speculative decoding (--speculative-config), vLLM's counters: drafts verified (a sequence's in one step),
    # their tokens, the tokens accepted, and accepted per draft position (position 0 first)
    spec_num_drafts_total: int = 0
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    spec_switch_drafted_steps_total: int = 0  # pure decode steps drafted / not, as the switch chose (auto_disable)
    spec_switch_plain_steps_total: int = 0
    cache_lookups_total: int = 0
    cache_query_tokens_total: int = 0
    cache_hit_tokens_total: int = 0
    cache_stored_pages_total: int = 0
    cache_evictions_total: int = 0
    cache_bytes_to_device_total: int = 0
    cache_bytes_to_host_total: int = 0
    cache_used_pages: int = 0
    cache_total_pages: int = 0
    cache_used_states: int = 0
    cache_total_states: int = 0
    decode_cache_lookups_total: int = 0
    decode_cache_query_tokens_total: int = 0
    decode_cache_hit_tokens_total: int = 0
    decode_cache_retained_pages: int = 0  # evictable or pinned again; they count as free in num_free_blocks
    decode_cache_evictions_total: int = 0
    # MoE (engine/layers/moe.py): per sparse layer (moe_layers), this rank's routed assignments per logical
    # expert and the rows its experts computed (under --ep, for every rank's tokens), since the start
    moe_layers: tuple[int, ...] = ()
    moe_tokens_per_expert: tuple[tuple[int, ...], ...] = ()
    moe_rows_computed: tuple[int, ...] = ()
    eplb_rebalances_total: int = 0
    eplb_experts_moved_total: int = 0
    eplb_seconds_total: float = 0.0
