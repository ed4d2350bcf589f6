"""The architecture facts the engine needs, read once from a Hugging Face config."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.fp8 import fp8_format
from engine.moe import EXPERT_ACTIVATIONS, ROUTING_KINDS

FULL = "full_attention"
SLIDING = "sliding_attention"

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

# ModelArch.expert_layout, how a checkpoint stores stacked experts (engine/loader.py converts):
# "stacked": ours, gate_up_proj [E, 2I, H] gate rows then up rows, down_proj [E, H, I] (or per expert);
# "interleaved": gpt-oss, gate_up_proj [E, H, 2I] with gate/up alternating columns, down_proj [E, I, H]
EXPERT_LAYOUTS = ("stacked", "interleaved")


@dataclass(frozen=True)
class ModelArch:
    """Shapes and per-family switches of a decoder-only transformer."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    sliding_window: int | None
    hidden_act: str
    attn_scale: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    gemma_norm: bool = False  # RMSNorm scales by (1 + w), computed in float32
    sandwich_norm: bool = False  # extra norms after attention and around the MLP (Gemma 3)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    o_proj_bias: bool = False  # the output projection has a bias too (with attention_bias; gpt-oss)
    attn_sinks: bool = False  # a learned logit per head in every softmax's denominator, no value (gpt-oss)
    # Sparse MoE (engine/moe.py): the layers whose MLP is routed experts; the others keep the dense MLP
    sparse_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalized to sum to 1
    # engine/moe.py ROUTING_KINDS: "softmax_topk" (Qwen3-MoE), "topk_softmax" (gpt-oss), "sigmoid_group_topk"
    # (DeepSeek-V3: sigmoid scores, e_score_correction_bias for the choice only, num_expert_groups groups of
    # which the topk_groups best are eligible, weights times routed_scaling_factor)
    routing: str = "softmax_topk"
    expert_activation: str = "swiglu"  # engine/moe.py EXPERT_ACTIVATIONS
    has_expert_bias: bool = False  # router and expert projections with biases (gpt-oss)
    swiglu_alpha: float = 1.702  # "swiglu_oai" only
    swiglu_limit: float = 7.0  # "swiglu_oai" only
    expert_layout: str = "stacked"  # EXPERT_LAYOUTS
    num_expert_groups: int = 1  # "sigmoid_group_topk" only: n_group
    topk_groups: int = 1  # "sigmoid_group_topk" only: topk_group
    routed_scaling_factor: float = 1.0  # "sigmoid_group_topk" only
    shared_intermediate_size: int = 0  # a sparse layer's always-on shared experts' width (DeepSeek-V3), 0: none
    # Multi-head latent attention (DeepSeek-V3, engine/mla.py), on when kv_lora_rank > 0: K and V come from one
    # kv_lora_rank latent per token plus a shared qk_rope_head_dim rotary key; head_dim is then the rotary
    # part's width (transformers' config.head_dim too), attn_scale the softmax scale of qk_nope + qk_rope dims
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: a plain q_proj, else q_a_proj -> q_a_layernorm -> q_b_proj
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rotary dims pair up as (0, 1), (2, 3), ... instead of halves
    num_nextn_predict_layers: int = 0  # a checkpoint's multi-token-prediction layers, skipped at load

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError("layer_types must name every layer")
        if self.sparse_layers:
            if not all(0 <= i < self.num_layers for i in self.sparse_layers):
                raise ValueError(f"sparse_layers {self.sparse_layers} outside the {self.num_layers} layers")
            if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ValueError("sparse layers need 1 <= num_experts_per_tok <= num_experts and a moe_intermediate_size")
            if self.sandwich_norm:
                raise ValueError("sparse layers with sandwich norms are not supported")
        if self.num_expert_groups < 1 or not 1 <= self.topk_groups <= self.num_expert_groups:
            raise ValueError("expert groups need 1 <= topk_groups <= num_expert_groups")
        if self.num_experts % self.num_expert_groups:
            raise ValueError(f"{self.num_experts} experts do not split into {self.num_expert_groups} groups")
        if self.is_mla and min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) < 1:
            raise ValueError("latent attention needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
        if self.is_mla and (self.has_sliding or self.qk_rope_head_dim % 2 or self.head_dim != self.qk_rope_head_dim):
            raise ValueError("latent attention: full-attention layers, an even rotary width, head_dim = qk_rope_head_dim")
        for name, value, allowed in (
            ("routing", self.routing, ROUTING_KINDS),
            ("expert_activation", self.expert_activation, EXPERT_ACTIVATIONS),
            ("expert_layout", self.expert_layout, EXPERT_LAYOUTS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: one of {allowed}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """MLA: a query's and an expanded key's width per head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == SLIDING]

    @property
    def has_full(self) -> bool:
        return FULL in self.layer_types

    @property
    def has_sliding(self) -> bool:
        return SLIDING in self.layer_types


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
