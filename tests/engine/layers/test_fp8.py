"""FP8 weights (engine/layers/fp8.py): block-scaled FP8 checkpoints as the releases ship them load as FP8 and give
transformers' tokens and logits on the same checkpoint; `--quantization fp8` gives what the pre-quantized
checkpoint gives; everything else in a quantization_config is refused, naming the field.

The checkpoints are tiny random models saved by transformers' save_pretrained, then rewritten as FP8
releases by tests/tiny_models.py's own block quantizer (a loop over 128x128 blocks, independent of the
engine's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.layers import fp8
from engine.models.loader import fp8_candidates
from engine.models.registry import arch_from_hf, load_hf_config
from engine.request import SamplingParams
from tests.engine_utils import compare_greedy, hf_greedy, prompt_logits, random_prompts, small_engine
from tests.tiny_models import (
    COMMON,
    FP8_FAMILIES,
    _save_random,
    dequantize_reference,
    make_tiny_fp8,
    quantize_reference,
    to_fp8_checkpoint,
)

NEW_TOKENS = 64
GOLDEN_FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "gemma3")
# kept in their float dtype by the qwen3_moe checkpoint's modules_to_not_convert (besides lm_head, routers)
KEEP_FLOAT = ("model.layers.0.self_attn.o_proj", "model.layers.2.mlp.experts")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            keep = KEEP_FLOAT if family == "qwen3_moe" else ()
            made[family] = make_tiny_fp8(family, tmp_path_factory.mktemp(f"fp8-{family}"), keep_float=keep)
        return made[family]

    return get


@pytest.fixture(scope="module")
def hf_fp8_reference(fp8_dir):
    """family -> (prompt, transformers' greedy tokens, their logits, the prompt's last logits), transformers
    loading the FP8 checkpoint itself (its fine-grained FP8 loader dequantizes it on a machine without a GPU)."""
    made: dict[str, tuple] = {}

    def get(family: str) -> tuple:
        if family not in made:
            (prompt,) = random_prompts([90], seed=1)
            made[family] = (prompt, *hf_greedy(fp8_dir(family), prompt, NEW_TOKENS))
        return made[family]

    return get


# ---- the format ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(128, 256), (200, 300), (3, 130, 70)])
def test_quantize_and_dequantize_match_the_block_reference(shape: tuple[int, ...]) -> None:
    """Partial blocks and stacked (expert) weights included: the engine's vectorized block quantizer gives the
    reference loop's bits, and dequantizing gives float32(value) * scale_inv, within e4m3's rounding of w."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.3
    w[..., :5, :7] = 0.0  # a zero corner; and one all-zero block where the shape has a second block row
    q, scale_inv = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == fp8.scale_shape(shape)
    for i, part in enumerate(w.reshape(-1, *shape[-2:])):
        ref_q, ref_scale = quantize_reference(part)
        assert torch.equal(q.reshape(-1, *shape[-2:])[i].view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(scale_inv.reshape(-1, *ref_scale.shape)[i], ref_scale)
        back = fp8.dequantize(q.reshape(-1, *shape[-2:])[i], ref_scale, torch.float32)
        assert torch.equal(back, dequantize_reference(ref_q, ref_scale))
        # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals below 2^-6 spaced 2^-9 (times the scale)
        scale = dequantize_reference(torch.ones_like(ref_q), ref_scale)
        assert ((back - part).abs() <= part.abs() * 2**-4 + scale * 2**-10).all()


# ---- goldens ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", GOLDEN_FAMILIES)
@pytest.mark.parametrize("is_deterministic", [False, True], ids=["default", "deterministic"])
def test_fp8_checkpoint_matches_transformers(fp8_dir, hf_fp8_reference, family: str, is_deterministic: bool) -> None:
    """The engine on an FP8 checkpoint against transformers on the same checkpoint: 64 greedy tokens
    identical, the prompt's last logits within rtol = atol = 1e-4. Why that tolerance: both dequantize to the
    same float32 weights, bit for bit (asserted below; float32(e4m3) * float32 scale is one rounding), so
    what remains is float32 summation order in the matmuls and attention, as in the float goldens
    (test_engine_golden.py uses the same bound); FP8 rounding itself cancels out of this comparison."""
    folder = fp8_dir(family)
    prompt, ref_tokens, ref_logits, ref_first = hf_fp8_reference(family)
    eng = small_engine(folder, is_deterministic=is_deterministic, max_num_batched_tokens=40)

    (first,) = prompt_logits(eng, [prompt])
    torch.testing.assert_close(first, ref_first, rtol=1e-4, atol=1e-4)
    (seq,) = eng.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    note = compare_greedy(seq.output_token_ids, ref_tokens, ref_logits, tie_gap=1e-3)
    assert note == "", note
    eng.check_idle()


def test_weights_stay_fp8_and_equal_transformers_dequantized(fp8_dir) -> None:
    """Every projection the checkpoint quantized is held in FP8 with its scales (1 byte a weight), the
    modules_to_not_convert ones (lm_head, routers, KEEP_FLOAT) in float32; each FP8 weight dequantizes to
    the bits transformers' FP8 loader gives for it."""
    from transformers import AutoModelForCausalLM

    folder = fp8_dir("qwen3_moe")
    eng = small_engine(folder)
    model = eng.model
    candidates = fp8_candidates(model)
    layer = model.model.layers
    assert layer[0].self_attn.o_proj.weight.dtype == torch.float32  # KEEP_FLOAT
    assert layer[2].mlp.experts.gate_up_proj.dtype == torch.float32  # KEEP_FLOAT
    assert model.lm_head.weight.dtype == torch.float32 and layer[0].mlp.gate.weight.dtype == torch.float32
    is_kept = {"model.layers.0.self_attn.o_proj", "model.layers.2.mlp.experts", "lm_head"}
    for name, module in candidates.items():
        weights = [p for n, p in module.named_parameters() if not n.endswith(("bias", fp8.SCALE_SUFFIX))]
        want = torch.float32 if name in is_kept else torch.float8_e4m3fn
        assert all(w.dtype == want for w in weights), name
    fp8_bytes = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    assert fp8_bytes > 0.5 * sum(p.numel() for p in model.parameters())  # most weights, at 1 byte each

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ours = layer[0].self_attn.q_proj
    assert isinstance(ours, fp8.Fp8Linear)
    assert torch.equal(ours.dense_weight(torch.float32), hf.model.layers[0].self_attn.q_proj.weight)
    experts = layer[3].mlp.experts
    theirs = hf.model.layers[3].mlp.experts
    assert torch.equal(experts.dense("gate_up_proj", 0, 8, torch.float32), theirs.gate_up_proj)
    assert torch.equal(experts.dense("down_proj", 0, 8, torch.float32), theirs.down_proj)


def test_partial_blocks_equal_the_dequantized_float_checkpoint(tmp_path: Path) -> None:
    """Widths that end in partial blocks (192 = 128 + 64, 320), lm_head in FP8 too: the engine on the FP8
    checkpoint gives the logits, bit for bit, of the engine on a float32 checkpoint of the
    reference-dequantized weights, in both numerics modes (same float32 weights, same matmuls)."""
    folder = make_tiny_fp8("llama_partial", tmp_path / "fp8", also=("lm_head.weight",))
    dense = tmp_path / "dense"
    dense.mkdir()
    tensors = load_file(folder / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = dequantize_reference(t, scale) if scale is not None else t
    save_file(out, str(dense / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (dense / "config.json").write_text(json.dumps(config))
    prompts = random_prompts([37, 90], seed=3)
    for is_deterministic in (False, True):
        a = small_engine(folder, is_deterministic=is_deterministic)
        b = small_engine(dense, is_deterministic=is_deterministic)
        assert isinstance(a.model.model.layers[0].mlp.down_proj, fp8.Fp8Linear)
        assert isinstance(a.model.lm_head, fp8.Fp8Linear)
        for x, y in zip(prompt_logits(a, prompts), prompt_logits(b, prompts)):
            assert torch.equal(x, y)


# ---- --quantization fp8 -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3"])
def test_quantization_flag_equals_the_prequantized_checkpoint(tmp_path: Path, family: str) -> None:
    """A bf16 checkpoint with --quantization fp8 holds the FP8 weights and scales the pre-quantized release of
    the same weights ships (bit for bit), and gives its logits and 64 greedy tokens exactly."""
    bf16 = tmp_path / "bf16"
    _save_random({**COMMON, **FP8_FAMILIES[family]}, bf16, seed=5, dtype=torch.bfloat16)
    released = to_fp8_checkpoint(bf16, tmp_path / "fp8")
    quantized = small_engine(bf16, quantization="fp8")
    shipped = small_engine(released)
    ours = dict(quantized.model.named_parameters())
    theirs = dict(shipped.model.named_parameters())
    assert ours.keys() == theirs.keys()
    assert sum(p.dtype == torch.float8_e4m3fn for p in ours.values()) > 0
    for name, p in ours.items():
        assert p.dtype == theirs[name].dtype, name
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                           theirs[name].view(torch.uint8) if p.dtype == torch.float8_e4m3fn else theirs[name]), name

    (prompt,) = random_prompts([50], seed=2)
    assert torch.equal(prompt_logits(quantized, [prompt])[0], prompt_logits(shipped, [prompt])[0])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    (a,) = quantized.generate([prompt], params)
    (b,) = shipped.generate([prompt], params)
    assert a.output_token_ids == b.output_token_ids
    # the flag on the FP8 checkpoint changes nothing; the FP8 model is not the bf16 one (FP8 rounding moved
    # its logits)
    again = small_engine(released, quantization="fp8")
    assert torch.equal(prompt_logits(again, [prompt])[0], prompt_logits(shipped, [prompt])[0])
    plain = small_engine(bf16)
    assert not torch.equal(prompt_logits(plain, [prompt])[0], prompt_logits(quantized, [prompt])[0])


def test_dummy_weights_of_an_fp8_config_keep_modules_to_not_convert(fp8_dir) -> None:
    """--load-format dummy on an FP8 release's config: the projections FP8, what modules_to_not_convert lists
    (and lm_head, the routers) float."""
    eng = small_engine(fp8_dir("qwen3_moe"), load_format="dummy")
    layers = eng.model.model.layers
    assert isinstance(layers[1].self_attn.o_proj, fp8.Fp8Linear) and isinstance(layers[1].mlp.up_proj, fp8.Fp8Linear)
    assert layers[3].mlp.experts.down_proj.dtype == torch.float8_e4m3fn
    assert layers[0].self_attn.o_proj.weight.dtype == layers[2].mlp.experts.down_proj.dtype == torch.float32
    assert eng.model.lm_head.weight.dtype == layers[0].mlp.gate.weight.dtype == torch.float32


def test_dummy_fp8_weights_generate() -> None:
    """--load-format dummy with --quantization fp8 (benchmarks' FP8 models of real shapes): FP8 weights drawn
    and quantized, no NaN, tokens generated; the experts of a MoE too."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        _save_random({**COMMON, **FP8_FAMILIES["qwen3_moe"]}, folder, seed=0)
        eng = small_engine(folder, load_format="dummy", quantization="fp8")
        assert eng.model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
        assert all(torch.isfinite(s).all() and (s > 0).all() for n, s in eng.model.named_parameters()
                   if n.endswith(fp8.SCALE_SUFFIX))  # fmt: skip
        (seq,) = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(seq.output_token_ids) == 4


# ---- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"quant_method": "gptq"}, "quant_method"),
        ({"quant_method": "compressed-tensors"}, "quant_method"),
        ({"weight_block_size": [64, 64]}, "weight_block_size"),
        ({"weight_block_size": [128, 64]}, "weight_block_size"),
        ({"weight_block_size": None}, "weight_block_size"),
        ({"activation_scheme": "static"}, "activation_scheme"),
        ({"fmt": "e5m2"}, "fmt"),
        ({"scale_fmt": "mx"}, "scale_fmt"),
        ({"kv_cache_scheme": {"type": "float"}}, "kv_cache_scheme"),
        ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
    ],
)
def test_unsupported_quantization_config_is_refused(fp8_dir, tmp_path: Path, change: dict, field: str) -> None:
    config = json.loads((fp8_dir("llama") / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match=f"quantization_config.{field}"):
        arch_from_hf(load_hf_config(tmp_path))


def test_bad_fp8_tensors_and_flag_are_refused(fp8_dir, tmp_path: Path) -> None:
    """FP8 values without their scales; scales for a module the engine keeps float; an unknown
    --quantization; FP8 experts whose width is not whole blocks."""
    folder = fp8_dir("llama")
    config = (folder / "config.json").read_text()
    tensors = load_file(folder / "model.safetensors")

    def engine_with(changed: dict[str, torch.Tensor], **kw):  # type: ignore[no-untyped-def]
        (tmp_path / "config.json").write_text(config)
        save_file(changed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        return small_engine(tmp_path, **kw)

    no_scale = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight_scale_inv"}
    with pytest.raises(ValueError, match="FP8 values without their model.layers.1.mlp.up_proj.weight_scale_inv"):
        engine_with(no_scale)
    byte_scales = {**tensors, "model.layers.1.mlp.up_proj.weight_scale_inv": torch.full((3, 2), 127, dtype=torch.uint8)}
    with pytest.raises(ValueError, match="block scales stored as torch.uint8"):
        engine_with(byte_scales)  # MXFP8's e8m0 bytes
    scaled_norm = {**tensors, "model.norm.weight_scale_inv": torch.ones(1, 1)}
    with pytest.raises(InvalidRequestError, match="model.norm.weight_scale_inv"):
        engine_with(scaled_norm)
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=str(folder), quantization="int8")
    # DeepSeek-V3.1's "scale_fmt": "ue8m0" (power-of-two scales, stored as float32) loads
    (tmp_path / "config.json").write_text(config.replace('"fmt": "e4m3",', '"fmt": "e4m3", "scale_fmt": "ue8m0",'))
    assert "ue8m0" in (tmp_path / "config.json").read_text()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert isinstance(small_engine(tmp_path).model.model.layers[0].self_attn.q_proj, fp8.Fp8Linear)

    narrow = tmp_path / "narrow"  # experts 32 wide: gate and up blocks would not stack
    _save_random({**COMMON, **FP8_FAMILIES["qwen3_moe"], "moe_intermediate_size": 32}, narrow, seed=0)
    with pytest.raises(InvalidRequestError, match="multiple of 128"):
        small_engine(narrow, quantization="fp8")


# ---- expert parallelism --------------------------------------------------------------------------


def _fp8_moe(ep=None, seed: int = 0):  # type: ignore[no-untyped-def]
    """A gpt-oss-style MoE layer (8 experts 128 wide, biases) whose experts hold FP8 weights: random float
    weights quantized, the router's bias pushing tokens to experts 0-3."""
    import torch.nn.functional as F

    from engine.layers.moe import SparseMoE

    moe = SparseMoE(64, 128, 8, 2, False, F.silu, ep, routing="topk_softmax", activation="swiglu_oai", has_bias=True)
    moe.experts.to_fp8()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if name.endswith(fp8.SCALE_SUFFIX):
                continue
            w = torch.randn(p.shape, generator=gen) * (0.25 if "proj" in name else 1.0)
            if p.dtype == torch.float8_e4m3fn:
                q, scale = fp8.quantize(w)
                p.copy_(q)
                moe.get_parameter(name + fp8.SCALE_SUFFIX).copy_(scale)
            else:
                p.copy_(w)
        moe.router_linear.bias[:4] += 4.0
    return moe.requires_grad_(False)


def test_fp8_experts_under_expert_parallelism_with_rebalancing() -> None:
    """Two expert-parallel ranks holding four FP8 experts each (weights, scales and biases): each rank's
    output is the whole layer's for its tokens, bit for bit under the tiled numerics, before and after
    rebalancing moves experts (FP8 bytes, scales and biases together) between the ranks."""
    from engine.layers.eplb import rebalance_layer
    from engine.layers.numerics import Numerics
    from tests.engine.models.test_gpt_oss import ThreadGroup, _run_ranks

    whole = _fp8_moe()
    group = ThreadGroup(2)
    xs = [torch.randn(n, 64, generator=torch.Generator().manual_seed(20 + n)) for n in (23, 9)]

    def rank(r: int) -> tuple[list[torch.Tensor], int]:
        ep = group.rank(r)
        moe = _fp8_moe(ep=ep)
        first, per = ep.local_experts(8)
        with torch.no_grad():
            for name, p in moe.named_parameters():
                src = whole.get_parameter(name)
                p.copy_(src[first : first + per] if name.startswith("experts.") else src)
        assert moe.experts.gate_up_proj.dtype == torch.float8_e4m3fn
        outs = [moe(xs[r], Numerics.TILED)]
        moved = rebalance_layer(moe, ep)
        outs.append(moe(xs[r], Numerics.TILED))
        return outs, moved

    results = _run_ranks(rank, 2)
    assert results[0][1] == results[1][1] > 0  # experts moved
    for r, (outs, _) in enumerate(results):
        for out in outs:
            assert torch.equal(out, whole(xs[r], Numerics.TILED))


def test_stacked_fp8_experts_load_like_per_expert(fp8_dir, tmp_path: Path) -> None:
    """The same FP8 experts stored stacked (`experts.gate_up_proj` [E, 2I, H] gate rows then up rows, with
    `gate_up_proj_scale_inv` [E, 2I/128, H/128]; `down_proj` and its scales) load to the same bytes as the
    per-expert release."""
    folder = fp8_dir("qwen3_moe")
    tensors = load_file(folder / "model.safetensors")
    stacked: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" not in parts:
            stacked[name] = t
            continue
        prefix = ".".join(parts[: parts.index("experts") + 1])
        if prefix + ".down_proj" in stacked or prefix + ".down_proj.weight" in stacked:
            continue
        for suffix in ("", "_scale_inv"):
            per = [tensors.get(f"{prefix}.{e}.gate_proj.weight{suffix}") for e in range(8)]
            if per[0] is None:
                continue
            stacked[f"{prefix}.gate_up_proj{suffix}"] = torch.stack(
                [torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight{suffix}"], tensors[f"{prefix}.{e}.up_proj.weight{suffix}"]])
                 for e in range(8)]
            )  # fmt: skip
            stacked[f"{prefix}.down_proj{suffix}"] = torch.stack(
                [tensors[f"{prefix}.{e}.down_proj.weight{suffix}"] for e in range(8)]
            )
    save_file(stacked, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    a, b = small_engine(folder), small_engine(tmp_path)
    ours, theirs = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert ours.keys() == theirs.keys() and "model.layers.3.mlp.experts.gate_up_proj_scale_inv" in ours
    for name, p in ours.items():
        assert p.dtype == theirs[name].dtype and torch.equal(p.view(torch.uint8), theirs[name].view(torch.uint8)), name


def test_fused_projections_stack_fp8_blocks_where_they_align(fp8_dir, tmp_path: Path) -> None:
    """CausalLM.fuse_projections (run on CUDA after loading; its torch path runs here): FP8 q/k/v (256, 128, 128
    rows) and gate/up (384, 384) stack into one FP8 linear with stacked scales, giving the unfused logits;
    where a width is not whole blocks (q 192, k 64: partial) they stay apart."""
    eng = small_engine(fp8_dir("llama"))
    (prompt,) = random_prompts([40], seed=4)
    (before,) = prompt_logits(eng, [prompt])
    eng.model.fuse_projections()
    layer = eng.model.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj, fp8.Fp8Linear) and isinstance(layer.mlp.gate_up_proj, fp8.Fp8Linear)
    assert layer.self_attn.qkv_proj.weight_scale_inv.shape == (4, 2)  # (256 + 128 + 128) / 128 rows of blocks
    (after,) = prompt_logits(eng, [prompt])
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)

    partial = small_engine(make_tiny_fp8("llama_partial", tmp_path))
    partial.model.fuse_projections()
    layer = partial.model.model.layers[0]
    assert layer.self_attn.qkv_proj is None and isinstance(layer.self_attn.q_proj, fp8.Fp8Linear)
    assert layer.mlp.gate_up_proj is None  # 320 = 2.5 blocks


def test_quantization_flag_on_gpt_oss_experts(tmp_path: Path) -> None:
    """gpt-oss (experts stored interleaved [E, H, 2I], biases, attention sinks) with --quantization fp8: each
    tensor is quantized after the loader puts it in the model's layout, so the engine equals, bit for bit, the
    engine on a float checkpoint whose weights are the reference quantizer's round trip in that layout (gate
    rows then up rows, [E, 2I, H]; down [E, H, I]), put back in the checkpoint's layout."""
    from tests.tiny_models import MOE_FAMILIES

    original = tmp_path / "float"
    _save_random({**COMMON, **MOE_FAMILIES["gpt_oss"], "intermediate_size": 128}, original, seed=0)
    tensors = load_file(original / "model.safetensors")

    def round_trip(w: torch.Tensor) -> torch.Tensor:
        return dequantize_reference(*quantize_reference(w))

    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".experts.gate_up_proj"):  # [E, H, 2I], gate/up alternating columns
            model = torch.cat([t.transpose(1, 2)[:, 0::2], t.transpose(1, 2)[:, 1::2]], dim=1)  # [E, 2I, H]
            model = torch.stack([round_trip(e) for e in model])
            back = torch.empty_like(model)
            half = model.shape[1] // 2
            back[:, 0::2], back[:, 1::2] = model[:, :half], model[:, half:]
            out[name] = back.transpose(1, 2).contiguous()
        elif name.endswith(".experts.down_proj"):  # [E, I, H]
            out[name] = torch.stack([round_trip(e) for e in t.transpose(1, 2)]).transpose(1, 2).contiguous()
        elif name.endswith(".weight") and t.dim() == 2 and name.startswith("model.layers.") and ".router." not in name:
            out[name] = round_trip(t)
        else:
            out[name] = t
    dense = tmp_path / "dense"
    dense.mkdir()
    save_file(out, str(dense / "model.safetensors"), metadata={"format": "pt"})
    (dense / "config.json").write_text((original / "config.json").read_text())

    quantized, reference = small_engine(original, quantization="fp8"), small_engine(dense)
    layer = quantized.model.model.layers[0]
    assert layer.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert isinstance(layer.self_attn.q_proj, fp8.Fp8Linear) and layer.self_attn.q_proj.bias is not None
    prompts = random_prompts([30, 70], seed=6)
    for a, b in zip(prompt_logits(quantized, prompts), prompt_logits(reference, prompts)):
        assert torch.equal(a, b)


def test_fp8_latent_up_projection_is_dequantized_once_at_load(fp8_dir) -> None:
    """DeepSeek-V3's kv_b_proj (W_UK and W_UV) is read whole by every absorbed query and every un-absorbed
    output: CausalLM.fuse_projections (CUDA, after loading; its torch path runs here) replaces the FP8 one by
    its dequantized float copy once, bit for bit the weight the per-step dequantization gave, so decode never
    dequantizes it again; the other projections stay FP8, and the tokens are the unfused ones."""
    eng = small_engine(fp8_dir("deepseek_v3"))
    (prompt,) = random_prompts([40], seed=5)
    (before,) = prompt_logits(eng, [prompt])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens_before = eng.generate([prompt], params)[0].output_token_ids
    attns = [layer.self_attn for layer in eng.model.model.layers]
    fp8_up = [a.kv_b_proj for a in attns]
    assert all(isinstance(m, fp8.Fp8Linear) for m in fp8_up)
    dense = [m.dense_weight(torch.float32) for m in fp8_up]
    eng.model.fuse_projections()
    for attn, want in zip(attns, dense, strict=True):
        assert type(attn.kv_b_proj) is torch.nn.Linear
        assert attn.kv_b_proj.weight.dtype == torch.float32 and torch.equal(attn.kv_b_proj.weight, want)
        assert isinstance(attn.kv_a_proj_with_mqa, fp8.Fp8Linear) and isinstance(attn.o_proj, fp8.Fp8Linear)
    (after,) = prompt_logits(eng, [prompt])
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert eng.generate([prompt], params)[0].output_token_ids == tokens_before
    eng.check_idle()
