"""Mistral: Llama's layers; a config's sliding_window (without layer_types) slides every layer
(hf_config.arch_fields)."""

from __future__ import annotations

from typing import Any

from engine.arch import ModelArch
from engine.models.family import Family
from engine.models.hf_config import arch_fields


def arch(hf: Any) -> ModelArch:
    return ModelArch(**arch_fields(hf))


FAMILY = Family("mistral", arch)
