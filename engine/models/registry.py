"""The model families the engine serves: config.json's model_type -> its module's Family.

Adding a family is one module beside this one (engine/models/llama.py is the shortest) and one line here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.arch import ModelArch
from engine.errors import InvalidRequestError
from engine.models import deepseek_v3, gemma3, gpt_oss, llama, mistral, phi3, qwen2, qwen3, qwen3_moe
from engine.models.family import Family
from engine.quantization import fp8_format

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        llama.FAMILY,
        mistral.FAMILY,
        qwen2.FAMILY,
        qwen3.FAMILY,
        qwen3_moe.FAMILY,
        gemma3.FAMILY,
        gpt_oss.FAMILY,
        deepseek_v3.FAMILY,
        phi3.FAMILY,
    )
}


def family_of(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise InvalidRequestError(f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def arch_from_hf(hf: Any) -> ModelArch:
    """The ModelArch of a transformers config, by its family's module; refuses an unsupported family or
    quantization_config, naming it."""
    family = family_of(hf.model_type)
    fp8_format(getattr(hf, "quantization_config", None), None)  # refuses what the engine does not load
    return family.arch(hf)


def load_hf_config(folder: Path) -> Any:
    """The transformers config object (it normalises rope and layer_types across versions). A checkpoint
    that ships its own model code (config.json's auto_map) for a model_type no family here has is refused
    by name: no checkpoint code runs here, --trust-remote-code or not."""
    from transformers import AutoConfig

    raw = json.loads((folder / "config.json").read_text())
    if raw.get("auto_map") and raw.get("model_type") not in FAMILIES:
        raise InvalidRequestError(
            f"{folder.name} brings its own model code (config.json auto_map, model_type "
            f"{raw.get('model_type')!r}): pdserve runs no code from a checkpoint (--trust-remote-code changes "
            f"nothing); it serves {sorted(FAMILIES)}"
        )
    return AutoConfig.from_pretrained(str(folder))
