"""Builds the model on the meta device, then materializes it straight from safetensors (or with
random weights for `--load-format dummy`, how benchmarks get real-sized models without a download)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch

from engine.model import CausalLM
from engine.model_config import ModelArch, rope_inv_freq

SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(
    arch: ModelArch,
    hf_config: Any,
    folder: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    is_dummy: bool = False,
    seed: int = 0,
) -> CausalLM:
    inv_freqs = {t: rope_inv_freq(hf_config, t, arch.head_dim) for t in set(arch.layer_types)}
    with torch.device("meta"):
        model = CausalLM(arch, inv_freqs)
    model.to_empty(device=device)
    model.to(dtype)
    if is_dummy:
        _init_random(model, arch, seed)
    else:
        assert folder is not None
        _load_safetensors(model, folder)
    model.rotary.build(max_positions, dtype, device)
    if device.type == "cuda":
        model.fuse_projections()
    model.eval().requires_grad_(False)
    return model


def _init_random(model: CausalLM, arch: ModelArch, seed: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(0.0 if arch.gemma_norm else 1.0)
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            # Generated on the device in slices when possible: an 8B model's weights on the host are slow.
            if p.device.type == "cuda":
                torch.manual_seed(seed + zlib.crc32(name.encode()))
                p.data.normal_(0.0, 0.02)
            else:
                p.data.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def _load_safetensors(model: CausalLM, folder: Path) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = set(json.loads(index.read_text())["weight_map"].values())
        files = [folder / n for n in sorted(names)]
    loaded: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for key in st.keys():
                name = key.removeprefix("language_model.")
                if name.endswith(SKIPPED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and "lm_head.weight" not in params:
                    continue  # tied embeddings saved twice
                if name not in params:
                    raise KeyError(f"checkpoint tensor {key!r} has no place in the model")
                t = st.get_tensor(key)
                p = params[name]
                if t.shape != p.shape:
                    raise ValueError(f"{key}: checkpoint shape {tuple(t.shape)} != model {tuple(p.shape)}")
                p.data.copy_(t.to(p.dtype))
                loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise KeyError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
