"""Builds the model on the meta device, then materializes it straight from safetensors (or with
random weights for `--load-format dummy`, how benchmarks get real-sized models without a download).

Tensors load by name. The one renaming: MoE experts, which the model stacks (engine/layers/moe.py) while
Hugging Face checkpoints (and transformers 5's save_pretrained) store one tensor per expert and
projection, `mlp.experts.{e}.{gate,up,down}_proj.weight`; each lands in its slice of the stack. A
checkpoint with the stacked `mlp.experts.gate_up_proj` / `down_proj` loads as is, except in gpt-oss's
layout (ModelArch.expert_layout "interleaved"), which `to_model_layout` converts:

    checkpoint  gate_up_proj [E, H, 2I], column 2i gate i, 2i + 1 up i; its bias [E, 2I] alike;
                down_proj [E, I, H]
    model       gate_up_proj [E, 2I, H], rows [0, I) gate, [I, 2I) up; its bias [E, 2I] alike;
                down_proj [E, H, I]

An expert-parallel rank reads only its experts' rows of every stacked tensor (biases included); a
tensor-parallel rank only its slice of each split tensor (engine/parallel/tensor_parallel.py TpShard.slice_of:
heads, intermediate rows, vocabulary rows; an FP8 weight's block scales sliced with it, at block edges).

A DeepSeek-V3 checkpoint's multi-token-prediction layers (`model.layers.{num_layers + i}.*`, i below
num_nextn_predict_layers) draft tokens for speculative decoding: the first `mtp_layers` load into CausalLM.mtp
(engine/models/mtp.py maps their names; the layer's copy of the embedding must equal the model's, which it
shares), the rest are skipped with one log line (all of them by default). Its router (`mlp.gate`, a ScoreGate) stays in float32 whatever the model's dtype, as in transformers.

FP8 weights (engine/layers/fp8.py): the modules `fp8_modules` picks get FP8 weights and `*_scale_inv` block scales
before loading; a checkpoint's FP8 tensors and scales load as they are (per-expert scales into their rows of
the stacked scales, like the weights), and a float tensor bound for an FP8 weight (`--quantization fp8`) is
quantized as it loads, one tensor at a time."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import struct
import time
import zlib
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from engine.arch import ModelArch
from engine.checkpoints.load_progress import LoadProgress
from engine.errors import InvalidRequestError
from engine.layers import fp8
from engine.layers.meta import on_meta
from engine.layers.moe import ExpertWeights, ScoreGate, SparseMoE
from engine.models import mtp
from engine.models.decoder import CausalLM
from engine.models.family import Stacked
from engine.models.hf_config import rope_inv_freq
from engine.models.registry import family_of
from engine.parallel import expert_parallel
from engine.parallel.tensor_parallel import TensorGroup, TpShard, full_shape, scale_slice, take

log = logging.getLogger(__name__)
# the start's progress (a large model loads for minutes), apart from what the load found (log)
progress = logging.getLogger(f"{__name__}.progress")

SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
PER_EXPERT_KEY = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?")
LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")


def is_nextn_layer(arch: ModelArch, name: str) -> bool:
    """Whether a checkpoint tensor belongs to a multi-token-prediction layer (the module docstring)."""
    match = LAYER_KEY.match(name)
    return match is not None and 0 <= int(match.group(1)) - arch.num_layers < arch.num_nextn_predict_layers


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate/up alternating along dim 1 -> all gates, then all ups."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def expert_layout(arch: ModelArch) -> str:
    """How the checkpoint stores its stacked experts (MoEArch.expert_layout; "stacked" for a dense model)."""
    return "stacked" if arch.moe is None else arch.moe.expert_layout


def to_model_layout(layout: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """A stacked expert tensor (an expert-parallel rank's rows of it) as the model stores it (see the
    module docstring); unchanged for the "stacked" layout and for any other name."""
    if layout != "interleaved":
        return t
    if name.endswith(".experts.gate_up_proj"):
        return _deinterleave(t.transpose(1, 2))
    if name.endswith(".experts.gate_up_proj_bias"):
        return _deinterleave(t)
    if name.endswith(".experts.down_proj"):
        return t.transpose(1, 2)
    return t


def expert_slice(
    params: Mapping[str, torch.Tensor], name: str, experts: Mapping[str, tuple[int, int]]
) -> tuple[str, tuple[int, str], torch.Tensor | None] | None:
    """For a per-expert checkpoint name: (stacked parameter name, (expert, projection), the slice of the
    stacked parameter it fills, or None for an expert another expert-parallel rank holds); None for
    any other name. gate_up_proj holds gate rows, then up rows. experts: stacked parameter -> (first
    expert held, total experts of the layer)."""
    match = PER_EXPERT_KEY.fullmatch(name)
    if match is None:
        return None
    prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
    target = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
    target += match.group(4) or ""  # an FP8 weight's block scales: the same rows of the stacked scales
    if target not in params:
        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
    p = params[target].data
    first, total = experts.get(target, (0, p.shape[0]))
    if expert >= total:
        raise KeyError(f"checkpoint tensor {name!r}: the model has {total} experts")
    local = expert - first
    if not 0 <= local < p.shape[0]:
        return target, (expert, proj), None
    rows = p.shape[1] // 2
    view = {"down_proj": p[local], "gate_proj": p[local, :rows], "up_proj": p[local, rows:]}[proj]
    return target, (expert, proj), view


def held_experts(model: CausalLM) -> dict[str, tuple[int, int]]:
    """Each stacked expert parameter's name (biases included) -> (first expert this rank holds, the
    layer's experts)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            for proj, _ in module.experts.named_parameters():
                out[f"{name}.experts.{proj}"] = (module.first_local, module.num_experts)
    return out


