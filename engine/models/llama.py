"""Llama (SmolLM2, Llama 2 and 3): the pre-norm decoder with RMSNorm, rotary, grouped-query attention and a
SiLU-gated MLP, as the shared decoder builds it, with no switch turned."""

from __future__ import annotations

from typing import Any

from engine.arch import ModelArch
from engine.models.family import Family
from engine.models.hf_config import arch_fields


def arch(hf: Any) -> ModelArch:
    return ModelArch(**arch_fields(hf))


FAMILY = Family("llama", arch)
