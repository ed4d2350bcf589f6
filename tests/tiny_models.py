"""Tiny random-weight Hugging Face checkpoints of every supported family, written to a folder.

Weights are drawn with a wide init (std 0.25) so greedy decoding has clear winners: near-uniform
logits would make every step a tie and the golden comparison meaningless."""

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


def make_tiny(family: str, folder: Path, seed: int = 0) -> Path:
    """Writes config.json + model.safetensors of a random tiny model; returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**COMMON, **FAMILIES[family]}
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if model_type == "gemma3_text" else 1.0, 0.1)
            else:
                p.normal_(0.0, 0.25 if p.dim() > 1 else 0.1)
    model.save_pretrained(str(folder))
    return folder