def build_model(
    arch: ModelArch,
    hf_config: Any,
    folder: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    is_dummy: bool = False,
    seed: int = 0,
    fp8_format: fp8.Fp8Format | None = None,
    tp: TensorGroup | None = None,
    mtp_layers: int = 0,
) -> CausalLM:
    """The model with its weights; with fp8_format, the modules fp8_modules picks hold FP8 weights; with
    tp, this tensor-parallel rank's share of it. mtp_layers: how many of the checkpoint's multi-token-prediction
    layers to build and load into model.mtp (engine/models/mtp.py; arch's own num_mtp_layers is replaced by it):
    model.arch.num_mtp_layers says so, and layout_of(model.arch, ...) gives each one more full layer of KV. More
    than the checkpoint's num_nextn_predict_layers is a ValueError; so is any under --tp or --ep."""
    t0 = time.monotonic()
    progress.info("loading the weights of %s (%s) on %s", folder.name if folder else "dummy weights", dtype, device)
    arch = dataclasses.replace(arch, num_mtp_layers=mtp_layers)
    inv_freqs = {t: rope_inv_freq(hf_config, t, arch.head_dim) for t in set(arch.layer_types)}
    shard = None
    if tp is not None:  # under --ep too (engine/parallel/world.py): the routed experts held whole, split across its group
        shard = TpShard(tp.rank, tp.size, arch, splits_experts=expert_parallel.current() is None)
    with on_meta():
        model = CausalLM(arch, inv_freqs, tp, shard, family_of(arch.model_type).layer)
    # dtypes and FP8 modules settled on the meta device, so the device holds only the final weights (a
    # 30B MoE's FP8 experts, never their bf16 form first)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, ScoreGate):
            module.float()
    if fp8_format is not None:  # NOTE: after model.to(dtype), which would cast FP8 weights
        keys = None if is_dummy or not fp8_format.is_prequantized else checkpoint_keys(cast(Path, folder), arch)
        names = fp8_modules(model, fp8_format, keys)
        to_fp8(model, names)
        if shard is not None:
            for name in names:
                shard.check_fp8_blocks(name + ".weight")
        log.info(
            "FP8 weights (128x128 blocks, %s): %d modules; FP8 GEMM and GEMV on FP8 tensor cores, dequantized "
            "products elsewhere",
            "as the checkpoint ships them" if keys is not None else "quantized at load", len(names),
        )  # fmt: skip
    model.to_empty(device=device)
    if is_dummy:
        _init_random(model, arch, seed, shard)
    else:
        assert folder is not None
        _load_safetensors(model, folder, shard)
    model.rotary.build(max_positions, dtype, device)
    if device.type == "cuda":
        model.fuse_projections()
        for module in model.modules():
            if isinstance(module, fp8.Fp8Linear):
                module.prepare_kernels()
    model.eval().requires_grad_(False)
    progress.info("weights loaded in %.1f s", time.monotonic() - t0)
    return model


# ---- FP8 weights (engine/layers/fp8.py) ------------------------------------------------------------------


def fp8_candidates(model: CausalLM) -> dict[str, nn.Module]:
    """The modules that may hold FP8 weights: every float nn.Linear but the MoE routers, and the stacked
    experts of every MoE layer."""
    routers = {id(m.router_linear) for m in model.modules() if isinstance(m, SparseMoE)}  # the MTP layers' too
    return {
        name: m for name, m in model.named_modules()
        if isinstance(m, ExpertWeights) or (type(m) is nn.Linear and id(m) not in routers)
    }  # fmt: skip


