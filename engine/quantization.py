"""FP8 checkpoint formats the engine loads: block-scaled e4m3 weights, as DeepSeek-V3/R1 and the Qwen3
`*-FP8` releases ship them (the weights' layout and compute: engine/layers/fp8.py).

A quantized weight W [..., N, K] is stored as `float8_e4m3fn` values plus one float32 `weight_scale_inv`
per BLOCK x BLOCK block, [..., ceil(N / BLOCK), ceil(K / BLOCK)] (the last row and column of blocks may
be partial). config.json says so with `quantization_config` = {"quant_method": "fp8", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]} (optionally "fmt": "e4m3" and "modules_to_not_convert");
`fp8_format` accepts exactly that and refuses anything else, naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import InvalidRequestError

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization's values
SCALE_SUFFIX = "_scale_inv"  # "<weight name>_scale_inv", e.g. q_proj.weight_scale_inv, experts.gate_up_proj_scale_inv

# quantization_config keys and the values the engine implements; any other key is refused
_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "quant_method": ("fp8",),
    "activation_scheme": ("dynamic",),
    "weight_block_size": ([BLOCK, BLOCK],),
    "fmt": ("e4m3",),
    # "ue8m0" (DeepSeek-V3.1): the scales are powers of two, still stored as float32 tensors; the loader refuses
    # scales stored as bytes
    "scale_fmt": ("float", "ue8m0"),
}
_IGNORED = ("modules_to_not_convert",)  # read separately; a list of module names


@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint's (or --quantization's) FP8 format: BLOCK x BLOCK e4m3 blocks with float32 scales."""

    is_prequantized: bool  # the checkpoint ships FP8 weights (else: quantized at load)
    modules_to_not_convert: tuple[str, ...] = ()

    def keeps_float(self, module: str) -> bool:
        """Whether modules_to_not_convert names this module (whole dotted components, anywhere in the name)."""
        return any(f".{m}." in f".{module}." for m in self.modules_to_not_convert)


def fp8_format(quantization_config: Any, quantization: str | None) -> Fp8Format | None:
    """The FP8 format of a checkpoint whose config.json has quantization_config (None: none), loaded with
    EngineConfig.quantization; None: float weights. Refuses what the engine does not implement, naming the
    field."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise InvalidRequestError(f"quantization {quantization!r}: one of {QUANTIZATIONS}")
    if not quantization_config:
        return Fp8Format(is_prequantized=False) if quantization == "fp8" else None
    q = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    method = q.get("quant_method")
    if method not in _ACCEPTED["quant_method"]:
        raise InvalidRequestError(
            f"quantization_config.quant_method {method!r} is not supported: the engine loads float checkpoints and "
            f"block-scaled FP8 ones (quant_method \"fp8\", weight_block_size [{BLOCK}, {BLOCK}])"
        )
    if "weight_block_size" not in q or q["weight_block_size"] is None:
        raise InvalidRequestError(
            "quantization_config.weight_block_size is missing: the engine loads block-scaled FP8 only "
            f"([{BLOCK}, {BLOCK}] blocks, one weight_scale_inv per block), not per-tensor scales"
        )
    for key, value in q.items():
        if key in _IGNORED or value is None and key != "quant_method":
            continue
        if key not in _ACCEPTED:
            raise InvalidRequestError(f"quantization_config.{key} is not supported (the engine knows "
                                      f"{sorted([*_ACCEPTED, *_IGNORED])})")
        value = list(value) if isinstance(value, tuple) else value
        if isinstance(value, str):
            value = value.lower()
        if value not in _ACCEPTED[key]:
            reason = {
                "activation_scheme": "activations are quantized per token group at run time; static activation "
                "scales are not implemented",
                "weight_block_size": f"FP8 weights load in {BLOCK}x{BLOCK} blocks only",
                "fmt": "FP8 weights are float8_e4m3fn",
                "scale_fmt": "the scales are float32 values",
            }.get(key, "")
            raise InvalidRequestError(
                f"quantization_config.{key} {q[key]!r} is not supported: one of {list(_ACCEPTED[key])} ({reason})"
            )
    skip = q.get("modules_to_not_convert") or ()
    if not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) for m in skip):
        raise InvalidRequestError("quantization_config.modules_to_not_convert must be a list of module names")
    return Fp8Format(is_prequantized=True, modules_to_not_convert=tuple(skip))


def scale_shape(shape: Iterable[int]) -> tuple[int, ...]:
    """A weight's [..., N, K] -> its scales' [..., ceil(N / BLOCK), ceil(K / BLOCK)]."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / BLOCK), math.ceil(k / BLOCK))
