"""What a model family's module declares (engine/models/<family>.py), for the registry to serve it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.arch import ModelArch
from engine.models.decoder import DecoderLayer

# A checkpoint tensor that holds several of the model's tensors stacked along its rows, by the name's
# suffix: ((the model tensor's suffix, its rows), ...) in order. Phi-3's `self_attn.qkv_proj.weight` is
# q_proj's rows, then k_proj's, then v_proj's.
Stacked = dict[str, tuple[tuple[str, int], ...]]


@dataclass(frozen=True)
class Family:
    """One model family: how its config becomes a ModelArch (its traits: norms, biases, latent attention,
    experts), how its checkpoint's tensor names map onto the shared decoder's (engine/models/decoder.py,
    whose parameter names are Hugging Face's Llama names), and its layer where it composes the shared parts
    differently (a subclass of DecoderLayer in the family's module)."""

    model_type: str  # config.json's model_type
    arch: Callable[[Any], ModelArch]  # a transformers config -> ModelArch
    stacked: Callable[[ModelArch], Stacked] | None = None  # None: every tensor loads under its own name
    layer: type[DecoderLayer] | None = None  # the family's variant of the decoder layer; None: DecoderLayer

    def stacked_tensors(self, arch: ModelArch) -> Stacked:
        return {} if self.stacked is None else self.stacked(arch)
