"""The architecture facts the engine needs, read once from a Hugging Face config."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from engine.arch import FULL, SLIDING, ModelArch
from engine.errors import InvalidRequestError
from engine.quantization import fp8_format

# model_type -> family traits that the config does not spell out
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
    "qwen3_moe": {"qk_norm": True},
    "gemma3_text": {"qk_norm": True, "gemma_norm": True, "sandwich_norm": True, "embed_scale": True},
    "gpt_oss": {"o_proj_bias": True, "attn_sinks": True},
    "deepseek_v3": {},
}

def load_hf_config(folder: Path) -> Any:
    """The transformers config object (it normalises rope and layer_types across versions)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def arch_from_hf(hf: Any) -> ModelArch:
    model_type = hf.model_type
    if model_type not in _FAMILIES:
        raise InvalidRequestError(f"unsupported model_type {model_type!r}; supported: {sorted(_FAMILIES)}")
    fp8_format(getattr(hf, "quantization_config", None), None)  # refuses what the engine does not load
    traits = dict(_FAMILIES[model_type])
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    if model_type == "deepseek_v3":  # the rotary part's width, which the rope tables cover
        head_dim = int(hf.qk_rope_head_dim)
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:  # Mistral: a window means every layer slides
        layer_types = [SLIDING if window else FULL] * hf.num_hidden_layers
    if SLIDING not in layer_types:
        window = None
    if model_type == "gemma3_text":
        attn_scale = float(hf.query_pre_attn_scalar) ** -0.5
    elif model_type == "deepseek_v3":
        attn_scale = mla_softmax_scale(hf)
    else:
        attn_scale = head_dim**-0.5
    if model_type == "qwen2":
        traits["attention_bias"] = True
    else:
        traits["attention_bias"] = bool(getattr(hf, "attention_bias", False)) or traits.get("attention_bias", False)
    traits["o_proj_bias"] = traits.get("o_proj_bias", False) and traits["attention_bias"]
    act = str(getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu"))
    return ModelArch(
        model_type=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.rms_norm_eps),
        layer_types=tuple(layer_types),
        sliding_window=window,
        hidden_act=act,
        attn_scale=attn_scale,
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096)),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        **traits,
        **_moe_fields(hf),
        **_mla_fields(hf),
    )


def _mla_fields(hf: Any) -> dict[str, Any]:
    """ModelArch's latent-attention fields (DeepSeek-V3); {} for the other families."""
    if hf.model_type != "deepseek_v3":
        return {}
    return dict(
        kv_lora_rank=int(hf.kv_lora_rank),
        q_lora_rank=int(hf.q_lora_rank or 0),
        qk_nope_head_dim=int(hf.qk_nope_head_dim),
        qk_rope_head_dim=int(hf.qk_rope_head_dim),
        v_head_dim=int(hf.v_head_dim),
        rope_interleave=bool(getattr(hf, "rope_interleave", True)),
        num_nextn_predict_layers=int(getattr(hf, "num_nextn_predict_layers", 0) or 0),
    )


def mla_softmax_scale(hf: Any) -> float:
    """DeepSeek-V3's softmax scale: (qk_nope + qk_rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)
    squared when the rope is scaled (transformers' yarn_apply_mscale, the reference implementation's
    softmax_scale * mscale * mscale): the whole of q.k, not only its rotary dims, sees YaRN's scaling."""
    scale = float(hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5
    params = _rope_params(hf)
    if params.get("rope_type", params.get("type", "default")) != "default":
        mscale_all_dim = params.get("mscale_all_dim") or 0
        factor = float(params["factor"])
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


def _moe_fields(hf: Any) -> dict[str, Any]:
    """ModelArch's MoE fields, as transformers' Qwen3-MoE picks its sparse layers (gpt-oss: every layer);
    {} for dense models."""
    if hf.model_type == "gpt_oss":
        # gpt-oss: top-k of the router logits, softmax over those k; clamped SwiGLU experts with biases
        top_k = getattr(hf, "num_experts_per_tok", None) or hf.experts_per_token  # the name varies by version
        return dict(
            sparse_layers=tuple(range(hf.num_hidden_layers)),
            num_experts=int(hf.num_local_experts),
            num_experts_per_tok=int(top_k),
            moe_intermediate_size=int(hf.intermediate_size),
            routing="topk_softmax",
            expert_activation="swiglu_oai",
            has_expert_bias=True,
            swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
            swiglu_limit=float(hf.swiglu_limit),
            expert_layout="interleaved",
        )
    if hf.model_type == "deepseek_v3":
        # DeepSeek-V3: layers [first_k_dense_replace, num_layers) sparse, sigmoid group-limited routing
        num_groups = int(hf.n_group or 1)
        return dict(
            sparse_layers=tuple(range(int(hf.first_k_dense_replace or 0), hf.num_hidden_layers)),
            num_experts=int(hf.n_routed_experts),
            num_experts_per_tok=int(hf.num_experts_per_tok),
            moe_intermediate_size=int(hf.moe_intermediate_size),
            norm_topk_prob=bool(hf.norm_topk_prob),
            routing="sigmoid_group_topk",
            num_expert_groups=num_groups,
            topk_groups=int(hf.topk_group or num_groups),
            routed_scaling_factor=float(hf.routed_scaling_factor),
            shared_intermediate_size=int(hf.moe_intermediate_size) * int(hf.n_shared_experts or 0),
        )
    num_experts = int(getattr(hf, "num_experts", None) or 0)
    if hf.model_type != "qwen3_moe" or num_experts == 0:
        return {}
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1))
    return dict(
        sparse_layers=tuple(i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0),
        num_experts=num_experts,
        num_experts_per_tok=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(hf.moe_intermediate_size),
        norm_topk_prob=bool(hf.norm_topk_prob),
    )


def _rope_params(hf: Any) -> dict[str, Any]:
    """The config's rope parameters (transformers 5 folds a legacy rope_scaling into rope_parameters)."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:  # older transformers
        params = {"rope_type": "default", "rope_theta": getattr(hf, "rope_theta", 10000.0)}
        if getattr(hf, "rope_scaling", None):
            params.update(hf.rope_scaling)
    return dict(params)


def rope_inv_freq(hf: Any, layer_type: str, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale for one layer type, as transformers computes them."""
    params = _rope_params(hf)
    is_nested = isinstance(params.get(layer_type), dict)
    p = params[layer_type] if is_nested else params
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type == "default":
        base = float(p["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), layer_type=layer_type if is_nested else None)
    return inv.float(), float(scale)


def generation_eos_ids(folder: Path, hf: Any) -> set[int]:
    """EOS ids from generation_config.json (which may list several), else from config.json."""
    ids: set[int] = set()
    for source in (folder / "generation_config.json", folder / "config.json"):
        if source.exists():
            value = json.loads(source.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
    if not ids and getattr(hf, "eos_token_id", None) is not None:
        ids.add(int(hf.eos_token_id))
    return ids
