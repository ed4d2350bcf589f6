"""DeepSeek-V3: the engine against transformers' DeepseekV3ForCausalLM on tiny random checkpoints written by
save_pretrained (tests/tiny_models.py MOE_FAMILIES: "deepseek_v3" with a q LoRA, group-limited routing, a
dense first layer and YaRN; "deepseek_v3_plain_q" with a plain q_proj, one expert group, two dense layers
and rotary halves), a 90-token prompt in 40-token chunks; multi-head latent attention's two paths (latent
expanded per head, or up-projections absorbed) against transformers and each other; the router against
transformers' DeepseekV3TopkRouter; the checkpoint's next-token-prediction layers skipped at load; FP8
checkpoints refused; and the latent pages' bytes per token."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.kv_cache import layout_of
from engine.errors import InvalidRequestError
from engine.layers.mla import LatentAttention
from engine.layers.moe import ScoreGate, route_group_topk
from engine.layers.norm import RMSNorm
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

NEW_TOKENS = 64
NAMES = ["deepseek_v3", "deepseek_v3_plain_q"]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """name -> (prompt, transformers' greedy tokens, their logits, the prompt's last logits), made once."""
    made: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in made:
            prompt = random_prompts([90], seed=1)[0]  # > two 40-token chunks, 6 pages of 16
            made[name] = (prompt, *hf_greedy(tiny_model_dir(name), prompt, NEW_TOKENS))
        return made[name]

    return get


def _attn(eng) -> LatentAttention:  # type: ignore[no-untyped-def]
    attn = eng.model.model.layers[0].self_attn
    assert isinstance(attn, LatentAttention)
    return attn


# ---- the checkpoint and the engine against transformers ------------------------------------------


def test_arch_layout_and_float32_router(tiny_model_dir) -> None:
    """Every config field lands in the arch; the KV layout is one latent per token; the router stays in
    float32 in a bf16 model (as transformers keeps it)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    folder = tiny_model_dir("deepseek_v3")
    hf = load_hf_config(folder)
    arch = arch_from_hf(hf)
    assert arch.is_mla and (arch.mla.q_lora_rank, arch.mla.kv_lora_rank) == (24, 32)
    assert (arch.mla.qk_nope_head_dim, arch.mla.qk_rope_head_dim, arch.mla.v_head_dim, arch.head_dim) == (16, 8, 16, 8)
    assert arch.mla.rope_interleave and arch.num_nextn_predict_layers == 1
    assert arch.sparse_layers == (1, 2, 3) and arch.moe.routing == "sigmoid_group_topk"
    assert (arch.moe.num_experts, arch.moe.num_experts_per_tok, arch.moe.num_expert_groups, arch.moe.topk_groups) == (8, 2, 4, 2)
    assert arch.moe.norm_topk_prob and arch.moe.routed_scaling_factor == 2.5 and arch.moe.shared_intermediate_size == 32
    # YaRN's mscale_all_dim in the softmax scale, as transformers' attention computes it
    assert arch.attn_scale == pytest.approx(DeepseekV3Attention(hf, 0).scaling, rel=1e-12)
    assert arch.attn_scale > 1.2 * 24**-0.5
    plain = arch_from_hf(load_hf_config(tiny_model_dir("deepseek_v3_plain_q")))
    assert plain.mla.q_lora_rank == 0 and not plain.mla.rope_interleave and plain.sparse_layers == (2, 3)
    assert (plain.moe.num_expert_groups, plain.moe.num_experts_per_tok, plain.moe.shared_intermediate_size) == (1, 3, 32)
    assert plain.attn_scale == 24**-0.5

    lo = layout_of(arch, 16, torch.float32)
    assert (lo.page_kind, lo.num_kv_heads, lo.head_dim, lo.num_full_layers, lo.has_state) == ("latent", 1, 40, 4, False)

    model = build_model(arch, hf, folder, torch.bfloat16, torch.device("cpu"), 64)
    gate = model.model.layers[1].mlp.gate
    assert isinstance(gate, ScoreGate) and gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    ckpt = load_file(folder / "model.safetensors")
    assert torch.equal(gate.e_score_correction_bias, ckpt["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert gate.e_score_correction_bias.abs().max() > 0.05  # the tiny checkpoint's bias moves choices
    assert model.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("is_deterministic", [False, True], ids=["default", "deterministic"])
def test_greedy_matches_transformers(tiny_model_dir, reference, name: str, is_deterministic: bool) -> None:
    prompt, ref_tokens, ref_logits, ref_first = reference(name)
    eng = small_engine(tiny_model_dir(name), is_deterministic=is_deterministic, max_num_batched_tokens=40)
    (first,) = prompt_logits(eng, [prompt])
    torch.testing.assert_close(first, ref_first, rtol=1e-4, atol=1e-4)
    (seq,) = eng.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    note = compare_greedy(seq.output_token_ids, ref_tokens, ref_logits, tie_gap=1e-3)
    if note:
        print(f"{name}: {note}")
    eng.check_idle()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("is_deterministic", [False, True], ids=["default", "deterministic"])
def test_cuda_decode_matches_transformers(tiny_model_dir, reference, name: str, is_deterministic: bool,
                                          graphs: bool) -> None:
    """float32 on CUDA: the prompt in 40-token chunks, then 64 decode rows through the paged latent kernel
    (pdkernels/mla_decode.py), replayed from CUDA graphs or eager: every step's logits within 1e-4 of
    transformers' (on the CPU), the greedy tokens identical."""
    prompt, ref_tokens, ref_logits, _ = reference(name)
    eng = small_engine(tiny_model_dir(name), device="cuda", dtype="float32", is_deterministic=is_deterministic,
                       max_num_batched_tokens=40, max_num_seqs=4, hicache_gb=0.1, enforce_eager=not graphs)
    assert (eng.graph_stats is not None) == graphs and eng.runner.decode_inputs is not None
    rows = decode_logits(eng, [prompt], NEW_TOKENS)["r0"]
    tokens = [int(x.argmax()) for x in rows]
    note = compare_greedy(tokens, ref_tokens, ref_logits, tie_gap=1e-3)
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
    for ours, ref in zip(rows[: same + 1], ref_logits):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    if note:
        print(f"{name}: {note}")


def test_expanded_and_absorbed_chunks_match_transformers(tiny_model_dir) -> None:
    """Default mode: long chunks expand the latents per head, short ones (and decode rows) attend in latent
    space; prompts batched in chunks of both kinds give transformers' last logits."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("deepseek_v3")
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = random_prompts([47, 45, 60], seed=2)
    with torch.no_grad():
        refs = [hf_model(torch.tensor([p])).logits[0, -1] for p in prompts]
    eng = small_engine(folder)
    attn = _attn(eng)
    # the tiny shape's rule: fewer than 32 queries absorbed (32 * (2 * 32 + 8 - 40) = 32 * 32)
    assert attn.absorbs(31, Numerics.DEFAULT) and not attn.absorbs(32, Numerics.DEFAULT)
    plans = [[47], [8, 37], [31, 1, 28]]  # expanded; absorbed then expanded; absorbed, a one-token chunk, ...
    for a, b in zip(prompt_logits(eng, prompts, chunks=plans), refs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    eng.check_idle()


def test_absorb_rule_at_deepseek_v3_shape() -> None:
    """DeepSeek-V3's shape (R 512, nope 128, rope 64, values 128): chunks under 171 queries read only the
    latent in default mode; deterministic mode always does."""
    from transformers import DeepseekV3Config

    arch = arch_from_hf(DeepseekV3Config())
    with torch.device("meta"):
        attn = LatentAttention(arch, lambda width: RMSNorm(width, arch.rms_norm_eps, False))
    assert attn.absorbs(1, Numerics.DEFAULT) and attn.absorbs(170, Numerics.DEFAULT)
    assert not attn.absorbs(171, Numerics.DEFAULT) and not attn.absorbs(8192, Numerics.DEFAULT)
    assert attn.absorbs(8192, Numerics.TILED) and attn.absorbs(8192, Numerics.BATCH_INVARIANT)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_logits_batch_and_chunk_invariant(tiny_model_dir, name: str) -> None:
    """Deterministic mode: a prompt's logits are bit-identical alone, in a batch, and however chunked (every
    chunk attends in latent space, whatever its size), and so are its decode steps (the router's sigmoid
    once made them differ in the last bit with the batch's size)."""
    eng = small_engine(tiny_model_dir(name), is_deterministic=True)
    assert eng.numerics is not Numerics.DEFAULT
    target, *others = random_prompts([77, 5, 130, 33], seed=3)
    (alone,) = prompt_logits(eng, [target])
    batched = prompt_logits(eng, [others[0], target, others[1], others[2]])[1]
    chunked = prompt_logits(eng, [others[1], target], chunks=[[50, 80], [13, 40, 1, 23]])[1]
    for other in (batched, chunked):
        assert torch.equal(alone, other), (alone - other).abs().max()
    eng.check_idle()
    # decode steps alone and beside other sequences' prefill chunks and decode rows (fresh engines: no
    # prefix-cache hit; the capture wraps runner.run, which launch-ahead would call with fed ids)
    kw = dict(is_deterministic=True, hicache_gb=0, launch_ahead=False)
    alone_steps = decode_logits(small_engine(tiny_model_dir(name), **kw), [target], 8)["r0"]
    batched_steps = decode_logits(small_engine(tiny_model_dir(name), **kw), [others[0], others[1], target, others[2]], 8)
    for i, (a, b) in enumerate(zip(alone_steps, batched_steps["r2"], strict=True)):
        assert torch.equal(a, b), (i, (a - b).abs().max())


# ---- the router -------------------------------------------------------------------------------------


def test_router_matches_transformers() -> None:
    """route_group_topk against DeepseekV3TopkRouter: the same experts and weights; the group limit
    and the correction bias each change some tokens' choices (so the test sees either go missing)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              norm_topk_prob=True, routed_scaling_factor=2.5)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    router = DeepseekV3TopkRouter(config).eval()
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen) * 0.3)
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.1)
    x = torch.randn(200, 32, generator=gen)
    logits, want_weights, want_experts = router(x)
    bias = router.e_score_correction_bias
    weights, experts = route_group_topk(logits.sigmoid(), 4, True, bias, 4, 2, 2.5)
    order, want_order = experts.sort(dim=1), want_experts.sort(dim=1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices))
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(1), torch.full((200,), 2.5))  # renormalized, then scaled

    def chosen(score_bias: torch.Tensor, topk_groups: int) -> torch.Tensor:
        return route_group_topk(logits.sigmoid(), 4, True, score_bias, 4, topk_groups, 2.5)[1].sort(dim=1).values

    assert not torch.equal(chosen(bias, 4), order.values)  # no group limit
    assert not torch.equal(chosen(torch.zeros(16), 2), order.values)  # no correction bias


# ---- loading ----------------------------------------------------------------------------------------


def _copy_checkpoint(src: Path, dst: Path, extra: dict[str, torch.Tensor], **config: object) -> Path:
    dst.mkdir(exist_ok=True)
    tensors = load_file(src / "model.safetensors") | extra
    save_file(tensors, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    if config:
        (dst / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | config))
    return dst


def test_nextn_layers_are_skipped_with_one_log_line(tiny_model_dir, tmp_path: Path, caplog) -> None:
    """A checkpoint's next-token-prediction layer (model.layers.4 of a 4-layer model with
    num_nextn_predict_layers 1, as DeepSeek-V3's model.layers.61) loads to the same model, with one log
    line; a layer past it is an error, and so is that layer when the config declares none."""
    folder = tiny_model_dir("deepseek_v3")
    ckpt = load_file(folder / "model.safetensors")
    nextn = {k.replace("model.layers.3.", "model.layers.4."): v for k, v in ckpt.items() if k.startswith("model.layers.3.")}
    nextn |= {
        "model.layers.4.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.4.enorm.weight": torch.ones(64),
        "model.layers.4.shared_head.norm.weight": torch.ones(64),
    }
    with_nextn = _copy_checkpoint(folder, tmp_path / "nextn", nextn)
    hf = load_hf_config(with_nextn)
    arch = arch_from_hf(hf)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="engine.models.loader"):
        state = build_model(arch, hf, with_nextn, torch.float32, cpu, 64).state_dict()
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.models.loader"]
    assert len(lines) == 1 and f"skipped {len(nextn)} tensors" in lines[0] and "model.layers.4" in lines[0], lines
    plain = build_model(arch, hf, folder, torch.float32, cpu, 64).state_dict()
    assert state.keys() == plain.keys() and all(torch.equal(state[k], plain[k]) for k in state)

    past = _copy_checkpoint(folder, tmp_path / "past", {"model.layers.5.enorm.weight": torch.ones(64)})
    with pytest.raises(KeyError, match="model.layers.5.enorm"):
        build_model(arch, load_hf_config(past), past, torch.float32, cpu, 64)
    undeclared = _copy_checkpoint(folder, tmp_path / "undeclared", nextn, num_nextn_predict_layers=0)
    hf0 = load_hf_config(undeclared)
    with pytest.raises(KeyError, match="model.layers.4"):
        build_model(arch_from_hf(hf0), hf0, undeclared, torch.float32, cpu, 64)


def test_legacy_rope_scaling_reads_as_rope_parameters(tiny_model_dir, tmp_path: Path) -> None:
    """DeepSeek-V3's config.json ships `rope_scaling` ({"type": "yarn", ...}) and `rope_theta`, not transformers
    5's `rope_parameters`: the same arch (softmax scale included) and rope tables."""
    from engine.models.hf_config import rope_inv_freq

    folder = tiny_model_dir("deepseek_v3")
    config = json.loads((folder / "config.json").read_text())
    params = config.pop("rope_parameters")
    legacy = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")} | {"type": "yarn"}
    old = _copy_checkpoint(folder, tmp_path / "legacy", {})
    (old / "config.json").write_text(json.dumps(config | {"rope_scaling": legacy, "rope_theta": params["rope_theta"]}))
    new_hf, old_hf = load_hf_config(folder), load_hf_config(old)
    assert "rope_parameters" not in json.loads((old / "config.json").read_text())
    assert arch_from_hf(old_hf) == arch_from_hf(new_hf)
    (inv_new, scale_new), (inv_old, scale_old) = (rope_inv_freq(h, "full_attention", 8) for h in (new_hf, old_hf))
    assert torch.equal(inv_new, inv_old) and scale_new == scale_old != 1.0


def test_fp8_release_config_is_accepted_a_static_one_refused(tiny_model_dir, tmp_path: Path) -> None:
    """DeepSeek-V3's release is FP8 (block-scaled e4m3, dynamic activations): its quantization_config is
    accepted with the architecture unchanged (tests/engine/layers/test_fp8.py loads such checkpoints); static
    activation scales are refused, the field named."""
    fp8 = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])
    folder = _copy_checkpoint(tiny_model_dir("deepseek_v3"), tmp_path / "fp8", {}, quantization_config=fp8)
    assert arch_from_hf(load_hf_config(folder)) == arch_from_hf(load_hf_config(tiny_model_dir("deepseek_v3")))
    static = _copy_checkpoint(tiny_model_dir("deepseek_v3"), tmp_path / "static", {},
                              quantization_config={**fp8, "activation_scheme": "static"})  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"quantization_config\.activation_scheme 'static'"):
        arch_from_hf(load_hf_config(static))