def fp8_modules(model: CausalLM, fmt: fp8.Fp8Format, checkpoint: set[str] | None) -> list[str]:
    """The modules that hold FP8 weights: with a pre-quantized checkpoint's tensor names, those it ships a
    `*_scale_inv` for; else (quantized at load, dummy weights) every candidate of the decoder layers that
    modules_to_not_convert does not name (embeddings, lm_head and routers stay float; of an MTP layer, the
    decoder layer's, as the releases ship them)."""
    candidates = fp8_candidates(model)
    if checkpoint is None:
        return [
            n for n in candidates
            if (n.startswith("model.layers.") or _is_mtp_block(n)) and not fmt.keeps_float(mtp.checkpoint_name(model.arch, n))
        ]  # fmt: skip
    chosen: set[str] = set()
    for key in checkpoint:
        if not key.endswith(fp8.SCALE_SUFFIX):
            continue
        match = PER_EXPERT_KEY.fullmatch(key)
        if match is not None:
            module = match.group(1)
        elif key.endswith(".weight" + fp8.SCALE_SUFFIX):
            module = key.removesuffix(".weight" + fp8.SCALE_SUFFIX)
        else:  # stacked experts: <experts>.gate_up_proj_scale_inv, <experts>.down_proj_scale_inv
            module = key.rsplit(".", 1)[0]
        layout = expert_layout(model.arch)
        if module in candidates and isinstance(candidates[module], ExpertWeights) and layout != "stacked":
            raise InvalidRequestError(
                f"checkpoint tensor {key!r}: FP8 experts in the {layout!r} layout do not load (their "
                "blocks would need re-tiling); load the float checkpoint with --quantization fp8"
            )
        if module not in candidates:
            raise InvalidRequestError(
                f"checkpoint tensor {key!r}: FP8 weights for a module that has no FP8 form in the engine (its "
                "linear projections and MoE experts do; embeddings, norms and routers load in float)"
            )
        chosen.add(module)
    return sorted(chosen)


def _is_mtp_block(name: str) -> bool:
    """Whether a model name is inside an MTP layer's decoder layer (mtp.{j}.block.*)."""
    parts = name.split(".", 3)
    return len(parts) > 3 and parts[0] == "mtp" and parts[2] == "block"


def to_fp8(model: CausalLM, names: list[str]) -> None:
    """Gives the named modules (fp8_candidates) empty FP8 weights and block scales, to be loaded."""
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, ExpertWeights):
            module.to_fp8()
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, fp8.Fp8Linear.like(cast(nn.Linear, module)))


def checkpoint_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files (those the index names, if there is one)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = set(json.loads(index.read_text())["weight_map"].values())
        files = [folder / n for n in sorted(names)]
    return files


def tensor_bytes(path: Path) -> dict[str, int]:
    """Each tensor's bytes in a safetensors file, from its header (no tensor is read)."""
    with path.open("rb") as f:
        (header_bytes,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_bytes))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def checkpoint_keys(folder: Path, arch: ModelArch) -> set[str]:
    """The names of the checkpoint's tensors as the model's: the built multi-token-prediction layers' mapped
    (engine/models/mtp.py), the others left out."""
    from safetensors import safe_open

    keys: set[str] = set()
    for f in checkpoint_files(folder):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            keys.update(k.removeprefix("language_model.") for k in st.keys())
    out = set()
    for k in keys:
        name = mtp.model_name(arch, k)
        if name is not None:
            out.add(name)
        elif not is_nextn_layer(arch, k):
            out.add(k)
    return out


# ---- weights -------------------------------------------------------------------------------------


