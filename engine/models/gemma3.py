"""Gemma 3 (text): RMSNorms that scale by (1 + w) in float32, q/k norms, "sandwich" norms (after attention,
and before and after the MLP), embeddings scaled by sqrt(hidden_size), a GELU-tanh MLP, the softmax scale
query_pre_attn_scalar^-0.5, and sliding and full layers each with its own rope base (layer_types)."""

from __future__ import annotations

from typing import Any

from engine.arch import ModelArch
from engine.models.family import Family
from engine.models.hf_config import arch_fields


def arch(hf: Any) -> ModelArch:
    return ModelArch(**arch_fields(
        hf,
        qk_norm=True,
        unit_offset_norm=True,
        sandwich_norm=True,
        embed_scale=True,
        attn_scale=float(hf.query_pre_attn_scalar) ** -0.5,
    ))  # fmt: skip


FAMILY = Family("gemma3_text", arch)
