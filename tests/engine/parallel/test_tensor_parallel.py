"""Tensor parallelism on the CPU: a real group of two processes over gloo on loopback. This process is
rank 0 (it schedules and samples); the other rank is a spawned process that follows its plans
(engine/parallel/tensor_parallel.py). `--tp 2` against `--tp 1` on the same checkpoint: greedy tokens identical
and logits within 1e-4 (float32); in deterministic mode a sequence's logits bit-identical whatever
its batch and chunking.

The group lives for the module; the engines change inside it: rank 0 stops the running engine's
followers (close()), then broadcasts the next engine's config, which every rank builds."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.handoff import SequenceExport
from engine.layers.fp8 import Fp8Linear
from engine.parallel.tensor_parallel import (
    PLAN_STEP,
    PLAN_STOP,
    TensorGroup,
    TpShard,
    close_group,
    init_group,
)
from engine.request import SamplingParams
from tests.engine_utils import decode_logits, prompt_logits, random_prompts
from tests.tiny_models import make_tiny

SIZE = 2
BASE = dict(device="cpu", block_size=16, max_num_batched_tokens=64, kv_cache_gb=0.05, max_num_seqs=16, hicache_gb=0.0)


def _follower(rank: int, address: str) -> None:
    """A rank other than 0: builds each engine rank 0 announces and follows it, until rank 0 says stop.
    Exits as a server's rank does (os._exit, exit code 0 only after the stop): the interpreter's own
    teardown can meet a thread of torch's process group still joinable and abort the process."""
    torch.set_num_threads(1)
    code = 1
    try:
        tp = init_group(rank, SIZE, address, torch.device("cpu"))
        while True:
            kind, config = tp.receive_plan()
            if kind == PLAN_STOP:
                code = 0
                break
            LLMEngine(EngineConfig(**config), tp).follow()
    except BaseException:
        traceback.print_exc()
    finally:
        close_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Group:
    """Rank 0's side: one engine at a time on the group."""

    def __init__(self, tp: TensorGroup) -> None:
        self.tp = tp
        self.engine: LLMEngine | None = None
        self.key: dict[str, Any] | None = None

    def engine_for(self, folder: Path, **kw: Any) -> LLMEngine:
        config = {**BASE, "model": str(folder), **kw}
        if self.key == config and self.engine is not None:
            return self.engine
        self.stop_engine()
        self.tp.send_plan(PLAN_STEP, config)
        self.engine, self.key = LLMEngine(EngineConfig(**config), self.tp), config
        return self.engine

    def stop_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine = self.key = None


@pytest.fixture(scope="module")
def group() -> Iterator[Group]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [mp.get_context("spawn").Process(target=_follower, args=(r, address), daemon=True) for r in range(1, SIZE)]
    for p in procs:
        p.start()
    g = Group(init_group(0, SIZE, address, torch.device("cpu")))
    try:
        yield g
        g.stop_engine()
        g.tp.send_plan(PLAN_STOP)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        close_group()
        for p in procs:
            if p.is_alive():
                p.kill()


