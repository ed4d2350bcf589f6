"""Tiny random-weight Hugging Face checkpoints of every supported family, written to a folder.

Weights are drawn with a wide init (std 0.25) so greedy decoding has clear winners: near-uniform
logits would make every step a tie and the golden comparison meaningless. Attention sinks (gpt-oss)
get std 1, so that they weigh against the scores; DeepSeek-V3's e_score_correction_bias (a buffer) std
0.1, so that it moves expert choices (sigmoid scores lie in (0, 1))."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.25,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", rope_theta=10000.0),
    "qwen2": dict(model_type="qwen2", rope_theta=10000.0),
    "qwen3": dict(model_type="qwen3", head_dim=32, rope_theta=10000.0),
    "mistral": dict(model_type="mistral", sliding_window=None, rope_theta=10000.0),
    # fused qkv_proj and gate_up_proj in the checkpoint; a sliding window on every layer, as Phi-3-mini's 2047
    "phi3": dict(model_type="phi3", sliding_window=24, rope_theta=10000.0),
    "qwen3_hybrid": dict(
        model_type="qwen3",
        head_dim=16,
        use_sliding_window=True,
        sliding_window=24,
        max_window_layers=2,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    ),
    "gemma3_hybrid": dict(
        model_type="gemma3_text",
        head_dim=32,
        num_hidden_layers=6,
        sliding_window=24,
        query_pre_attn_scalar=32,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
    ),
}


def _save_random(spec: dict[str, Any], folder: Path, seed: int, dtype: torch.dtype = torch.float32) -> None:
    """A random model of spec (model_type and config fields), saved by save_pretrained in dtype (drawn in
    float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    model_type = spec.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **spec), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if model_type == "gemma3_text" else 1.0, 0.1)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.25 if p.dim() > 1 else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(str(folder))


