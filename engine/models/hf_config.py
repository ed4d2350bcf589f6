"""Reading a Hugging Face config: the fields every family shares, rope tables, EOS ids (a family's own
fields: its module, engine/models/<family>.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.arch import FULL, SLIDING


def arch_fields(hf: Any, **overrides: Any) -> dict[str, Any]:
    """ModelArch's fields that every family reads the same way from its Hugging Face config (head_dim from
    the config or hidden_size / heads; a sliding_window without layer_types slides every layer, as Mistral
    does; the softmax scale head_dim^-0.5), with a family's overrides applied on top."""
    num_heads = hf.num_attention_heads
    head_dim = overrides.get("head_dim") or getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:  # a window means every layer slides
        layer_types = [SLIDING if window else FULL] * hf.num_hidden_layers
    if SLIDING not in layer_types:
        window = None
    fields: dict[str, Any] = dict(
        model_type=hf.model_type,
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
        hidden_act=str(getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")),
        attn_scale=head_dim**-0.5,
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096)),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
    )
    fields.update(overrides)
    return fields


def rope_params(hf: Any) -> dict[str, Any]:
    """The config's rope parameters (transformers 5 folds a legacy rope_scaling into rope_parameters)."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:  # older transformers
        params = {"rope_type": "default", "rope_theta": getattr(hf, "rope_theta", 10000.0)}
        if getattr(hf, "rope_scaling", None):
            params.update(hf.rope_scaling)
    return dict(params)


def rope_inv_freq(hf: Any, layer_type: str, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale for one layer type, as transformers computes them."""
    params = rope_params(hf)
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
