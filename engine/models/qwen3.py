"""Qwen3: Llama's layers with an RMSNorm over each head's q and k before the rotary (qk_norm)."""

from __future__ import annotations

from typing import Any

from engine.arch import ModelArch
from engine.models.family import Family
from engine.models.hf_config import arch_fields


def arch(hf: Any) -> ModelArch:
    return ModelArch(**arch_fields(hf, qk_norm=True))


FAMILY = Family("qwen3", arch)