def _init_random(model: CausalLM, arch: ModelArch, seed: int, shard: TpShard | None = None) -> None:
    """Random weights; FP8 ones drawn in float32 as float ones are, then quantized (their scales with them).
    A tensor-parallel rank draws each split tensor whole and keeps its slice, so every --tp gives the same
    weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    experts = held_experts(model)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith(fp8.SCALE_SUFFIX):
            continue  # filled with its weight
        target = p.data if not fp8.is_fp8(p) else torch.empty(p.shape, dtype=torch.float32, device=p.device)
        part = shard.slice_of(name) if shard is not None else None
        if part is not None and not name.endswith("bias"):
            whole = _random_(target.new_empty(full_shape(tuple(p.shape), part)), name, gen, seed)
            target.copy_(take(whole, part))
        elif name.endswith("bias"):  # expert biases too, on every rank
            target.zero_()
        elif name in experts and p.shape[0] != experts[name][1]:
            # an expert-parallel rank's experts: drawn as the whole layer's, then sliced, so every
            # --ep gives the same weights
            first, total = experts[name]
            whole = _random_(target.new_empty((total, *p.shape[1:])), name, gen, seed)
            target.copy_(whole[first : first + p.shape[0]])
        elif name.endswith("norm.weight"):
            target.fill_(0.0 if arch.unit_offset_norm else 1.0)
        else:
            _random_(target, name, gen, seed)
        if fp8.is_fp8(p):
            q, scale = fp8.quantize(target)
            p.data.copy_(q)
            params[name + fp8.SCALE_SUFFIX].data.copy_(scale)


def _random_(t: torch.Tensor, name: str, gen: torch.Generator, seed: int) -> torch.Tensor:
    """Fills t with N(0, 0.02) weights, in place: on CUDA from a seed of the parameter's name (an 8B
    model's weights drawn on the host are slow), on the CPU from the model's one generator, in
    parameter order."""
    if t.device.type == "cuda":
        torch.manual_seed(seed + zlib.crc32(name.encode()))
        return t.normal_(0.0, 0.02)
    return t.copy_(torch.randn(t.shape, generator=gen) * 0.02)


class _Destinations:
    """Where each checkpoint tensor goes in the model, and which parameters have been filled."""

    def __init__(self, model: CausalLM) -> None:
        self.params = dict(model.named_parameters())
        self.experts = held_experts(model)
        self.loaded: set[str] = set()
        self.expert_parts: dict[str, set[tuple[int, str]]] = {}  # stacked parameter -> (expert, projection) loaded

    def of(self, name: str) -> torch.Tensor | None:
        """The parameter (or slice of a stacked expert parameter) a tensor of this name fills, marked as
        filled; None for an expert another expert-parallel rank holds."""
        part = expert_slice(self.params, name, self.experts)
        if part is not None:
            target, piece, view = part
            if view is not None:
                self.expert_parts.setdefault(target, set()).add(piece)
            return view
        if name not in self.params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
        self.loaded.add(name)
        return self.params[name].data

    def missing(self) -> set[str]:
        for target, pieces in self.expert_parts.items():
            is_down = target.rsplit(".", 1)[1].startswith("down_proj")  # the weight or its scales
            per_expert = 1 if is_down else 2  # gate_up_proj: gate and up
            if len(pieces) == self.params[target].shape[0] * per_expert:
                self.loaded.add(target)
        return set(self.params) - self.loaded


def stacked_pieces(stacked: Stacked, name: str) -> list[tuple[str, int, int]] | None:
    """A checkpoint tensor that stacks several of the model's along its rows (Family.stacked): each one's
    name and rows [start, stop); None for any other tensor. FP8 scales of a stacked tensor are refused (their
    blocks would straddle the pieces)."""
    for suffix, parts in stacked.items():
        base = name.removesuffix(fp8.SCALE_SUFFIX)
        if not base.endswith("." + suffix):
            continue
        if base != name:
            raise InvalidRequestError(f"checkpoint tensor {name!r}: FP8 scales of a stacked projection do not load")
        prefix = name.removesuffix(suffix)
        out, start = [], 0
        for piece, rows in parts:
            out.append((prefix + piece, start, start + rows))
            start += rows
        return out
    return None


def _load_safetensors(model: CausalLM, folder: Path, shard: TpShard | None = None) -> None:
    from safetensors import safe_open

    dests = _Destinations(model)
    params, experts = dests.params, dests.experts
    arch = model.arch
    layout = expert_layout(arch)
    stacked = family_of(arch.model_type).stacked_tensors(arch)

    def place(name: str, key: str, source: Any, read: Callable[[], torch.Tensor] | None = None) -> None:
        """Loads one model tensor from the checkpoint tensor `key`: source is sliced for a rank's part (a
        safetensors slice, read lazily, or a tensor), read() reads it whole (None: source is a tensor)."""
        dest = dests.of(name)
        if dest is None:
            return  # another expert-parallel rank's expert
        part = shard.slice_of(name, layout) if shard is not None else None
        if shard is not None and shard.is_zero_here(name):  # a row-parallel bias: rank 0 adds it
            dest.zero_()
            return
        if name in experts and dest.shape[0] != experts[name][1]:  # stacked experts: this rank's
            first = experts[name][0]
            t = source[first : first + dest.shape[0]]
        elif part is not None:  # a tensor-parallel rank's slice
            t = take(source, scale_slice(part) if name.endswith(fp8.SCALE_SUFFIX) else part)
        else:
            t = source if read is None else read()
        if name in experts:
            t = to_model_layout(layout, name, t)
        if t.shape != dest.shape:
            raise ValueError(f"{key}: checkpoint shape {tuple(t.shape)} != model {tuple(dest.shape)}")
        if name.endswith(fp8.SCALE_SUFFIX) and t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{key}: block scales stored as {t.dtype}; the engine reads float scales only")
        if fp8.is_fp8(t) and not fp8.is_fp8(dest):
            raise ValueError(f"{key}: FP8 values without their {key}{fp8.SCALE_SUFFIX} in the checkpoint")
        if fp8.is_fp8(dest) and not fp8.is_fp8(t):  # --quantization fp8: quantized as it loads
            t, scale = fp8.quantize(t)
            scale_dest = dests.of(name + fp8.SCALE_SUFFIX)
            assert scale_dest is not None and scale_dest.shape == scale.shape
            scale_dest.copy_(scale)
        dest.copy_(t.to(dest.dtype))

    num_nextn = num_mtp = 0  # tensors of multi-token-prediction layers skipped, loaded
    embedding_copies: list[tuple[Path, str]] = []  # MTP layers' copies of the embedding, checked after the loop
    files = checkpoint_files(folder)
    sizes = [tensor_bytes(f) for f in files]
    # a large model's files take minutes: a bar on a terminal, a log line now and then elsewhere
    shown = LoadProgress(sum(sum(s.values()) for s in sizes), sum(len(s) for s in sizes), len(files))
    try:
        for f, size in zip(files, sizes):
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for key in shown.tensors(st.keys(), size):
                    name = key.removeprefix("language_model.")
                    if name.endswith(SKIPPED_SUFFIXES):
                        continue
                    mtp_name = mtp.model_name(arch, name)
                    if mtp_name is not None:
                        num_mtp += 1
                        if mtp_name == mtp.EMBEDDING:
                            embedding_copies.append((f, key))
                            continue
                        name = mtp_name
                    elif is_nextn_layer(arch, name):
                        num_nextn += 1
                        continue
                    if name == "lm_head.weight" and "lm_head.weight" not in params:
                        continue  # tied embeddings saved twice
                    pieces = stacked_pieces(stacked, name)
                    if pieces is None:
                        place(name, key, st.get_slice(key), partial(st.get_tensor, key))
                        continue
                    rows = st.get_tensor(key)
                    if rows.shape[0] != pieces[-1][2]:
                        raise ValueError(f"{key}: {rows.shape[0]} rows, the model's {pieces} stack to {pieces[-1][2]}")
                    for piece, start, stop in pieces:
                        place(piece, key, rows[start:stop])
    finally:
        shown.close()
    # NOTE: after the loop: the model's embedding may lie in another file than the copies
    for f, key in embedding_copies:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            if mtp.EMBEDDING not in dests.loaded:  # the checkpoint has the copies only
                place(mtp.EMBEDDING, key, st.get_slice(key), partial(st.get_tensor, key))
            elif not _equal_rows(params[mtp.EMBEDDING].data, st.get_slice(key)):
                raise ValueError(
                    f"checkpoint tensor {key!r} differs from {mtp.EMBEDDING}: the engine's multi-token-prediction "
                    "layers share the model's embedding"
                )
    if num_mtp:
        log.info(
            "loaded %d multi-token-prediction layer(s) (model.layers.%d and on, %d tensors)",
            arch.num_mtp_layers, arch.num_layers, num_mtp,
        )  # fmt: skip
    if num_nextn and arch.num_mtp_layers:
        log.info(
            "skipped %d tensors of the checkpoint's next-token-prediction layers past the %d built (model.layers.%d "
            "and on)", num_nextn, arch.num_mtp_layers, arch.num_layers + arch.num_mtp_layers,
        )  # fmt: skip
    elif num_nextn:
        log.info(
            "skipped %d tensors of the checkpoint's %d next-token-prediction layer(s) (model.layers.%d and on): "
            "the engine does not do speculative decoding", num_nextn, arch.num_nextn_predict_layers, arch.num_layers,
        )  # fmt: skip
    missing = sorted(mtp.checkpoint_name(arch, name) for name in dests.missing())
    if missing:
        raise KeyError(f"checkpoint lacks {missing[:5]} ({len(missing)} tensors)")


def _equal_rows(dest: torch.Tensor, source: Any, rows: int = 8192) -> bool:
    """Whether a checkpoint tensor (a safetensors slice, read rows at a time) equals dest, in dest's dtype."""
    if tuple(source.get_shape()) != tuple(dest.shape):
        return False
    return all(
        torch.equal(source[r : r + rows].to(dest.device, dest.dtype), dest[r : r + rows])
        for r in range(0, dest.shape[0], rows)
    )
