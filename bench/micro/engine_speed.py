"""Engine speed on one GPU, against the two ceilings and against transformers.

In one run:
  1. the ceilings: a large device-to-device copy (bytes read + written per second) and a large matmul
     in the run's dtype (FLOP/s);
  2. per model (8B-shaped dummy configs in bench/configs/) and per mode (default, --deterministic):
     - decode at each (batch, context): tokens/s, ms/step, and the fraction of the copy ceiling that
       the step's bytes reach: every linear weight + lm_head once, plus the KV each sequence reads
       (context tokens per full layer, min(context, window) per sliding layer);
     - prefill of N tokens as one sequence, chunked by the engine's token budget: tokens/s and the
       fraction of the matmul ceiling, FLOPs = 2 x linear params x N + 2 x lm_head params (the last
       row only) + attention (4 x heads x head_dim per visible (query, key) pair, windowed on sliding
       layers; latent attention: 2 x heads x (key width + value width), the latents expanded per head);
  3. the same workloads through transformers (static cache, SDPA, torch.compile while it compiles
     in time) and the ratio pdserve / transformers.
One table at the end; everything, environment included, as JSON in --out.

Modes (--modes): default, deterministic, and default mode with its prefill attention pinned, to compare
the paths in one run: default-triton (every chunk on the Triton kernel), default-sdpa (large chunks
through torch's flash SDPA), default-cudnn (cuDNN first where torch can run it). Plain `default` runs
what --prefill-sdpa selects (the engine's ForwardConfig flags, as `python -m pd.server` takes them).

How decode rows start: by default (`--kv-fill skip`) a row's sequences are admitted as if their
prompt KV had arrived from elsewhere (the engine's import path, without the copy) and transformers'
static cache is marked filled to the same length: neither side's decode cost depends on the cached
values, and computing 64 x 8k prompts would cost more than the rest of the run. `--kv-fill prefill`
computes the prompts first (untimed) for the engine.

    python bench/micro/engine_speed.py                      # the full grid, on the GPU
    python bench/micro/engine_speed.py --tiny               # CPU smoke test, under a minute
    python bench/micro/engine_speed.py --merge a.json b.json  # one table from several runs
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from engine.arch import ModelArch  # noqa: E402
from engine.config import EngineConfig, ForwardConfig  # noqa: E402
from engine.core.kv_cache import layout_of  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.models.registry import arch_from_hf, load_hf_config  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from pd.flags import add_flags, from_flags  # noqa: E402

CONFIGS = REPO / "bench" / "configs"
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed keyword arguments
GiB = 2**30

# --tiny: the same families at toy sizes, so the whole script runs on 2 CPU cores.
TINY_MOE: dict[str, Any] = dict(
    num_experts=8, num_local_experts=8, num_experts_per_tok=2, experts_per_token=2, moe_intermediate_size=32,
    intermediate_size=32,
)
TINY_MLA: dict[str, Any] = dict(  # latent attention's widths (DeepSeek's ratios, shrunk)
    kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
    n_group=2, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1,
)
TINY_DIMS: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512, max_position_embeddings=2048,
)


# mode -> (deterministic numerics, what its rows change in the engine's ForwardConfig (launch_ahead: in
# its EngineConfig); the rest as the flags say): the prefill paths, and each of the decode step's
# defaults switched off alone: nogemv (cuBLAS instead of the small-batch GEMV), nopdl (no programmatic
# dependent launch), noahead (no launch-ahead), norope (the decode rows' q/k norms and rotary in a
# kernel of their own before the attention kernel, fused_ops.qk_rope_); plain: gemv, pdl and
# launch-ahead all off (the defaults before issue 31)
ENGINE_MODES: dict[str, tuple[bool, dict[str, Any]]] = {
    "default": (False, {}),
    "deterministic": (True, {}),
    "default-triton": (False, {"prefill_sdpa": "off"}),
    "default-sdpa": (False, {"prefill_sdpa": "flash"}),
    "default-cudnn": (False, {"prefill_sdpa": "cudnn"}),
    "default-nogemv": (False, {"gemv_rows": 0}),
    "default-nopdl": (False, {"pdl": False}),
    "default-noahead": (False, {"launch_ahead": False}),
    "default-plain": (False, {"gemv_rows": 0, "pdl": False, "launch_ahead": False}),
    "default-norope": (False, {"decode_rope": False}),
    "deterministic-nopdl": (True, {"pdl": False}),
}


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


# ---- counting ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """Bytes a decode step must read and FLOPs a prefill must do, from the architecture alone."""

    arch: ModelArch
    elem_bytes: int
    weight_bytes_per_param: float | None = None  # the linear weights' (FP8: 1 + a 128x128 block's scale); elem_bytes if None

    @property
    def attn_params(self) -> int:
        a = self.arch
        m = a.mla
        if m is not None:  # q (plain, or through its LoRA), kv_a (latent + rotary key), kv_b (W_UK, W_UV), o
            q_width = a.num_heads * m.qk_head_dim
            q = a.hidden_size * m.q_lora_rank + m.q_lora_rank * q_width if m.q_lora_rank else a.hidden_size * q_width
            kv = a.hidden_size * (m.kv_lora_rank + m.qk_rope_head_dim)
            kv += m.kv_lora_rank * a.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + a.num_heads * m.v_head_dim * a.hidden_size
        return a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)

    @property
    def num_experts(self) -> int:
        return self.arch.moe.num_experts if self.arch.moe is not None else 0

    @property
    def expert_params(self) -> int:
        """One expert's SwiGLU weights (0 for a dense model)."""
        moe = self.arch.moe
        return 3 * self.arch.hidden_size * moe.moe_intermediate_size if moe is not None else 0

    @property
    def dense_params(self) -> int:
        """Every layer's weights a decode step reads whatever it routes: attention, dense MLPs, routers."""
        a = self.arch
        num_sparse = len(a.sparse_layers)
        mlps = (a.num_layers - num_sparse) * 3 * a.hidden_size * a.intermediate_size
        shared = num_sparse * 3 * a.hidden_size * (a.moe.shared_intermediate_size if a.moe else 0)  # always-on experts
        return a.num_layers * self.attn_params + mlps + shared + num_sparse * a.hidden_size * self.num_experts

    @property
    def linear_params(self) -> int:
        """All linear weights (a MoE's every expert included)."""
        return self.dense_params + len(self.arch.sparse_layers) * self.num_experts * self.expert_params

    @property
    def active_linear_params(self) -> int:
        """The linear weights one token goes through (a MoE's top-k experts per sparse layer)."""
        a = self.arch
        top_k = a.moe.num_experts_per_tok if a.moe else 0
        return self.dense_params + len(a.sparse_layers) * top_k * self.expert_params

    def expected_experts_read(self, batch: int) -> float:
        """Distinct experts a batch of `batch` tokens selects, all sparse layers, if routing were uniform."""
        a = self.arch
        if a.moe is None or not a.sparse_layers:
            return 0.0
        miss = (1 - a.moe.num_experts_per_tok / a.moe.num_experts) ** batch
        return len(a.sparse_layers) * a.moe.num_experts * (1 - miss)

    @property
    def lm_head_params(self) -> int:
        return self.arch.vocab_size * self.arch.hidden_size

    @property
    def linear_bytes(self) -> float:
        """Bytes per linear weight (the LM head stays in elem_bytes: checkpoints and --quantization keep it)."""
        return self.elem_bytes if self.weight_bytes_per_param is None else self.weight_bytes_per_param

    @property
    def weight_bytes(self) -> float:
        return self.linear_params * self.linear_bytes + self.lm_head_params * self.elem_bytes

    def step_weight_bytes(self, experts_read: float | None = None, batch: int = 1) -> float:
        """The weights one decode step reads: all of a dense model's; a MoE's dense part and lm_head and
        the experts its tokens selected (experts_read over all sparse layers: measured, else the
        uniform-routing expectation)."""
        if not self.arch.sparse_layers:
            return float(self.weight_bytes)
        read = self.expected_experts_read(batch) if experts_read is None else experts_read
        return ((self.dense_params + read * self.expert_params) * self.linear_bytes
                + self.lm_head_params * self.elem_bytes)

    @property
    def kv_bytes_per_token_layer(self) -> int:
        a = self.arch
        if a.mla is not None:  # one latent per token: c_kv and the rotary key
            return (a.mla.kv_lora_rank + a.mla.qk_rope_head_dim) * self.elem_bytes
        return 2 * a.num_kv_heads * a.head_dim * self.elem_bytes

    def kv_read_bytes(self, context: int) -> int:
        """KV one sequence reads in one decode step at this context."""
        a = self.arch
        window = a.sliding_window or 0
        per_layer = [context if t == "full_attention" else min(context, window) for t in a.layer_types]
        return sum(per_layer) * self.kv_bytes_per_token_layer

    def decode_bytes(self, batch: int, context: int, experts_read: float | None = None) -> float:
        return self.step_weight_bytes(experts_read, batch) + batch * self.kv_read_bytes(context)

    def prefill_flops(self, n: int) -> float:
        a = self.arch
        window = a.sliding_window or 0
        full_pairs = n * (n + 1) / 2
        if n <= window:
            win_pairs = full_pairs
        else:
            win_pairs = window * (window + 1) / 2 + (n - window) * window
        pairs = sum(full_pairs if t == "full_attention" else win_pairs for t in a.layer_types)
        # per visible pair and head: q.k over the key's width, p.v over the value's (latent attention expands
        # the latents per head for long chunks: keys Dn + Dr, values Dv wide)
        pair_width = a.mla.qk_head_dim + a.mla.v_head_dim if a.mla is not None else 2 * a.head_dim
        return 2.0 * self.active_linear_params * n + 2.0 * self.lm_head_params + 2.0 * a.num_heads * pair_width * pairs


