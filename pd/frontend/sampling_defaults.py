"""The sampling values a request gets for the fields it leaves out (`--generation-config`, vLLM's).

    auto    the checkpoint's generation_config.json: what its authors recommend (vLLM's default)
    vllm    none: temperature 1, no top-p / top-k / min-p, no repetition penalty
    FOLDER  the generation_config.json in FOLDER

Only the sampling fields are taken, as vLLM takes them (max_new_tokens is not: a request's max_tokens
defaults to what its context leaves). A field the request sets, null aside, wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
BEAM_KEYS = ("temperature",)  # beam search ranks by the model's logprobs: the other fields do not apply to it


def sampling_defaults(setting: str, model_folder: Path) -> dict[str, Any]:
    """The defaults --generation-config `setting` gives for the checkpoint in model_folder (ValueError
    names a file that is no JSON object or a value that is no number)."""
    if setting == "vllm":
        return {}
    path = (model_folder if setting == "auto" else Path(setting)) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    out = {k: raw[k] for k in SAMPLING_KEYS if raw.get(k) is not None}
    for key, value in out.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{path}: {key} must be a number, got {value!r}")
    return out


def with_defaults(body: Any, defaults: dict[str, Any]) -> Any:
    """body (a request's JSON) with the defaults of the fields it leaves out or sets to null."""
    if not defaults or not isinstance(body, dict):
        return body
    keys = BEAM_KEYS if body.get("use_beam_search") else SAMPLING_KEYS
    missing = {k: defaults[k] for k in keys if k in defaults and body.get(k) is None}
    return {**body, **missing} if missing else body