def make_tiny(family: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Writes config.json + model.safetensors of a random tiny model (FAMILIES or MOE_FAMILIES, with the
    config fields in overrides changed); returns the folder."""
    _save_random({**COMMON, **(FAMILIES.get(family) or MOE_FAMILIES[family]), **overrides}, folder, seed)
    return folder


MOE_FAMILIES: dict[str, dict[str, Any]] = {
    # Qwen3-30B-A3B's routing at toy size: renormalized top-2 of 8 experts, layer 1 dense
    "qwen3_moe": dict(
        model_type="qwen3_moe", head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, rope_theta=10000.0,
    ),
    # gpt-oss at toy size: every layer top-2 of 8 biased experts (intermediate_size is an expert's width),
    # sliding (window 8) and full layers alternating, attention sinks, biases on q/k/v/o; yarn rope with
    # gpt-oss's factor, its original context cut to 32 so that factor * original = max_position_embeddings
    "gpt_oss": dict(
        model_type="gpt_oss", head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
        swiglu_limit=7.0, sliding_window=8, attention_bias=True,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=32),
    ),
    # DeepSeek-V3 at toy size (its config's every field, transformers' defaults replaced): latent attention
    # (q_lora_rank 24, kv_lora_rank 32, nope 16 + rope 8 per head, values 16; rope pairs interleaved) with
    # YaRN (factor 4, mscale_all_dim in the softmax scale); layer 0 dense, then top-2 of 8 experts chosen
    # within the 2 best of 4 groups, renormalized, times 2.5, plus one shared expert
    "deepseek_v3": dict(
        model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
        num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        first_k_dense_replace=1, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                             original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0),
    ),
    # the other branches: a plain q_proj (q_lora_rank null), rotary halves, one group (no group limit), top-3
    # not renormalized, two shared experts, two dense layers first, default rope; values wider than q_nope
    "deepseek_v3_plain_q": dict(
        model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, n_shared_experts=2, moe_intermediate_size=16,
        num_experts_per_tok=3, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.5,
        first_k_dense_replace=2, rope_interleave=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
}  # fmt: skip


def make_tiny_mtp(family: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """make_tiny's DeepSeek-V3 (MOE_FAMILIES[family], overrides applied) with one multi-token-prediction layer under
    the released names, config.json saying num_nextn_predict_layers 1; returns the folder. With N =
    num_hidden_layers, model.layers.{N}.* holds: a decoder layer (transformers' DeepseekV3DecoderLayer(config,
    layer_idx=N), saved by save_pretrained as the last layer of an (N + 1)-layer random model, so that its experts
    are stored per expert as every other layer's), enorm, hnorm, eh_proj [hidden, 2 x hidden], shared_head.norm,
    shared_head.head [vocab, hidden] (drawn with _save_random's wide init) and embed_tokens (a copy of the model's).
    transformers loads the N-layer model from it, the extra layer unused; with num_hidden_layers N + 1 it loads
    the decoder layer as its layer N."""
    import json

    from safetensors.torch import load_file, save_file

    spec = {**COMMON, **MOE_FAMILIES[family], **overrides}
    n, hidden, vocab = spec["num_hidden_layers"], spec["hidden_size"], spec["vocab_size"]
    _save_random({**spec, "num_hidden_layers": n + 1}, folder, seed)
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=gen)

    prefix = f"model.layers.{n}."
    tensors |= {
        prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        prefix + "enorm.weight": norm(),
        prefix + "hnorm.weight": norm(),
        prefix + "eh_proj.weight": 0.25 * torch.randn(hidden, 2 * hidden, generator=gen),
        prefix + "shared_head.norm.weight": norm(),
        prefix + "shared_head.head.weight": 0.25 * torch.randn(vocab, hidden, generator=gen),
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def make_servable(
    family: str, folder: Path, tokenizer_from: Path, seed: int = 0, families: dict[str, dict[str, Any]] | None = None
) -> Path:
    """A tiny random model of `family` (FAMILIES or MOE_FAMILIES, or the given families) that a server can
    load: the vocabulary, special ids and tokenizer files (chat template included) of the checkpoint at
    tokenizer_from."""
    import json
    import shutil

    small = json.loads((tokenizer_from / "config.json").read_text())
    spec = {**COMMON, **(families[family] if families else FAMILIES.get(family) or MOE_FAMILIES[family])}
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        if small.get(key) is not None:
            spec[key] = small[key]
    _save_random(spec, folder, seed)
    for f in tokenizer_from.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(f, folder / f.name)
    return folder


# ---- FP8 checkpoints (engine/layers/fp8.py's format, as FP8 releases ship it) --------------------------------

FP8_BLOCK = 128

# Shapes whose weights span several 128x128 blocks; every dimension is below 128 or a multiple of it, as
# transformers' FP8 dequantization infers the block size from the scale grid's shape
FP8_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", hidden_size=256, intermediate_size=384, head_dim=64, rope_theta=10000.0),
    "qwen3": dict(model_type="qwen3", hidden_size=256, intermediate_size=384, head_dim=64, rope_theta=10000.0),
    # experts 128 wide (gate and up blocks stack), layer 1 dense
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=256, intermediate_size=384, head_dim=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[1],
        decoder_sparse_step=1, rope_theta=10000.0,
    ),
    "deepseek_v3": {**MOE_FAMILIES["deepseek_v3"], "moe_intermediate_size": 128, "intermediate_size": 256},
    "gemma3": FAMILIES["gemma3_hybrid"],  # sliding and full layers, tied embeddings, sandwich norms
    # partial blocks everywhere: 192 = 128 + 64 (not loadable by transformers' dequantization, see above)
    "llama_partial": dict(model_type="llama", hidden_size=192, intermediate_size=320, num_attention_heads=3,
                          num_key_value_heads=1, head_dim=64, rope_theta=10000.0),
}  # fmt: skip


def quantize_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] as FP8 releases store it, block by block: each 128x128 block (the last ones partial)
    divided by scale_inv = its largest magnitude / 448 (1 for an all-zero block), as float8_e4m3fn; and the
    float32 scale_inv [ceil(N/128), ceil(K/128)]."""
    w = w.float()
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    rows, cols = -(-w.shape[0] // FP8_BLOCK), -(-w.shape[1] // FP8_BLOCK)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            at = (slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK), slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK))
            amax = w[at].abs().max()
            scale = amax / fp8_max if amax > 0 else torch.tensor(1.0)
            scale_inv[i, j] = scale
            q[at] = (w[at] / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q, scale_inv


def dequantize_reference(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 weight of quantize_reference's output: each FP8 value times its block's scale_inv."""
    scale = scale_inv.repeat_interleave(FP8_BLOCK, 0)[: q.shape[0]].repeat_interleave(FP8_BLOCK, 1)[:, : q.shape[1]]
    return q.float() * scale


def is_fp8_weight(name: str, t: torch.Tensor, keep_float: tuple[str, ...]) -> bool:
    """Whether an FP8 release quantizes this tensor: a decoder layer's projection weight, MoE routers and
    modules_to_not_convert excepted."""
    module = name.removesuffix(".weight")
    is_router = module.endswith((".mlp.gate", ".mlp.router"))
    kept = any(f".{m}." in f".{module}." for m in keep_float)
    return name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2 and not (is_router or kept)


def to_fp8_checkpoint(
    folder: Path, dest: Path, keep_float: tuple[str, ...] = (), also: tuple[str, ...] = ()
) -> Path:
    """The checkpoint at folder (save_pretrained's) rewritten into dest as an FP8 release: quantize_reference
    on every is_fp8_weight tensor (`<name>` float8_e4m3fn + `<name>_scale_inv` float32), the rest as saved,
    and config.json's quantization_config in the releases' form (lm_head, the routers and keep_float listed
    in modules_to_not_convert; `also`: tensors quantized besides, e.g. "lm_head.weight", which leaves lm_head off
    that list). Other files are copied."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dest / f.name)
    out: dict[str, torch.Tensor] = {}
    routers = []
    for name, t in load_file(folder / "model.safetensors").items():
        if name.endswith((".mlp.gate.weight", ".mlp.router.weight")):
            routers.append(name.removesuffix(".weight"))
        if is_fp8_weight(name, t, keep_float) or name in also:
            out[name], out[name + "_scale_inv"] = quantize_reference(t)
        else:
            out[name] = t
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
        "modules_to_not_convert": [*(["lm_head"] if "lm_head.weight" not in also else []), *sorted(routers),
                                   *keep_float],
    }  # fmt: skip
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def make_tiny_fp8(
    family: str, folder: Path, seed: int = 0, keep_float: tuple[str, ...] = (), also: tuple[str, ...] = ()
) -> Path:
    """A random tiny model of FP8_FAMILIES[family] saved as an FP8 release (to_fp8_checkpoint) in folder; its
    float32 original in folder/"float"."""
    original = folder / "float"
    _save_random({**COMMON, **FP8_FAMILIES[family]}, original, seed)
    return to_fp8_checkpoint(original, folder, keep_float, also)
