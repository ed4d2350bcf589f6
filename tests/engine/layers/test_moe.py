"""Qwen3-MoE: the grouped expert MLP (engine/layers/moe.py) against a per-token reference, and the engine against
transformers' Qwen3MoeForCausalLM on tiny random checkpoints written by save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.errors import InvalidRequestError
from engine.layers.moe import SparseMoE, can_use_grouped_mm, grouped_linear
from engine.layers.numerics import Numerics
from engine.models.loader import build_model
from engine.models.registry import arch_from_hf, load_hf_config
from engine.request import SamplingParams
from tests.engine_utils import (
    compare_greedy,
    decode_logits,
    hf_greedy,
    prompt_logits,
    random_prompts,
    small_engine,
)
from tests.tiny_models import COMMON

NEW_TOKENS = 64
HIDDEN, EXPERT_WIDTH, NUM_EXPERTS = 64, 32, 8

# name -> Qwen3MoeConfig fields over tests/tiny_models.py's COMMON, and the sparse layers they give
MOE_FAMILIES: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    # Qwen3-30B-A3B's routing (renormalized top-k, every layer sparse) with layer 1 dense
    "qwen3_moe": (
        dict(head_dim=16, num_experts=NUM_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=EXPERT_WIDTH,
             norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, rope_theta=10000.0),
        (0, 2, 3),
    ),
    # every second layer sparse, top-3 without renormalization
    "qwen3_moe_step2": (
        dict(head_dim=16, num_experts=NUM_EXPERTS, num_experts_per_tok=3, moe_intermediate_size=EXPERT_WIDTH,
             norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2, rope_theta=10000.0),
        (1, 3),
    ),
}


def make_tiny_moe(name: str, folder: Path, seed: int = 0) -> Path:
    """A random tiny Qwen3-MoE saved with transformers' save_pretrained (float32), wide init as in
    tests/tiny_models.py so greedy steps and expert choices have clear winners."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", **{**COMMON, **MOE_FAMILIES[name][0]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.25 if p.dim() > 1 else 0.1)
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_tiny_moe(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.fixture(scope="module")
def hf_reference(moe_dir):
    """name -> (prompt, transformers' greedy tokens, their logits, the prompt's last logits), made once."""
    made: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in made:
            gen = torch.Generator().manual_seed(1)
            prompt = torch.randint(3, 512, (90,), generator=gen).tolist()
            made[name] = (prompt, *hf_greedy(moe_dir(name), prompt, NEW_TOKENS))
        return made[name]

    return get


# ---- the engine against transformers ----------------------------------------------------------


def test_checkpoint_names_and_arch(moe_dir) -> None:
    """save_pretrained writes one tensor per expert and projection (the original Hugging Face naming);
    the arch lists the sparse layers as transformers picks them."""
    folder = moe_dir("qwen3_moe")
    names = set(load_file(folder / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
    for name, (_, sparse) in MOE_FAMILIES.items():
        arch = arch_from_hf(load_hf_config(moe_dir(name)))
        assert arch.sparse_layers == sparse and arch.moe.num_experts == NUM_EXPERTS and arch.qk_norm
        assert arch.moe.moe_intermediate_size == EXPERT_WIDTH


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
@pytest.mark.parametrize("is_deterministic", [False, True], ids=["default", "deterministic"])
def test_greedy_matches_transformers(moe_dir, hf_reference, name: str, is_deterministic: bool) -> None:
    prompt, ref_tokens, ref_logits, ref_first = hf_reference(name)
    eng = small_engine(moe_dir(name), is_deterministic=is_deterministic, max_num_batched_tokens=40)  # 3 chunks
    (first,) = prompt_logits(eng, [prompt])
    torch.testing.assert_close(first, ref_first, rtol=1e-4, atol=1e-4)
    (seq,) = eng.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    note = compare_greedy(seq.output_token_ids, ref_tokens, ref_logits, tie_gap=1e-3)
    if note:
        print(f"{name}: {note}")
    eng.check_idle()


def test_deterministic_logits_batch_and_chunk_invariant(moe_dir) -> None:
    """Deterministic mode: a prompt's logits are bit-identical alone, in a batch, and chunked, though
    its tokens share each expert's matmul with different tokens each time."""
    eng = small_engine(moe_dir("qwen3_moe"), is_deterministic=True)
    assert eng.numerics is not Numerics.DEFAULT
    gen = torch.Generator().manual_seed(3)
    target, *others = (torch.randint(3, 512, (n,), generator=gen).tolist() for n in (77, 5, 130, 33))
    (alone,) = prompt_logits(eng, [target])
    batched = prompt_logits(eng, [others[0], target, others[1], others[2]])[1]
    chunked = prompt_logits(eng, [others[1], target], chunks=[[50, 80], [13, 40, 24]])[1]
    for other in (batched, chunked):
        assert torch.equal(alone, other), (alone - other).abs().max()
    eng.check_idle()


def test_stacked_checkpoint_loads_like_per_expert(moe_dir, tmp_path: Path) -> None:
    """A checkpoint with transformers 5's in-memory names (experts stacked in gate_up_proj / down_proj)
    loads to the same weights as save_pretrained's per-expert one."""
    from transformers import AutoModelForCausalLM

    folder = moe_dir("qwen3_moe")
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    hf = load_hf_config(folder)
    arch = arch_from_hf(hf)
    cpu = torch.device("cpu")
    per_expert = build_model(arch, hf, folder, torch.float32, cpu, 64).state_dict()
    stacked = build_model(arch, hf, tmp_path, torch.float32, cpu, 64).state_dict()
    assert per_expert.keys() == stacked.keys()
    for k in per_expert:
        assert torch.equal(per_expert[k], stacked[k]), k
    experts = per_expert["model.layers.0.mlp.experts.gate_up_proj"]
    gate_3 = load_file(folder / "model.safetensors")["model.layers.0.mlp.experts.3.gate_proj.weight"]
    assert torch.equal(experts[3, :EXPERT_WIDTH], gate_3)  # gate rows first, then up


def test_missing_expert_and_quantized_config_are_refused(moe_dir, tmp_path: Path) -> None:
    folder = moe_dir("qwen3_moe")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = load_hf_config(tmp_path)
    with pytest.raises(KeyError, match="layers.2.mlp.experts.gate_up_proj"):
        build_model(arch_from_hf(hf), hf, tmp_path, torch.float32, torch.device("cpu"), 64)

    config["quantization_config"] = {"quant_method": "awq", "bits": 4}  # FP8 loads: tests/engine/layers/test_fp8.py
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="quant_method 'awq'"):
        arch_from_hf(load_hf_config(tmp_path))


def test_dummy_weights_generate(moe_dir) -> None:
    eng = small_engine(moe_dir("qwen3_moe_step2"), load_format="dummy")
    experts = eng.model.state_dict()["model.layers.1.mlp.experts.down_proj"]
    assert experts.shape == (NUM_EXPERTS, HIDDEN, EXPERT_WIDTH) and experts.std() > 0.01
    (seq,) = eng.generate([list(range(3, 40))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(seq.output_token_ids) == 8
    eng.check_idle()


# ---- the MoE layer alone ---------------------------------------------------------------------------


def _moe(top_k: int, norm_topk_prob: bool, seed: int = 0) -> SparseMoE:
    moe = SparseMoE(HIDDEN, EXPERT_WIDTH, NUM_EXPERTS, top_k, norm_topk_prob, F.silu)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
    return moe.requires_grad_(False)


def per_token_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, one chosen expert at a time, in float64."""
    gate_up, down = moe.experts.gate_up_proj.double(), moe.experts.down_proj.double()
    router = moe.gate.weight.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, row in enumerate(x.double()):
        weights, experts = torch.softmax(router @ row, dim=-1).topk(moe.top_k)
        if moe.norm_topk_prob:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts):
            gate, up = (gate_up[e] @ row).chunk(2)
            out[t] += w * (down[e] @ (F.silu(gate) * up))
    return out.float()


def _experts_hit(moe: SparseMoE, x: torch.Tensor) -> set[int]:
    return set(moe.route(moe.router_logits(x))[1].flatten().tolist())


@pytest.mark.parametrize("numerics", [Numerics.DEFAULT, Numerics.TILED, Numerics.PADDED], ids=lambda n: n.value)
@pytest.mark.parametrize("top_k,norm_topk_prob", [(2, True), (3, False), (1, False)])
def test_grouped_moe_matches_per_token_reference(top_k: int, norm_topk_prob: bool, numerics: Numerics) -> None:
    moe = _moe(top_k, norm_topk_prob)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x, numerics), per_token_reference(moe, x), rtol=1e-4, atol=1e-5)
    one = x[:1]  # one token: all but top_k experts idle
    torch.testing.assert_close(moe(one, numerics), per_token_reference(moe, one), rtol=1e-4, atol=1e-5)


def test_experts_without_tokens() -> None:
    """Experts 5-7 never win (negative router rows, positive tokens): their slices are empty."""
    moe = _moe(2, True)
    with torch.no_grad():
        moe.gate.weight[5:] = -moe.gate.weight[5:].abs()
        moe.gate.weight[:5] = moe.gate.weight[:5].abs()
    x = torch.rand(24, HIDDEN, generator=torch.Generator().manual_seed(2))
    assert _experts_hit(moe, x) <= {0, 1, 2, 3, 4}
    ref = per_token_reference(moe, x)
    for numerics in (Numerics.DEFAULT, Numerics.TILED):
        torch.testing.assert_close(moe(x, numerics), ref, rtol=1e-4, atol=1e-5)


def test_token_result_independent_of_batch() -> None:
    """A token's output in batches of other tokens: within float rounding by default, bit for bit under
    the tiled (deterministic) numerics."""
    moe = _moe(2, True)
    x = torch.randn(53, HIDDEN, generator=torch.Generator().manual_seed(4))
    for numerics in (Numerics.DEFAULT, Numerics.TILED):
        full = moe(x, numerics)
        for rows in ([7], [0, 30, 52], list(range(10, 45))):
            part = moe(x[rows], numerics)
            if numerics is Numerics.DEFAULT:
                torch.testing.assert_close(part, full[rows], rtol=1e-4, atol=1e-5)
            else:
                assert torch.equal(part, full[rows]), numerics


def test_local_expert_ranges_sum_to_the_full_output() -> None:
    """forward over a partition of the experts (expert parallelism's split, without communication):
    each share leaves the other experts out, and the shares add up to the whole."""
    moe = _moe(3, False)
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(5))
    full = moe(x)
    for parts in ([(0, 2), (2, 2), (4, 2), (6, 2)], [(0, 3), (3, 5)], [(0, 8)]):
        for numerics in (Numerics.DEFAULT, Numerics.TILED):
            total = sum(moe(x, numerics, first, n) for first, n in parts)
            torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)
    # a range no token chose contributes zeros
    idle = sorted(set(range(NUM_EXPERTS)) - _experts_hit(moe, x[:1]))
    assert torch.equal(moe(x[:1], Numerics.DEFAULT, idle[0], 1), torch.zeros(1, HIDDEN))
    with pytest.raises(ValueError):
        moe(x, Numerics.DEFAULT, 6, 3)


@pytest.mark.parametrize("width", [32, 6], ids=["aligned", "unaligned"])
def test_grouped_linear(width: int) -> None:
    """torch's grouped matmul where it runs (16-byte aligned rows), else the per-group loop; groups may be
    empty; either way each row meets its own group's weight."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(5, 24, width, generator=gen)
    counts = [3, 0, 4, 0, 2]
    x = torch.randn(sum(counts), width, generator=gen)
    ends = torch.tensor(counts).cumsum(0)
    expected = torch.cat([x[e - c : e] @ weight[g].T for g, (c, e) in enumerate(zip(counts, ends.tolist()))])
    if width == 32 and (hasattr(torch, "_grouped_mm") or hasattr(F, "grouped_mm")) and torch.__version__ >= "2.9":
        assert can_use_grouped_mm(x, weight)
    assert width == 32 or not can_use_grouped_mm(x, weight)
    for numerics in (Numerics.DEFAULT, Numerics.TILED):
        torch.testing.assert_close(grouped_linear(x, weight, ends, numerics), expected, rtol=1e-5, atol=1e-6)


# ---- CUDA (skipped without a GPU) --------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda_engine(folder: Path, **kw):
    return small_engine(folder, device="cuda", hicache_gb=0.1, max_num_seqs=8, **kw)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("chained", [True, False], ids=["chained", "layerwise"])
def test_cuda_engine_matches_cpu(moe_dir, dtype: str, chained: bool) -> None:
    """The CUDA forward (fused projections, Triton norms, the experts through pdkernels/moe_gemm.py)
    against the CPU engine in float32: prefill logits within float32 tolerance (bf16: on average within a
    tenth of the logits' spread); decode steps replayed from graphs equal to eager ones (the Triton
    path has no host sync, so graphs capture it in every dtype)."""
    from engine.config import ForwardConfig

    pytest.importorskip("triton")
    folder = moe_dir("qwen3_moe")
    prompts = random_prompts([5, 30, 47], seed=1)
    cpu = prompt_logits(small_engine(folder), prompts, chunks=[[5], [17, 13], [47]])
    forward = ForwardConfig(chain_residuals=chained)
    eager = _cuda_engine(folder, dtype=dtype, enforce_eager=True, forward=forward)
    cuda = prompt_logits(eager, prompts, chunks=[[5], [17, 13], [47]])
    for a, b in zip(cuda, cpu):
        if dtype == "float32":
            torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)
        else:  # bf16 router logits flip near-tied expert choices (these prompts have top-2/3 gaps of 1e-3)
            assert (a.float().cpu() - b).abs().mean() < 0.1 * b.std()
    graphs = _cuda_engine(folder, dtype=dtype, forward=forward)  # the Triton path: no host sync
    assert graphs.graph_stats is not None
    eager_steps, graph_steps = decode_logits(eager, prompts, 16), decode_logits(graphs, prompts, 16)
    for rid, steps in eager_steps.items():
        assert len(steps) == len(graph_steps[rid]) == 16
        for a, b in zip(steps, graph_steps[rid]):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
@needs_cuda
def test_cuda_deterministic_is_batch_invariant(moe_dir) -> None:
    """BATCH_INVARIANT on CUDA: the experts through the Triton path's batch-invariant variant (its tiles
    a function of (N, K) only), eager and from CUDA graphs."""
    from engine.layers.numerics import batch_invariant_available

    if not batch_invariant_available(torch.device("cuda")):
        pytest.skip("needs triton")
    folder = moe_dir("qwen3_moe")
    assert _cuda_engine(folder, is_deterministic=True).graph_stats is not None  # graphs capture it
    eng = _cuda_engine(folder, is_deterministic=True, enforce_eager=True, max_num_batched_tokens=48)
    assert eng.numerics is Numerics.BATCH_INVARIANT
    target, *others = random_prompts([61, 9, 100, 40], seed=5)
    (alone,) = prompt_logits(eng, [target])
    batched = prompt_logits(eng, [others[0], target, others[1]])[1]
    assert torch.equal(alone, batched), (alone - batched).abs().max()
    alone_steps = decode_logits(eng, [target], 8)["r0"]
    batched_steps = decode_logits(eng, [others[0], others[1], target, others[2]], 8)["r2"]
    for a, b in zip(alone_steps, batched_steps):
        assert torch.equal(a, b), (a - b).abs().max()

