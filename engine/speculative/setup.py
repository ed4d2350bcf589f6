"""What the engine builds for `--speculative-config`, in the order its constructor needs them: the MTP
layers the model is built with (mtp_layers), the draft model and its pages' layout (load_draft_model),
then the Speculator over the engine's pool and scheduler (build_speculator)."""

from __future__ import annotations

from typing import Any

import torch

from engine.arch import ModelArch
from engine.config import EngineConfig
from engine.core.kv_cache import KVCache, KVLayout, layout_of
from engine.core.scheduler import Scheduler
from engine.errors import InvalidRequestError
from engine.layers.numerics import Numerics, pick_numerics
from engine.models.decoder import CausalLM
from engine.parallel import expert_parallel
from engine.speculative.draft_model import DraftDrafter, DraftSource, load_draft
from engine.speculative.mtp import MtpDrafter
from engine.speculative.speculator import Speculator


def max_drafts(config: EngineConfig) -> int:
    """Drafts per sequence and step, at most (0: no speculation)."""
    spec = config.speculative()
    return spec.num_speculative_tokens if spec is not None else 0


def mtp_layers(config: EngineConfig, arch: ModelArch, is_tp: bool) -> int:
    """The multi-token-prediction layers to build (method mtp: the first; none under --tp, which is refused
    later); InvalidRequestError for mtp on a checkpoint without them."""
    spec = config.speculative()
    if spec is None or spec.method != "mtp":
        return 0
    if not arch.num_nextn_predict_layers:
        raise InvalidRequestError(
            f"--speculative-config: method 'mtp' needs the checkpoint's multi-token-prediction layers; "
            f"{config.model} has none (num_nextn_predict_layers)"
        )
    return 0 if is_tp else 1


def load_draft_model(
    config: EngineConfig, arch: ModelArch, tokenizer: Any, dtype: torch.dtype, device: torch.device,
    max_positions: int, is_tp: bool,
) -> tuple[CausalLM | None, KVLayout | None]:
    """Method draft_model: the draft (engine/speculative/draft_model.py) and its page layout, which the
    pool's pages carry beside the target's; (None, None) otherwise (and under --tp / --ep, refused later)."""
    spec = config.speculative()
    if spec is None or spec.method != "draft_model" or is_tp or expert_parallel.current() is not None:
        return None, None
    assert spec.model is not None  # SpeculativeConfig checks it
    source = DraftSource(
        spec.model, config.download_dir, dtype, device, max_positions, config.load_format == "dummy", config.seed
    )
    draft = load_draft(source, arch, tokenizer)
    return draft, layout_of(draft.arch, config.block_size, dtype)


def build_speculator(
    config: EngineConfig, is_parallel: bool, model: CausalLM, draft: CausalLM | None, kv: KVCache,
    numerics: Numerics, scheduler: Scheduler, max_model_len: int, dtype: torch.dtype, vocab_size: int,
) -> Speculator | None:
    """The Speculator with its drafter (None without --speculative-config); InvalidRequestError under --tp
    or --ep (is_parallel). Method mtp needs the runner to keep its hidden states (Speculator.mtp)."""
    spec = config.speculative()
    if spec is None:
        return None
    if is_parallel:
        raise InvalidRequestError("--speculative-config does not run with --tp or --ep yet")
    device = kv.device
    mtp = MtpDrafter(model, kv, numerics, config.forward, scheduler) if spec.method == "mtp" else None
    drafter = None
    if draft is not None:
        draft_kv = kv.draft_cache(layout_of(draft.arch, config.block_size, dtype))
        draft_numerics = pick_numerics(config.is_deterministic, draft.row_functions, dtype, device)
        drafter = DraftDrafter(draft, draft_kv, draft_numerics, config.forward, scheduler, vocab_size)
    return Speculator(spec, scheduler, kv, max_model_len, mtp, drafter)