def _single(folder: Path, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**BASE, "model": str(folder), **kw}))


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One KV head (replicated at --tp 2); FP8 shapes that split at 128-block edges (heads 4 x 64 wide,
    4 KV heads, intermediate 512) for --quantization fp8."""
    return {
        "mqa": make_tiny("llama", tmp_path_factory.mktemp("mqa"), num_key_value_heads=1),
        "fp8": make_tiny("llama", tmp_path_factory.mktemp("fp8"), hidden_size=256, head_dim=64,
                         num_key_value_heads=4, intermediate_size=512),
    }  # fmt: skip


def _assert_tp_matches(
    ref: dict[str, list[torch.Tensor]], got: dict[str, list[torch.Tensor]], steps: int, rtol: float = 0.0
) -> None:
    for rid, rows in ref.items():
        assert len(got[rid]) == len(rows) == steps
        assert [int(r.argmax()) for r in got[rid]] == [int(r.argmax()) for r in rows]
        for a, b in zip(got[rid], rows):
            torch.testing.assert_close(a, b, rtol=rtol, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3_hybrid"])
def test_tp2_matches_tp1(group: Group, tiny_model_dir, family: str) -> None:
    """64 greedy tokens of three prompts at once identical, every step's logits within 1e-4; the group
    ends idle. 4 heads over 2 KV heads (split); qwen2: q/k/v biases; qwen3: q/k norms; gemma3: sliding
    layers, sandwich norms, tied (vocabulary-split) head."""
    folder = tiny_model_dir(family)
    prompts = random_prompts([37, 5, 70], seed=11)
    ref = decode_logits(_single(folder), prompts, 64)
    tp = group.engine_for(folder)
    assert tp.layout.num_kv_heads == 1 and tp.model.lm_head_weight.shape[0] == 256
    _assert_tp_matches(ref, decode_logits(tp, prompts, 64), 64)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_tp2_moe_matches_tp1(group: Group, tiny_model_dir, family: str) -> None:
    """MoE layers under --tp 2: every expert's intermediate rows split, the router replicated, one
    all-reduce after the block. qwen3_moe: per-expert checkpoint tensors, a dense layer between sparse
    ones; gpt-oss: stacked experts in its interleaved layout with biases (the down bias added by rank 0),
    attention sinks, o_proj bias, sliding layers; deepseek_v3: latent attention split by heads (the
    latent's projections replicated, every rank caching the same latents), its shared experts split like
    an MLP, grouped routing replicated. 32 greedy tokens identical, logits within 1e-4 (gpt-oss:
    1e-4 + 1e-4 |logit|, the bar of its transformers test: its logits reach 9, and at --tp 1 alone the
    deterministic numerics or another chunking move them by up to 1.6e-4)."""
    folder = tiny_model_dir(family)
    prompts = random_prompts([33, 8, 61], seed=13)
    ref = decode_logits(_single(folder), prompts, 32)
    tp = group.engine_for(folder)
    sparse = tp.model.sparse_layers()[0]
    assert sparse.experts.down_proj.shape[2] * 2 == _single(folder).model.sparse_layers()[0].experts.down_proj.shape[2]
    _assert_tp_matches(ref, decode_logits(tp, prompts, 32), 32, rtol=1e-4 if family == "gpt_oss" else 0.0)


@pytest.mark.parametrize("kind", ["mqa", "fp8"])
def test_tp2_replicated_kv_head_and_fp8(group: Group, odd_models: dict[str, Path], kind: str) -> None:
    """One KV head: both ranks hold it; FP8 weights quantized at load: each rank's blocks (and scales)
    are the whole model's. 32 greedy tokens identical, logits within 1e-4 (FP8: + 1e-4 x |logit|, as
    gpt-oss's: its dequantized weights' wider range puts a split sum's float32 noise at 1.0e-4 on a
    logit of 1.5, seen once in CI)."""
    kw = {"quantization": "fp8"} if kind == "fp8" else {}
    prompts = random_prompts([29, 50], seed=12)
    ref = decode_logits(_single(odd_models[kind], **kw), prompts, 32)
    tp = group.engine_for(odd_models[kind], **kw)
    assert tp.layout.num_kv_heads == (1 if kind == "mqa" else 2)
    q_proj = tp.model.model.layers[0].self_attn.q_proj  # type: ignore[union-attr]
    assert isinstance(q_proj, Fp8Linear) == (kind == "fp8")
    assert q_proj.out_features == (128 if kind == "fp8" else 32)  # 2 of 4 heads
    _assert_tp_matches(ref, decode_logits(tp, prompts, 32), 32, rtol=1e-4 if kind == "fp8" else 0.0)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_tp2_deterministic_batch_and_chunk_invariant(group: Group, tiny_model_dir, family: str) -> None:
    """Deterministic mode at --tp 2: a prompt's logits alone, in a batch, first in a batch and chunked
    are bit-identical; so are a request's decode steps alone and among others."""
    folder = tiny_model_dir(family)
    eng = group.engine_for(folder, is_deterministic=True)
    assert eng.numerics.is_deterministic
    target, *others = random_prompts([77, 5, 130, 33], seed=3)
    (alone,) = prompt_logits(eng, [target])
    for other in (
        prompt_logits(eng, [others[0], target, others[1], others[2]])[1],
        prompt_logits(eng, [target, others[2]])[0],
        prompt_logits(eng, [others[1], target], chunks=[[50, 80], [13, 40, 24]])[1],
    ):
        assert torch.equal(alone, other), (alone - other).abs().max()
    solo = decode_logits(eng, [target], 12)["r0"]
    batched = decode_logits(eng, [others[0], others[1], target], 12)["r2"]
    for a, b in zip(solo, batched):
        assert torch.equal(a, b), (a - b).abs().max()


def test_tp2_sampling_and_prompt_logprobs(group: Group, tiny_model_dir) -> None:
    """Seeded sampling and prompt logprobs (each span's logits gathered over the group) as --tp 1 gives."""
    folder = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5, prompt_logprobs=2, ignore_eos=True)
    prompts = random_prompts([40, 9], seed=4)
    ref = _single(folder).generate(prompts, params)
    got = group.engine_for(folder).generate(prompts, params)
    for a, b in zip(ref, got):
        assert a.output_token_ids == b.output_token_ids
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        ra, rb = a.prompt_logprobs.result(), b.prompt_logprobs.result()
        assert len(ra.logprobs) == len(rb.logprobs) == len(a.prompt_token_ids) - 1
        assert ra.ranks == rb.ranks and ra.top_ids == rb.top_ids
        torch.testing.assert_close(torch.tensor(ra.logprobs), torch.tensor(rb.logprobs), rtol=0, atol=1e-4)


