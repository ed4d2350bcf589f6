"""Phi-3 (Phi-3-mini, Phi-3-medium; transformers' Phi3ForCausalLM): Llama's layers, with q, k and v stored as
one `self_attn.qkv_proj` and the MLP's gate and up as one `mlp.gate_up_proj` (gate rows first), which load
into the decoder's own projections (the CUDA path stacks them again after loading). A sliding_window slides
every layer. Refused by name: partial rotary (partial_rotary_factor below 1, Phi-4-mini) and the
"longrope" scaling of the 128k releases, which switches its factors by sequence length."""

from __future__ import annotations

from typing import Any

from engine.arch import ModelArch
from engine.errors import InvalidRequestError
from engine.models.family import Family, Stacked
from engine.models.hf_config import arch_fields, rope_params


def arch(hf: Any) -> ModelArch:
    rope = rope_params(hf)
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise InvalidRequestError(
            f"phi3: rope_parameters.partial_rotary_factor {rope['partial_rotary_factor']} is not supported "
            "(the engine rotates every dim of a head)"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise InvalidRequestError(
            f"phi3: rope_parameters.rope_type {rope_type!r} is not supported (longrope picks its factors by the "
            "sequence's length; the engine's rotary tables are fixed)"
        )
    return ModelArch(**arch_fields(hf))


def stacked(arch: ModelArch) -> Stacked:
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {
        "self_attn.qkv_proj.weight": (
            ("self_attn.q_proj.weight", q_rows), ("self_attn.k_proj.weight", kv_rows),
            ("self_attn.v_proj.weight", kv_rows),
        ),
        "mlp.gate_up_proj.weight": (
            ("mlp.gate_proj.weight", arch.intermediate_size), ("mlp.up_proj.weight", arch.intermediate_size),
        ),
    }  # fmt: skip


FAMILY = Family("phi3", arch, stacked)