# ---- timing helpers ------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    """Median seconds of fn, by CUDA events on the GPU, by the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    """Median milliseconds of one replay of a captured CUDA graph, by CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median milliseconds of fn captured in one CUDA graph (run eagerly first: Triton compiles, cuBLAS
    picks its kernels; replayed once before timing)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    return replay_ms(graph, reps)


def copy_bytes_per_s(device: torch.device, n_bytes: int = 4096 * 2**20) -> float:
    """The copy ceiling: an eager device copy of n_bytes, bytes read + written per second. (Captured in a
    graph a copy runs as a memcpy node, ~2.7 TB/s on an H200 against ~4.2 eager: not a kernel's ceiling.)"""
    src = torch.randn(n_bytes // 2, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * n_bytes / time_op(lambda: dst.copy_(src), device, 3, 10)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_ceilings(device: torch.device, dtype: torch.dtype, tiny: bool) -> dict[str, float]:
    n_bytes = (64 if tiny else 4096) * 2**20
    copy_rate = copy_bytes_per_s(device, n_bytes)
    n = 512 if tiny else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_s = time_op(lambda: a @ b, device, 3, 10)
    return {
        "copy_bytes": 2 * n_bytes,
        "copy_bytes_per_s": copy_rate,
        "matmul_n": n,
        "matmul_flops_per_s": 2.0 * n**3 / mm_s,
        **fp8_matmul_ceiling(device, n),
    }


def fp8_matmul_ceiling(device: torch.device, n: int) -> dict[str, float]:
    """torch._scaled_mm on n^3 float8_e4m3fn operands with per-tensor scales (cuBLAS's FP8 GEMM, the FP8
    ceiling of the image), where the device has FP8 tensor cores; {} elsewhere."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return {}
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    try:
        mm_s = time_op(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), device, 3, 10)
    except RuntimeError:
        return {}
    return {"fp8_matmul_flops_per_s": 2.0 * n**3 / mm_s}


class Deadline:
    """The run's wall-clock budget; rows past it are skipped, never cut off mid-way."""

    def __init__(self, budget_s: float | None) -> None:
        self.end = time.monotonic() + budget_s if budget_s else None

    def left_s(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()


# ---- the engine ----------------------------------------------------------------------------------


def build_engine(folder: Path, args: argparse.Namespace, is_det: bool, forward: ForwardConfig, max_len: int,
                 kv_bytes: int, max_seqs: int) -> LLMEngine:
    extra = {} if args.hicache_gb is None else {"hicache_gb": args.hicache_gb}
    return LLMEngine(EngineConfig(
        model=str(folder), device=args.device, load_format="dummy", is_deterministic=is_det,
        max_num_seqs=max_seqs, max_num_batched_tokens=args.chunk, block_size=args.block_size,
        max_model_len=max_len, kv_cache_gb=kv_bytes / GiB, num_swa_slots=max_seqs + 1, seed=args.seed,
        launch_ahead=args.launch_ahead, forward=forward, quantization=args.quantization, **extra,
    ))


def admit_prefilled(eng: LLMEngine) -> None:
    """Moves every waiting sequence straight into decode with its prompt counted as cached (what
    import_sequence does, minus copying pages in): the next step computes its last prompt token."""
    sched = eng.scheduler
    for seq in list(sched.waiting):
        assert sched.can_admit(seq.num_tokens)
        sched.allocate(seq)
        seq.num_computed = seq.num_prompt_tokens - 1
        seq.num_cached_prompt = seq.num_computed
        sched.admit_prefilled(seq)


def release_all(eng: LLMEngine, ids: list[str]) -> None:
    for rid in ids:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    eng.check_idle()


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (count, length), generator=gen).tolist()


def engine_decode(eng: LLMEngine, batch: int, context: int, args: argparse.Namespace) -> dict[str, Any]:
    steps, warmup = args.steps, 2
    total = context + warmup + steps + 2
    need_blocks = batch * eng.scheduler.blocks_for(total + 1)
    if need_blocks > eng.blocks.num_free or (eng.arch.has_sliding and batch > eng.slots.num_free):
        return {"status": "skipped: KV"}
    params = SamplingParams(max_tokens=warmup + steps + 2, temperature=0.0, ignore_eos=True)
    ids = [f"d{batch}x{context}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(batch, context, eng.arch.vocab_size, args.seed)):
        eng.add_request(rid, prompt, params)
    try:
        if args.kv_fill == "skip":
            admit_prefilled(eng)
        else:
            while any(s.num_uncomputed > 1 for s in eng.scheduler.running + list(eng.scheduler.waiting)):
                eng.step()
        times, counts = [], []
        moes = eng.model.sparse_layers()
        # NOTE: a step's time is from the return of the step before it to its own return, no sync
        # between: with --launch-ahead a step returns with the next one's forward queued, and a sync
        # would charge that forward to it. Either way each step samples (a sync on) one forward.
        sync(eng.device)
        t0 = time.perf_counter()
        for i in range(warmup + steps):
            outs = eng.step()
            now = time.perf_counter()
            dt, t0 = now - t0, now
            if len(outs) != batch:
                raise RuntimeError(f"a decode step returned {len(outs)} tokens for {batch} sequences")
            # the experts' token counters after each step, copied on the device (read after the row)
            counts.append([m.tokens_per_expert.clone() for m in moes if m.tokens_per_expert is not None])
            if i >= warmup:
                times.append(dt)
                if sum(times) > args.row_cap_s and len(times) >= 2:
                    break
        # experts whose count moved from one step to the next: the ones that step's forward read
        experts_read = [
            sum(int((a != b).sum()) for a, b in zip(after, before))
            for before, after in zip(counts[warmup - 1 :], counts[warmup:])
            if moes and len(after) == len(moes)
        ]
    finally:
        release_all(eng, ids)
    out = {"status": "ok", "step_s": statistics.median(times), "num_steps": len(times)}
    if experts_read:
        out["experts_read_per_step"] = statistics.mean(experts_read)
    return out


def engine_prefill(eng: LLMEngine, n: int, args: argparse.Namespace) -> dict[str, Any]:
    if n + 1 > eng.max_model_len:
        return {"status": "skipped: max_model_len"}
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    num_runs = [0]

    def once(rid: str, length: int) -> float:
        # NOTE: a fresh prompt every run: a repeated one would be served from the prefix cache.
        num_runs[0] += 1
        (tokens,) = random_prompts(1, length, eng.arch.vocab_size, args.seed + 1000 * n + num_runs[0])
        sync(eng.device)
        t0 = time.perf_counter()
        eng.add_request(rid, tokens, params)
        try:
            while eng.has_unfinished():
                eng.step()
                if time.perf_counter() - t0 > args.row_cap_s and eng.has_unfinished():
                    raise TimeoutError
        finally:
            release_all(eng, [rid])
        sync(eng.device)
        return time.perf_counter() - t0

    try:
        once(f"pw{n}", min(n, args.chunk))  # warm-up at the chunk's shape
        times = [once(f"p{n}-0", n)]
        while len(times) < args.prefill_reps and sum(times) * (len(times) + 1) / len(times) < args.row_cap_s:
            times.append(once(f"p{n}-{len(times)}", n))
    except TimeoutError:
        return {"status": f"skipped: over {args.row_cap_s:.0f} s"}
    return {"status": "ok", "time_s": statistics.median(times), "num_reps": len(times), "chunk": args.chunk}


def oom_guard(fn: Callable[..., dict[str, Any]], *fn_args: Any) -> dict[str, Any]:
    """fn's row; an OOM or any other failure becomes the row's status, and the run goes on."""
    try:
        return fn(*fn_args)
    except torch.cuda.OutOfMemoryError:
        free_memory()
        return {"status": "OOM"}
    except Exception as e:
        traceback.print_exc()
        free_memory()
        return {"status": f"error: {type(e).__name__}", "error": str(e)[:500]}


def kv_pool_bytes(facts: ModelFacts, args: argparse.Namespace, rows: list[tuple[int, int]], num_slots: int) -> int:
    """Engine KV memory for the largest (batch, tokens) row that fits under --kv-gb, plus the SWA slots;
    rows that need more are skipped ("skipped: KV")."""
    lo = layout_of(facts.arch, args.block_size, args.dtype_t)
    slots_bytes = num_slots * lo.state_bytes
    pages = [b * math.ceil((n + 1) / lo.block_size) * lo.page_bytes for b, n in rows] if facts.arch.has_full else [0]
    fitting = [x for x in pages if x + slots_bytes <= args.kv_gb * GiB] or [0]
    return slots_bytes + max(fitting) + 2 * lo.page_bytes


def run_engine_mode(folder: Path, facts: ModelFacts, mode: str, grid: dict[str, list[int]],
                    args: argparse.Namespace, deadline: Deadline) -> list[dict[str, Any]]:
    """Two engines per model and mode: one whose KV pool holds the decode rows, one with a pool for a
    single long prompt (so the prefill rows keep the memory for their activations)."""
    is_det, changes = ENGINE_MODES[mode]
    changes = dict(changes)
    ahead = changes.pop("launch_ahead", args.launch_ahead)
    forward = replace(args.forward, **changes)
    return engine_rows(folder, facts, mode, is_det, forward, grid, replace_args(args, launch_ahead=ahead), deadline)


def replace_args(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def engine_rows(folder: Path, facts: ModelFacts, mode: str, is_det: bool, forward: ForwardConfig,
                grid: dict[str, list[int]], args: argparse.Namespace, deadline: Deadline) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if grid["batches"] and grid["contexts"]:
        max_seqs = max(grid["batches"])
        max_len = max(grid["contexts"]) + args.steps + 8
        sizes = [(b, c + args.steps + 8) for b in grid["batches"] for c in grid["contexts"]]
        eng = build_engine(folder, args, is_det, forward, max_len, kv_pool_bytes(facts, args, sizes, max_seqs + 1),
                           max_seqs)
        for context in grid["contexts"]:
            for batch in grid["batches"]:
                row = {"model": args.model_name, "mode": mode, "kind": "decode", "batch": batch, "context": context}
                if deadline.left_s() < 5:
                    row["status"] = "skipped: budget"
                else:
                    t0 = time.monotonic()
                    row.update(oom_guard(engine_decode, eng, batch, context, args))
                    row["wall_s"] = round(time.monotonic() - t0, 2)
                finish_decode_row(row, facts, args)
                rows.append(row)
                print_row(row)
        del eng
        free_memory()
    if grid["prefill"] and deadline.left_s() >= 5:
        max_len = max(grid["prefill"]) + 8
        eng = build_engine(folder, args, is_det, forward, max_len, kv_pool_bytes(facts, args, [(1, max_len)], 2), 1)
        for n in grid["prefill"]:
            row = {"model": args.model_name, "mode": mode, "kind": "prefill", "tokens": n,
                   "prefill_sdpa": "off" if is_det else forward.prefill_sdpa}
            if deadline.left_s() < 5:
                row["status"] = "skipped: budget"
            else:
                t0 = time.monotonic()
                row.update(oom_guard(engine_prefill, eng, n, args))
                row["wall_s"] = round(time.monotonic() - t0, 2)
            finish_prefill_row(row, facts, args)
            rows.append(row)
            print_row(row)
        del eng
        free_memory()
    return rows


def finish_decode_row(row: dict[str, Any], facts: ModelFacts, args: argparse.Namespace) -> None:
    """Throughput and the fraction of the copy ceiling, at the mean context of the timed steps."""
    mean_context = row["context"] + 2 + args.steps / 2
    row["bytes_per_step"] = facts.decode_bytes(row["batch"], int(mean_context), row.get("experts_read_per_step"))
    if row.get("status") == "ok":
        row["ms_per_step"] = row["step_s"] * 1e3
        row["tokens_per_s"] = row["batch"] / row["step_s"]
        row["frac_ceiling"] = row["bytes_per_step"] / row["step_s"] / args.ceilings["copy_bytes_per_s"]


def finish_prefill_row(row: dict[str, Any], facts: ModelFacts, args: argparse.Namespace) -> None:
    row["flops"] = facts.prefill_flops(row["tokens"])
    if row.get("status") == "ok":
        row["ms"] = row["time_s"] * 1e3
        row["tokens_per_s"] = row["tokens"] / row["time_s"]
        # FP8 weights against the FP8 matmul ceiling where the device has one (the CPU: the dtype's)
        ceiling = args.ceilings.get("fp8_matmul_flops_per_s" if args.fp8_weights else "", args.ceilings["matmul_flops_per_s"])
        row["frac_ceiling"] = row["flops"] / row["time_s"] / ceiling


# ---- transformers --------------------------------------------------------------------------------


def build_hf(folder: Path, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except ValueError:  # a family without SDPA in transformers (gpt-oss: its sinks): eager attention
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval().requires_grad_(False)


def make_static_cache(model: Any, max_len: int) -> Any:
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # transformers 4.x
        return StaticCache(config=model.config, max_batch_size=1, max_cache_len=max_len,
                           device=model.device, dtype=model.dtype)


class HFDecoder:
    """Decode steps through transformers with a static cache; eager, or one torch.compile'd forward
    (mode reduce-overhead: CUDA graphs) shared by every row, while compiling stays in budget."""

    def __init__(self, model: Any, args: argparse.Namespace) -> None:
        self.model = model
        self.args = args
        self.compiled: Any = None
        self.compile_s_total = 0.0
        self.compile_error: str | None = None
        self.can_compile = args.hf_compile and model.device.type == "cuda"

    def _forward(self, fn: Any, tokens: torch.Tensor, pos: int, cache: Any) -> torch.Tensor:
        cp = torch.tensor([pos], device=tokens.device)
        position_ids = cp.view(1, 1).expand(tokens.shape[0], 1)  # as generate() passes them
        logits = fn(input_ids=tokens, position_ids=position_ids, cache_position=cp, past_key_values=cache,
                    use_cache=True).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    def cache_bytes(self, facts: ModelFacts, batch: int, max_len: int) -> int:
        return batch * facts.kv_read_bytes(max_len)

    def run(self, facts: ModelFacts, batch: int, context: int) -> dict[str, Any]:
        """The eager number; compile_row() may add a compiled one later."""
        args, model = self.args, self.model
        max_len = context + 3 + args.steps + 4
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            if self.cache_bytes(facts, batch, max_len) > free - 12 * GiB:
                return {"status": "skipped: KV"}
        eager = self._timed(model.forward, batch, context, max_len, args.steps, 3)
        return {"status": "ok", "eager": eager, "step_s": eager["step_s"], "setting": "eager"}

    def wants_compile(self, left_s: float) -> bool:
        return self.can_compile and self.compile_s_total < self.args.hf_compile_budget_s and left_s > 150

    def compile_row(self, out: dict[str, Any], batch: int, context: int) -> None:
        """Adds a torch.compile'd number to an eager row and keeps whichever is faster. One compiled
        forward serves every row (a new shape recompiles); compiling stops for good after a failure
        or a first compile over a minute."""
        args, model = self.args, self.model
        steps, warmup = args.steps, 3
        t0 = time.monotonic()
        try:
            torch._dynamo.config.cache_size_limit = 64
            if self.compiled is None:
                self.compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            res = self._timed(self.compiled, batch, context, context + warmup + steps + 4, steps, warmup)
            res["compile_s"] = round(time.monotonic() - t0 - res["step_s"] * res["num_steps"], 1)
            out["compiled"] = res
            if res["step_s"] < out["step_s"]:
                out["step_s"], out["setting"] = res["step_s"], "compiled"
            if res["compile_s"] > 60:
                self.can_compile = False
        except Exception as e:  # OOM included: this row keeps its eager number
            self.compile_error = f"{type(e).__name__}: {str(e)[:300]}"
            out["compile_error"] = self.compile_error
            self.can_compile = False
            free_memory()
        self.compile_s_total += time.monotonic() - t0

    def _timed(self, fn: Any, batch: int, context: int, max_len: int, steps: int, warmup: int) -> dict[str, Any]:
        model = self.model
        cache = make_static_cache(model, max_len)
        tokens = torch.randint(10, model.config.vocab_size, (batch, 1), device=model.device)
        with torch.no_grad():
            # One eager step at position 0 allocates the cache; then every layer's fill counter says
            # `context` (transformers 5 layers write at, and report, their own counters).
            tokens = self._forward(model.forward, tokens, 0, cache)
            marked = 0
            for layer in getattr(cache, "layers", []):
                if hasattr(layer, "cumulative_length_int"):
                    layer.cumulative_length_int = context
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                    layer.cumulative_length.fill_(context)
                    marked += 1
            if int(cache.get_seq_length()) != context:
                raise RuntimeError(f"could not mark the static cache filled to {context}")
            times = []
            pos = context
            for i in range(warmup + steps):
                sync(model.device)
                t0 = time.perf_counter()
                tokens = self._forward(fn, tokens, pos, cache).clone()
                sync(model.device)
                dt = time.perf_counter() - t0
                pos += 1
                if i >= warmup:
                    times.append(dt)
                    if sum(times) > self.args.row_cap_s and len(times) >= 2:
                        break
        del cache
        return {"step_s": statistics.median(times), "num_steps": len(times), "layers_marked": marked}


def hf_prefill(model: Any, n: int, args: argparse.Namespace) -> dict[str, Any]:
    if n > model.config.max_position_embeddings:
        return {"status": "skipped: max_position_embeddings"}
    (prompt,) = random_prompts(1, n, model.config.vocab_size, args.seed + n)
    ids = torch.tensor([prompt], device=model.device)

    def once() -> float:
        sync(model.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        sync(model.device)
        return time.perf_counter() - t0

    first = once()  # warm-up (kernel selection for this shape)
    times = [once()] if first < args.row_cap_s else [first]
    while len(times) < args.prefill_reps and sum(times) * (len(times) + 1) / len(times) < args.row_cap_s:
        times.append(once())
    return {"status": "ok", "time_s": statistics.median(times), "num_reps": len(times)}


def run_hf(folder: Path, facts: ModelFacts, grid: dict[str, list[int]], args: argparse.Namespace,
           deadline: Deadline) -> dict[tuple[str, int, int], dict[str, Any]]:
    """HF results keyed by ("decode", batch, context) / ("prefill", tokens, 0)."""
    device = torch.device(args.device)
    results: dict[tuple[str, int, int], dict[str, Any]] = {}
    try:
        model = build_hf(folder, device, args.dtype_t)
    except Exception as e:
        print(f"  transformers: could not build the model: {type(e).__name__}: {e}")
        return results
    decoder = HFDecoder(model, args)
    for context in grid["contexts"]:
        for batch in grid["batches"]:
            if deadline.left_s() < 10:
                res: dict[str, Any] = {"status": "skipped: budget"}
            else:
                res = oom_guard(decoder.run, facts, batch, context)
            results[("decode", batch, context)] = res
            print(f"  transformers decode b={batch} ctx={context}: {summarize_hf(res, batch)}")
            free_memory()
    for n in grid["prefill"]:
        res = {"status": "skipped: budget"} if deadline.left_s() < 10 else oom_guard(hf_prefill, model, n, args)
        results[("prefill", n, 0)] = res
        print(f"  transformers prefill {n}: {summarize_hf(res, n)}")
        free_memory()
    # Compiling last: each new shape compiles anew, so it gets what time the eager rows left.
    for (kind, batch, context), res in results.items():
        if kind == "decode" and res.get("status") == "ok" and decoder.wants_compile(deadline.left_s()):
            decoder.compile_row(res, batch, context)
            print(f"  transformers decode b={batch} ctx={context}: {summarize_hf(res, batch)}")
            free_memory()
    if decoder.compile_error:
        print(f"  transformers: torch.compile off after: {decoder.compile_error}")
    del decoder, model
    free_memory()
    return results


def summarize_hf(res: dict[str, Any], count: int) -> str:
    if res.get("status") != "ok":
        return res.get("status", "?")
    s = float(res.get("step_s") or res["time_s"])
    return f"{count / s:,.1f} tok/s ({res.get('setting', 'eager')})"


def merge_results(results: list[dict[str, Any]]) -> tuple[dict[str, float] | None, list[dict[str, Any]]]:
    """Rows of several runs, a later run's row replacing an earlier one of the same model, mode and
    workload; each row gets the fastest transformers result any run measured for its workload."""
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    best_hf: dict[tuple[Any, ...], dict[str, Any]] = {}

    def offer(model: str, key: tuple[str, int, int], res: dict[str, Any]) -> None:
        if res.get("status") != "ok":
            best_hf.setdefault((model, key), res)
            return
        old = best_hf.get((model, key))
        t = res.get("step_s") or res["time_s"]
        if old is None or old.get("status") != "ok" or t < (old.get("step_s") or old["time_s"]):
            best_hf[(model, key)] = res

    for data in results:
        for r in data["rows"]:
            rows[(r["model"], r["mode"]) + row_key(r)] = dict(r)
            if r.get("hf"):
                offer(r["model"], row_key(r), r["hf"])
        for h in data.get("hf", []):
            offer(h["model"], tuple(h["key"]), h["result"])  # type: ignore[arg-type]
    models = list(dict.fromkeys(r["model"] for r in rows.values()))
    modes = list(dict.fromkeys(r["mode"] for r in rows.values()))
    merged = sorted(rows.values(), key=lambda r: (models.index(r["model"]), modes.index(r["mode"])))
    for r in merged:
        for k in ("hf", "hf_tokens_per_s", "hf_setting", "ratio"):
            r.pop(k, None)
    for model in {r["model"] for r in merged}:
        attach_hf([r for r in merged if r["model"] == model],
                  {key: res for (m, key), res in best_hf.items() if m == model})
    return (results[0]["ceilings"] if results else None), merged


def row_key(row: dict[str, Any]) -> tuple[str, int, int]:
    return ("decode", row["batch"], row["context"]) if row["kind"] == "decode" else ("prefill", row["tokens"], 0)


def attach_hf(rows: list[dict[str, Any]], hf: dict[tuple[str, int, int], dict[str, Any]]) -> None:
    for row in rows:
        res = hf.get(row_key(row))
        if res is None:
            continue
        row["hf"] = res
        if res.get("status") != "ok":
            continue
        count = row["batch"] if row["kind"] == "decode" else row["tokens"]
        row["hf_tokens_per_s"] = count / res.get("step_s", res.get("time_s"))
        row["hf_setting"] = res.get("setting", "eager")
        if row.get("tokens_per_s"):
            row["ratio"] = row["tokens_per_s"] / row["hf_tokens_per_s"]


# ---- the table -----------------------------------------------------------------------------------


def workload(row: dict[str, Any]) -> str:
    if row["kind"] == "decode":
        return f"decode b={row['batch']} ctx={row['context']}"
    return f"prefill {row['tokens']}"


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_row(row: dict[str, Any]) -> None:
    if row.get("status") == "ok":
        ms = row.get("ms_per_step", row.get("ms"))
        print(f"  {row['mode']:<13} {workload(row):<24} {row['tokens_per_s']:>12,.1f} tok/s {ms:>10.2f} ms "
              f"{row['frac_ceiling']:>7.1%} of ceiling", flush=True)
    else:
        print(f"  {row['mode']:<13} {workload(row):<24} {row.get('status')}", flush=True)


def table(rows: list[dict[str, Any]]) -> str:
    head = ["model", "mode", "workload", "tok/s", "ms/step", "of ceiling", "HF tok/s", "ratio"]
    lines = [head]
    for r in rows:
        if r.get("status") != "ok":
            lines.append([r["model"], r["mode"], workload(r), r.get("status", "?"), "", "", "", ""])
            continue
        ms = r.get("ms_per_step", r.get("ms"))
        hf = r.get("hf_tokens_per_s")
        hf_s = "-" if hf is None else f"{hf:,.1f}" + (" (c)" if r.get("hf_setting") == "compiled" else "")
        if hf is None and r.get("hf"):
            hf_s = r["hf"].get("status", "-")
        lines.append([
            r["model"], r["mode"], workload(r), f"{r['tokens_per_s']:,.1f}", f"{ms:.2f}",
            f"{r['frac_ceiling']:.1%} {'BW' if r['kind'] == 'decode' else 'MM'}", hf_s, fmt(r.get("ratio"), ".2f"),
        ])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = []
    for k, line in enumerate(lines):
        out.append(" | ".join(str(c).rjust(w) if i >= 3 else str(c).ljust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if k == 0:
            out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)


def ceiling_lines(ceilings: dict[str, float]) -> str:
    fp8 = ceilings.get("fp8_matmul_flops_per_s")
    return (f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e9:,.1f} GB/s (read + write), "
            f"matmul {ceilings['matmul_flops_per_s'] / 1e12:,.3g} TFLOP/s ({ceilings['matmul_n']}^3)"
            + (f", FP8 matmul (torch._scaled_mm) {fp8 / 1e12:,.4g} TFLOP/s" if fp8 else ""))


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "cpu_count": os.cpu_count(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env


# ---- main ----------------------------------------------------------------------------------------


def model_folder(name: str, args: argparse.Namespace, scratch: Path) -> Path:
    """A folder holding only config.json (dummy weights); --tiny shrinks the dims, keeps the family."""
    path = Path(name)
    config = json.loads(((path / "config.json") if path.is_dir() else CONFIGS / f"{name}.json").read_text())
    if args.tiny:
        config.update(TINY_DIMS)
        if "num_experts" in config or "num_local_experts" in config or "n_routed_experts" in config:
            config.update({k: v for k, v in TINY_MOE.items() if k in config})  # MoE: 8 small experts, top 2
        if "kv_lora_rank" in config:  # a null q_lora_rank (a plain q_proj) stays null
            config.update({k: v for k, v in TINY_MLA.items() if k in config and config[k] is not None})
            config["num_key_value_heads"] = config["num_attention_heads"]
            config["head_dim"] = config["qk_rope_head_dim"]  # as DeepseekV3Config sets it
        n = config["num_hidden_layers"]
        if "layer_types" in config:
            config["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
            config["sliding_window"] = 32
            config["query_pre_attn_scalar"] = TINY_DIMS["head_dim"]
    folder = scratch / path.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama8b,hybrid8b", help="names in bench/configs/ or folders with config.json")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--prefill", default="1024,8192,32768")
    p.add_argument("--modes", default="default,deterministic", help=f"of {', '.join(ENGINE_MODES)}")
    p.add_argument("--det-batches", default="1,8", help="deterministic mode's decode batches (its attention is slow)")
    p.add_argument("--det-contexts", default="1024")
    p.add_argument("--det-prefill", default="1024")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="the transformers side")
    p.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile transformers' decode step (CUDA only)")
    p.add_argument("--hf-compile-budget-s", type=float, default=90.0, help="compile time per model, all rows")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per row (after 2 warm-up steps)")
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--row-cap-s", type=float, default=30.0, help="time cap of one row's timed part")
    p.add_argument("--time-budget-s", type=float, default=None, help="skip rows once the run has used this much")
    p.add_argument("--kv-fill", choices=("skip", "prefill"), default="skip")
    p.add_argument("--kv-gb", type=float, default=None, help="largest engine KV pool (default: 75%% of free memory)")
    p.add_argument("--hicache-gb", type=float, default=None,
                   help="engine host prefix cache (default: the engine's; 0 turns it off)")
    p.add_argument("--chunk", type=int, default=32768,
                   help="engine max_num_batched_tokens (prefill chunk; by measurement on the H200: a whole 32k "
                        "prompt in one chunk goes to cuDNN, 1,245 ms against 1,554 in 8k chunks)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results"))
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--tiny", action="store_true", help="toy dims and grid: a CPU smoke test")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="the engine's --quantization: FP8 weights (dummy, quantized at load); decode rows count 1 "
                        "byte per linear weight, prefill rows a FP8 matmul ceiling; no transformers side")
    p.add_argument("--merge", nargs="+", default=None, help="print one table from these result JSON files")
    p.add_argument("--launch-ahead", action=argparse.BooleanOptionalAction, default=EngineConfig.launch_ahead,
                   help="every mode: the engine's --launch-ahead (the -ahead and -fast modes turn it on)")
    add_flags(p, ForwardConfig)  # --prefill-sdpa, its thresholds, --chain-residuals: the engine's own flags
    args = p.parse_args(argv)
    args.forward = from_flags(ForwardConfig, args)
    unknown = [m for m in args.modes.split(",") if m and m not in ENGINE_MODES]
    if unknown:
        p.error(f"unknown modes {unknown}: choose from {', '.join(ENGINE_MODES)}")
    if args.tiny:
        for k, v in dict(batches="1,4", contexts="48,160", prefill="64,256", det_batches="1,4", det_contexts="48",
                         det_prefill="64", steps=3, chunk=128, block_size=16, prefill_reps=1, row_cap_s=10.0).items():
            if p.get_default(k) == getattr(args, k):
                setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        ceilings, merged = merge_results([json.loads(Path(f).read_text()) for f in args.merge])
        if ceilings:
            print(ceiling_lines(ceilings))
        print(table(merged))
        return 0
    device = torch.device(args.device)
    args.dtype_t = torch.bfloat16 if device.type == "cuda" else torch.float32
    deadline = Deadline(args.time_budget_s)
    t_start = time.monotonic()
    torch.manual_seed(args.seed)
    env = environment(device)
    print(json.dumps(env))
    args.ceilings = measure_ceilings(device, args.dtype_t, args.tiny)
    free_memory()
    print(ceiling_lines(args.ceilings), flush=True)
    if args.kv_gb is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            args.kv_gb = 0.75 * free / GiB
        else:
            args.kv_gb = 1.0
    modes = [m for m in args.modes.split(",") if m]
    rows: list[dict[str, Any]] = []
    hf_rows: list[dict[str, Any]] = []  # transformers' results by workload, kept also without engine rows
    elem_bytes = torch.empty((), dtype=args.dtype_t).element_size()
    with tempfile.TemporaryDirectory(prefix="bench-models-") as scratch:
        for name in [m for m in args.models.split(",") if m]:
            folder = model_folder(name, args, Path(scratch))
            hf_config = load_hf_config(folder)
            # FP8 weights: --quantization fp8, or a config with a quantization_config (dummy weights as the release ships them)
            args.fp8_weights = args.quantization == "fp8" or bool(getattr(hf_config, "quantization_config", None))
            args.model_name = Path(name).name + ("-fp8" if args.quantization else "")
            arch = arch_from_hf(hf_config)
            facts = ModelFacts(arch, elem_bytes, 1 + 4 / 128**2 if args.fp8_weights else None)
            moe = (f", MoE: {facts.num_experts} experts, top {arch.moe.num_experts_per_tok if arch.moe else 0}, {len(arch.sparse_layers)} sparse layers, "
                   f"{facts.active_linear_params / 1e6:,.1f} M active" if arch.sparse_layers else "")
            print(f"\n== {args.model_name}: {facts.linear_params / 1e6:,.1f} M linear params{moe}, "
                  f"{facts.step_weight_bytes() / 2**20:,.1f} MiB read per batch-1 decode step before KV, "
                  f"{len(arch.full_layers)} full + {len(arch.sliding_layers)} sliding layers", flush=True)
            model_rows: list[dict[str, Any]] = []
            for mode in modes:
                is_det = ENGINE_MODES[mode][0]
                grid = {
                    "batches": parse_ints(args.det_batches if is_det else args.batches),
                    "contexts": parse_ints(args.det_contexts if is_det else args.contexts),
                    "prefill": parse_ints(args.det_prefill if is_det else args.prefill),
                }
                if deadline.left_s() < 20:
                    print(f"  {mode}: skipped (time budget)")
                    continue
                try:
                    model_rows += run_engine_mode(folder, facts, mode, grid, args, deadline)
                except Exception as e:  # the engine could not even be built: say so, go on
                    traceback.print_exc()
                    model_rows.append({"model": args.model_name, "mode": mode, "kind": "prefill", "tokens": 0,
                                       "status": f"error: {type(e).__name__}", "error": str(e)[:500]})
                    free_memory()
            if args.hf and not args.fp8_weights:  # transformers has no dummy FP8 weights to load
                hf_grid = {"batches": parse_ints(args.batches), "contexts": parse_ints(args.contexts),
                           "prefill": parse_ints(args.prefill)}
                hf = run_hf(folder, facts, hf_grid, args, deadline)
                attach_hf(model_rows, hf)
                hf_rows += [{"model": args.model_name, "key": list(k), "result": v} for k, v in hf.items()]
            rows += model_rows
            save(args, env, rows, hf_rows)  # after each model: a run cut short still leaves its numbers
    print(f"\nran {time.monotonic() - t_start:.0f} s on {env.get('gpu', env['device'])}, torch {env['torch']}, "
          f"transformers {env['transformers']}; engine modes {','.join(modes)}; transformers once per model "
          f"(static cache, SDPA; (c) = torch.compile'd)")
    print(ceiling_lines(args.ceilings))
    print(table(rows))
    print(f"wrote {save(args, env, rows, hf_rows)}")
    return 0


def save(args: argparse.Namespace, env: dict[str, Any], rows: list[dict[str, Any]], hf_rows: list[dict[str, Any]]) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.tag}" if args.tag else ""
    saved_args = {k: v for k, v in vars(args).items() if k not in ("dtype_t", "ceilings", "model_name")}
    result = {"env": env, "ceilings": args.ceilings, "args": saved_args, "rows": rows, "hf": hf_rows}
    path = out / f"engine_speed{suffix}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    (out / f"engine_speed{suffix}.txt").write_text(ceiling_lines(args.ceilings) + "\n" + table(rows) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