def test_tp2_host_prefix_cache(group: Group, tiny_model_dir) -> None:
    """With the host prefix cache on (each process a pool of its own KV heads; rank 0's copies replayed
    by the other): a second turn that extends the first restores its cached pages (and the SWA state)
    and gives --tp 1's tokens and logits, as does the first prompt again beside it."""
    folder = tiny_model_dir("gemma3_hybrid")
    first = random_prompts([50], seed=21)[0]
    second = first + random_prompts([20], seed=22)[0]
    results = []
    for eng in (_single(folder, hicache_gb=0.01), group.engine_for(folder, hicache_gb=0.01)):
        turn1 = decode_logits(eng, [first], 8)
        turn2 = decode_logits(eng, [second, first], 8)
        assert eng.stats().cache_hit_tokens_total == 2 * 48  # turn 2: both prompts start with turn 1's 3 pages
        results.append((turn1, turn2))
    (ref1, ref2), (got1, got2) = results
    _assert_tp_matches(ref1, got1, 8)
    _assert_tp_matches(ref2, got2, 8)


def _prefill_and_export(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[SequenceExport]:
    """The PE's part of a handoff: each prompt prefilled (prefill_only), exported, handed off."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts):
        eng.add_request(rid, prompt, params, prefill_only=True)
    ready: set[str] = set()
    while len(ready) < len(rids):
        ready |= {o.request_id for o in eng.step() if o.is_handoff_ready}
    exports = [eng.export_sequence(rid) for rid in rids]
    for rid in rids:
        eng.finish_handoff(rid)
    eng.check_idle()
    return exports


def _import_and_decode(eng: LLMEngine, exports: list[SequenceExport]) -> list[list[int]]:
    """The CE's part: each export imported and decoded to its end; each request's output tokens."""
    tokens: dict[str, list[int]] = {exp.request_id: [] for exp in exports}  # the first token comes out here
    for exp in exports:
        eng.import_sequence(exp)
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id] += o.new_token_ids
    eng.check_idle()
    return [tokens[exp.request_id] for exp in exports]


def _computed(exp: SequenceExport) -> torch.Tensor:
    """exp's pages by position ([position, layers, planes, heads, dim]), the computed positions only: the
    slots past them in the last page hold whatever the pool's memory held."""
    p = exp.pages
    assert isinstance(p, torch.Tensor)
    by_position = p.permute(0, 3, 1, 2, 4, 5).reshape(-1, *p.shape[1:3], *p.shape[4:])
    return by_position[: exp.num_computed - exp.first_page * p.shape[3]]


@pytest.mark.parametrize("kind", ["gemma3_hybrid", "mqa", "deepseek_v3"])
def test_handoff_between_tp_sizes(group: Group, tiny_model_dir, odd_models: dict[str, Path], kind: str) -> None:
    """The P/D handoff's memory between --tp 2 and --tp 1 (engine/handoff/kv_shards.py): a --tp 2 export carries
    every KV head of the model in the --tp 1 layout, pages and SWA state within 1e-4 of a --tp 1 export
    (heads in order); imported into --tp 1, and a --tp 1 export imported into --tp 2, each decodes the
    tokens a --tp 1 engine generates. gemma3_hybrid: 2 KV heads split, sliding layers (prompts past the
    24-token window); mqa: one KV head, replicated on both ranks; deepseek_v3: latent pages, the same on
    both ranks (exported from rank 0, written to both)."""
    folder = odd_models["mqa"] if kind == "mqa" else tiny_model_dir(kind)
    prompts = random_prompts([45, 70], seed=31)
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)  # seeded: varied tokens
    single = _single(folder)
    want = [s.output_token_ids for s in single.generate(prompts, params)]
    assert len({t for w in want for t in w}) > 4
    tp = group.engine_for(folder)
    assert tp.handoff_layout == single.layout and tp.layout.num_kv_heads == 1
    from_tp = _prefill_and_export(tp, prompts, params, "tp2")
    from_single = _prefill_and_export(single, prompts, params, "tp1")
    for a, b in zip(from_tp, from_single):
        assert a.pages.shape == b.pages.shape == single.layout.page_shape(single.layout.num_pages(a.num_computed))
        torch.testing.assert_close(_computed(a), _computed(b), rtol=0, atol=1e-4)
        assert (a.state is None) == (b.state is None) == (kind != "gemma3_hybrid")  # sliding layers only
        if a.state is not None and b.state is not None:
            torch.testing.assert_close(a.state, b.state, rtol=0, atol=1e-4)
        assert a.output_token_ids == b.output_token_ids
    assert _import_and_decode(single, from_tp) == want
    assert _import_and_decode(tp, from_single) == want


