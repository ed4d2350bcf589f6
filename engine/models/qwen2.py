"""Qwen2 (and Qwen2.5): Llama's layers with biases on the q/k/v projections, whatever the config says
(transformers' Qwen2Attention always has them)."""

from __future__ import annotations

from typing import Any

from engine.arch import ModelArch
from engine.models.family import Family
from engine.models.hf_config import arch_fields


def arch(hf: Any) -> ModelArch:
    return ModelArch(**arch_fields(hf, attention_bias=True))


FAMILY = Family("qwen2", arch)
