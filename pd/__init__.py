"""pdserve's serving side: the processes, the HTTP APIs and the P/D paths (DESIGN.md, "Layers and layout")."""

from __future__ import annotations

import importlib.metadata


def _version() -> str:
    """The installed distribution's version (pyproject.toml's); "unknown" from a tree never installed."""
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


__version__ = _version()