def test_shard_slices_and_refusals(tmp_path: Path) -> None:
    """What each rank loads (KV heads split, then replicated past their count) and what is refused."""
    from engine.models.registry import arch_from_hf, load_hf_config

    arch = arch_from_hf(load_hf_config(make_tiny("qwen3", tmp_path / "q")))  # 4 heads, 2 KV heads, head_dim 32
    name = "model.layers.0.self_attn.k_proj.weight"
    kv2 = [TpShard(r, 2, arch).slice_of(name) for r in range(2)]
    assert [s.ranges for s in kv2 if s] == [((0, 32),), ((32, 64),)]
    kv4 = [TpShard(r, 4, arch).slice_of(name) for r in range(4)]  # KV heads replicated: ranks 0, 1 share head 0
    assert [s.ranges for s in kv4 if s] == [((0, 32),), ((0, 32),), ((32, 64),), ((32, 64),)]
    assert TpShard(1, 4, arch).local_arch.num_kv_heads == 1
    down = TpShard(1, 2, arch).slice_of("model.layers.3.mlp.down_proj.weight")
    assert down is not None and (down.dim, down.ranges) == (1, ((64, 128),))
    assert TpShard(1, 2, arch).slice_of("model.layers.0.input_layernorm.weight") is None
    with pytest.raises(InvalidRequestError, match="must divide the model's 4 attention heads"):
        TpShard(0, 3, arch)
    with pytest.raises(InvalidRequestError, match="FP8 block"):  # rows 32..64 of k_proj cut a 128-row block
        TpShard(1, 2, arch).check_fp8_blocks(name)
    moe = arch_from_hf(load_hf_config(make_tiny("qwen3_moe", tmp_path / "m")))  # 8 experts of 32 rows
    stacked = TpShard(1, 2, moe).slice_of("model.layers.0.mlp.experts.gate_up_proj")  # [E, 2I, H]: gate, then up
    assert stacked is not None and (stacked.dim, stacked.ranges, stacked.full) == (1, ((16, 32), (48, 64)), 64)
    oss = TpShard(1, 2, moe).slice_of("model.layers.0.mlp.experts.gate_up_proj", "interleaved")  # [E, H, 2I]
    assert oss is not None and (oss.dim, oss.ranges) == (2, ((32, 64),))
    per_expert = TpShard(1, 2, moe).slice_of("model.layers.0.mlp.experts.5.down_proj.weight")
    assert per_expert is not None and (per_expert.dim, per_expert.ranges) == (1, ((16, 32),))
    assert TpShard(1, 2, moe).is_zero_here("model.layers.0.mlp.experts.down_proj_bias")
    whole = TpShard(1, 2, moe, splits_experts=False)  # --ep (engine/parallel/world.py): experts held whole, each bias too
    assert whole.slice_of("model.layers.0.mlp.experts.gate_up_proj") is None
    assert whole.slice_of("model.layers.0.mlp.experts.5.down_proj.weight") is None
    assert whole.local_arch.moe.moe_intermediate_size == moe.moe.moe_intermediate_size == 32
    assert not whole.is_zero_here("model.layers.0.mlp.experts.down_proj_bias")
    assert whole.is_zero_here("model.layers.0.self_attn.o_proj.bias")
    mla = arch_from_hf(load_hf_config(make_tiny("deepseek_v3", tmp_path / "d")))
    dq, dkv, dv = mla.mla.qk_head_dim, mla.mla.qk_nope_head_dim + mla.mla.v_head_dim, mla.mla.v_head_dim
    half = mla.num_heads // 2
    q_b = TpShard(1, 2, mla).slice_of("model.layers.0.self_attn.q_b_proj.weight")
    kv_b = TpShard(1, 2, mla).slice_of("model.layers.0.self_attn.kv_b_proj.weight")
    o = TpShard(1, 2, mla).slice_of("model.layers.0.self_attn.o_proj.weight")
    assert q_b is not None and (q_b.dim, q_b.ranges) == (0, ((half * dq, 2 * half * dq),))
    assert kv_b is not None and (kv_b.dim, kv_b.ranges) == (0, ((half * dkv, 2 * half * dkv),))
    assert o is not None and (o.dim, o.ranges) == (1, ((half * dv, 2 * half * dv),))
    for replicated in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "q_a_proj.weight"):
        assert TpShard(1, 2, mla).slice_of(f"model.layers.0.self_attn.{replicated}") is None
    shared = TpShard(1, 2, mla).slice_of("model.layers.1.mlp.shared_experts.down_proj.weight")
    s_full = mla.moe.shared_intermediate_size
    assert shared is not None and (shared.dim, shared.ranges) == (1, ((s_full // 2, s_full),))
    with pytest.raises(InvalidRequestError, match="attention heads"):
        TpShard(0, 3, mla)