# ---- the latent pages' size -------------------------------------------------------------------------


def test_latent_page_bytes_per_token_and_layer() -> None:
    """A DeepSeek-V3 token keeps (512 + 64) x 2 = 1,152 bytes per layer in bf16 (the handoff, prefix cache
    and decode cache carry these pages), where a llama-8B token keeps K and V: 2 x 8 x 128 x 2 = 4,096."""
    from transformers import DeepseekV3Config, LlamaConfig

    ds = layout_of(arch_from_hf(DeepseekV3Config()), 128, torch.bfloat16)
    assert (ds.page_kind, ds.num_full_layers, ds.token_bytes) == ("latent", 61, 1152)
    assert ds.page_bytes == 61 * 128 * 1152 and ds.payload_bytes(1000) == 8 * ds.page_bytes
    llama8b = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8)  # fmt: skip
    lo = layout_of(arch_from_hf(llama8b), 128, torch.bfloat16)
    assert (lo.page_kind, lo.token_bytes, lo.page_bytes) == ("kv", 4096, 32 * 128 * 4096)


def test_exported_pages_are_latents(tiny_model_dir) -> None:
    """An export (what a handoff carries) holds each page's latents, (32 + 8) float32 values a token and
    layer, equal to what the model computes for those tokens."""
    eng = small_engine(tiny_model_dir("deepseek_v3"))
    prompt = random_prompts([37], seed=4)[0]
    eng.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0), prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    exp = eng.export_sequence("r")
    assert exp.pages.shape == (3, 4, 1, 16, 1, 40) and exp.state is None
    per_token_layer = exp.pages.numel() * exp.pages.element_size() / (3 * 16 * 4)
    assert per_token_layer == eng.layout.token_bytes == 40 * 4
    # layer 0's latent of token 5, recomputed: the pages hold latents, not per-head keys
    layer = eng.model.model.layers[0]
    x = eng.model.model.embed_tokens(torch.tensor(prompt[:6]))
    cos, sin = eng.model.rotary(torch.arange(6), "full_attention")
    with torch.no_grad():
        packed = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
    torch.testing.assert_close(exp.pages[0, 0, 0, 5, 0], packed[5, -40:])
    eng.finish_handoff("r")
    eng.check_idle()
