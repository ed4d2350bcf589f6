"""gpt-oss: attention with a learned sink logit per head (no value) and biases on every projection, the
output's too; every layer sparse, routed by a softmax over the top-k router logits, with clamped SwiGLU
experts that have biases, stored gate/up interleaved ([E, H, 2I], the loader converts: "interleaved")."""

from __future__ import annotations

from typing import Any

from engine.arch import ModelArch, MoEArch
from engine.models.family import Family
from engine.models.hf_config import arch_fields


def arch(hf: Any) -> ModelArch:
    has_bias = bool(getattr(hf, "attention_bias", False))
    top_k = getattr(hf, "num_experts_per_tok", None) or hf.experts_per_token  # the name varies by version
    moe = MoEArch(
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
    return ModelArch(**arch_fields(hf, o_proj_bias=has_bias, attn_sinks=True, moe=moe))


FAMILY = Family("gpt_oss", arch)
