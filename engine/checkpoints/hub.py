"""Models by Hugging Face hub id: `ORG/NAME` (at a branch, tag or commit: `ORG/NAME@REVISION` or a
revision argument) resolved to a snapshot folder of huggingface_hub's own cache.

The cache is huggingface_hub's ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; a
`cache_dir`, the server's --download-dir, replaces it), so a model any Hugging Face tool downloaded is
found there. $HF_TOKEN reaches gated and private repositories, $HF_HUB_OFFLINE=1 reads the cache alone,
$HF_ENDPOINT names a mirror. Only the files the engine reads are downloaded (ALLOW_PATTERNS).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tqdm.auto import tqdm

from engine.errors import ModelNotFoundError

# An organisation or user, a slash, a repository name (the hub's own rule: letters, digits, `-_.`).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# What the engine and the HTTP side read: the config, the generation config (EOS ids), the tokenizer
# and its chat template, the safetensors weights and their index.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",  # tokenizer.json, tokenizer_config.json, tokenizer.model (sentencepiece)
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",  # chat_template.jinja, chat_template.json
]
# Never a subfolder (original/ holds Meta's .pth release, others GGUF or ONNX copies), nor Mistral's
# consolidated.safetensors (the same weights again, under other names).
IGNORE_PATTERNS = ["*/*", "consolidated*"]
# Without a terminal, a bar is a log line: one every this many seconds, not one per chunk.
LOG_BAR_INTERVAL_S = 10.0


@dataclass(frozen=True)
class HubModel:
    """One model on the hub, at a revision (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def parse_hub_model(model: str, revision: str | None = None) -> HubModel | None:
    """The hub model `model` names (`ORG/NAME` or `ORG/NAME@REVISION`; `revision` as the latter), or None
    when it is no hub id. ValueError: an empty `@`, or `@REVISION` and `revision` that disagree."""
    name, at, rev = model.partition("@")
    if not HUB_ID.fullmatch(name):
        return None
    if at and not rev:
        raise ValueError(f"model {model!r}: nothing after '@' (ORG/NAME@REVISION)")
    if at and revision is not None and rev != revision:
        raise ValueError(f"model {model!r} names revision {rev!r}, --revision says {revision!r}")
    return HubModel(name, rev or revision or None)


class _Progress(tqdm):  # type: ignore[misc]
    """huggingface_hub's bars, shown in a log too (its own class draws nothing without a terminal)."""

    opened: ClassVar[list[tqdm]] = []  # closed by download(): huggingface_hub leaves its byte bars open

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # huggingface_hub's bar group, which plain tqdm refuses
        if not sys.stderr.isatty():
            kwargs.setdefault("mininterval", LOG_BAR_INTERVAL_S)
        super().__init__(*args, **kwargs)
        _Progress.opened.append(self)


def _snapshot(model: HubModel, cache_dir: str | None) -> Path:
    """snapshot_download of the engine's files, its progress bars closed before it returns or raises."""
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(
            snapshot_download(
                model.repo_id,
                revision=model.revision,
                cache_dir=cache_dir,
                allow_patterns=ALLOW_PATTERNS,
                ignore_patterns=IGNORE_PATTERNS,
                tqdm_class=None if constants.HF_HUB_DISABLE_PROGRESS_BARS else _Progress,
            )
        )
    finally:
        while _Progress.opened:
            _Progress.opened.pop().close()


def download(model: HubModel, cache_dir: str | None = None) -> Path:
    """The snapshot folder of `model` in the cache, downloading what is missing (with a progress bar on
    stderr unless $HF_HUB_DISABLE_PROGRESS_BARS is set). ModelNotFoundError says in one line what went
    wrong and what to do: gated, missing, an unknown revision, offline and not cached, no weights."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = cache_dir or constants.HF_HUB_CACHE
    page = f"{constants.ENDPOINT}/{model.repo_id}"
    try:
        folder = _snapshot(model, cache_dir)
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{model} is a gated model: accept its terms at {page} with your account, then set HF_TOKEN "
            "to a token of that account"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(
            f"{model}: the repository has no revision {model.revision!r} (a branch, tag or commit; see {page})"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{model}: no such model on {constants.ENDPOINT} (check the name; for a private model set "
            "HF_TOKEN to a token that can read it)"
        ) from None
    except LocalEntryNotFoundError as e:  # not cached (or only partly), and the hub out of reach
        if constants.HF_HUB_OFFLINE:
            why = (
                f"HF_HUB_OFFLINE is set: download it into this cache first (`pdserve download {model}` "
                "where the hub is reachable) or unset HF_HUB_OFFLINE"
            )
        else:
            why = f"{constants.ENDPOINT} is out of reach ({type(e.__cause__ or e).__name__}): check the network or HF_ENDPOINT"
        raise ModelNotFoundError(f"{model} is not (fully) in the cache {cache} and {why}") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "no answer"
        raise ModelNotFoundError(f"{model}: {constants.ENDPOINT} answered {status} ({str(e).splitlines()[0]})") from None
    except OSError as e:  # the cache's disk (full, not writable)
        raise ModelNotFoundError(f"{model}: the download into {cache} failed: {e}") from None
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"{model} has no config.json: not a transformers checkpoint ({folder})")
    if not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"{model} has no *.safetensors weights (pdserve loads safetensors only, not .bin, .pth or .gguf)"
        )
    return folder
