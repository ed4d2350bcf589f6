"""DeepSeek-V3 (and R1, V2-Lite's shapes in its config): multi-head latent attention (one kv_lora_rank
latent plus a shared rotary key per token in the pages; engine/layers/mla.py), the first
first_k_dense_replace layers dense, the rest sparse: sigmoid scores with a correction bias for the choice,
n_group groups of which the topk_group best are eligible, weights times routed_scaling_factor, and
n_shared_experts always-on experts. The checkpoint's multi-token-prediction layers
(`model.layers.{num_hidden_layers + i}`) are counted in num_nextn_predict_layers (the loader skips them unless
build_model is asked for them: engine/models/mtp.py)."""

from __future__ import annotations

import math
from typing import Any

from engine.arch import LatentArch, ModelArch, MoEArch
from engine.models.family import Family
from engine.models.hf_config import arch_fields, rope_params


def arch(hf: Any) -> ModelArch:
    num_groups = int(hf.n_group or 1)
    mla = LatentArch(
        kv_lora_rank=int(hf.kv_lora_rank),
        qk_nope_head_dim=int(hf.qk_nope_head_dim),
        qk_rope_head_dim=int(hf.qk_rope_head_dim),
        v_head_dim=int(hf.v_head_dim),
        q_lora_rank=int(hf.q_lora_rank or 0),
        rope_interleave=bool(getattr(hf, "rope_interleave", True)),
    )
    moe = MoEArch(
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
    return ModelArch(**arch_fields(
        hf,
        head_dim=int(hf.qk_rope_head_dim),  # the rotary part's width, which the rope tables cover
        attn_scale=mla_softmax_scale(hf),
        num_nextn_predict_layers=int(getattr(hf, "num_nextn_predict_layers", 0) or 0),
        moe=moe if moe.sparse_layers else None,
        mla=mla,
    ))  # fmt: skip


def mla_softmax_scale(hf: Any) -> float:
    """DeepSeek-V3's softmax scale: (qk_nope + qk_rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)
    squared when the rope is scaled (transformers' yarn_apply_mscale, the reference implementation's
    softmax_scale * mscale * mscale): the whole of q.k, not only its rotary dims, sees YaRN's scaling."""
    scale = float(hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5
    params = rope_params(hf)
    if params.get("rope_type", params.get("type", "default")) != "default":
        mscale_all_dim = params.get("mscale_all_dim") or 0
        factor = float(params["factor"])
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


FAMILY = Family("deepseek_v3", arch)
