"""Qwen3-MoE (Qwen3-30B-A3B's architecture): Qwen3's attention; sparse layers of routed SwiGLU experts
(softmax over every expert, top-k, renormalized when norm_topk_prob; no shared expert), the layers
mlp_only_layers names and those off decoder_sparse_step keep the dense MLP, as transformers picks them."""

from __future__ import annotations

from typing import Any

from engine.arch import ModelArch, MoEArch
from engine.models.family import Family
from engine.models.hf_config import arch_fields


def arch(hf: Any) -> ModelArch:
    num_experts = int(getattr(hf, "num_experts", None) or 0)
    if num_experts == 0:  # a config without experts is Qwen3 with dense layers
        return ModelArch(**arch_fields(hf, qk_norm=True))
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1))
    moe = MoEArch(
        sparse_layers=tuple(i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0),
        num_experts=num_experts,
        num_experts_per_tok=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(hf.moe_intermediate_size),
        norm_topk_prob=bool(hf.norm_topk_prob),
        routing="softmax_topk",
    )
    return ModelArch(**arch_fields(hf, qk_norm=True, moe=moe))


FAMILY = Family("qwen3_moe", arch)
