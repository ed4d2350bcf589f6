"""Multi-token prediction (engine/models/mtp.py) against a float32 reference made of transformers' modules, on a tiny
random DeepSeek-V3 with one MTP layer under the released names (tests/tiny_models.py make_tiny_mtp).

The reference: transformers' DeepseekV3ForCausalLM gives the prompt's final-normed hidden states; the MTP layer is
transformers' DeepseekV3DecoderLayer (layer_idx N, loaded by transformers from model.layers.N.*) with full causal
attention over the MTP positions, and the layer's own math (embedding zeroed at position 0, enorm, hnorm, eh_proj,
shared_head) written plainly here. Ours: the model built with mtp_layers=1, the target's forward over the prompt,
then MTPLayer over positions 0..n-2 (inputs x_1..x_{n-1}, the target's hidden rows) in one chunk or several, two
sequences batched, the MTP layer's KV in its own layer of the pages across chunks; chained drafting; the loading
rules; FP8 checkpoints; and an engine without MTP unchanged."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ForwardConfig
from engine.core.kv_cache import KVCache, layout_of
from engine.layers import fp8
from engine.layers.context import SeqChunk, forward_context
from engine.layers.numerics import Numerics, probe_padded_is_invariant
from engine.models.decoder import CausalLM
from engine.models.loader import build_model
from engine.models.mtp import MTPLayer
from engine.models.registry import arch_from_hf, load_hf_config
from engine.quantization import fp8_format
from tests.engine_utils import random_prompts, small_engine
from tests.tiny_models import FP8_FAMILIES, dequantize_reference, make_tiny_mtp, to_fp8_checkpoint

CPU = torch.device("cpu")
BLOCK = 16
BLOCKS_PER_SEQ = 4  # 64 positions a sequence
MAX_POSITIONS = 128
LENGTHS = [45, 30]  # two prompts batched


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mtp("deepseek_v3", tmp_path_factory.mktemp("mtp"))


class Reference:
    """transformers' target model and MTP decoder layer, and the MTP layer's own tensors from the checkpoint."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

        f32 = torch.float32
        self.target, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=f32, output_loading_info=True)
        self.target.eval()
        n = self.target.config.num_hidden_layers
        # transformers loads the checkpoint, leaving the MTP layer's tensors alone
        assert not info["missing_keys"] and info["unexpected_keys"]
        assert all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"])
        # the MTP layer's decoder layer as transformers builds and loads layer n of a model one layer deeper
        wider = AutoModelForCausalLM.from_pretrained(str(folder), dtype=f32, num_hidden_layers=n + 1).eval()
        self.block = wider.model.layers[n]
        assert isinstance(self.block, DeepseekV3DecoderLayer) and self.block.self_attn.layer_idx == n
        prefix = f"model.layers.{n}."
        own = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
        self.w = {
            k.removeprefix(prefix): t for k, t in load_file(folder / "model.safetensors").items()
            if k.startswith(prefix) and k.removeprefix(prefix).startswith(own)
        }  # fmt: skip
        self.eps = self.target.config.rms_norm_eps

    @torch.no_grad()
    def hidden_and_logits(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's final-normed hidden states [n, hidden] and logits [n, vocab]."""
        h = self.target.model(torch.tensor([prompt])).last_hidden_state[0]
        return h, self.target.lm_head(h)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    @torch.no_grad()
    def mtp(self, next_ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over positions 0..len-1 (next_ids[i] = x_{i+1}, hidden[i] = h_i): its output rows and
        their logits."""
        n = len(next_ids)
        positions = torch.arange(n)
        e = self.w["embed_tokens.weight"][torch.tensor(next_ids)]
        e[positions == 0] = 0.0
        x = torch.cat([self._norm(e, "enorm.weight"), self._norm(hidden, "hnorm.weight")], dim=-1)
        x = (x @ self.w["eh_proj.weight"].T)[None]
        cos_sin = self.target.model.rotary_emb(x, positions[None])
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_ids=positions[None], position_embeddings=cos_sin)[0]
        return out, self._norm(out, "shared_head.norm.weight") @ self.w["shared_head.head.weight"].T


@pytest.fixture(scope="module")
def reference(mtp_dir: Path) -> Reference:
    return Reference(mtp_dir)


# ---- running our model directly in forward contexts --------------------------------------------------


def _model(folder: Path, mtp_layers: int = 1, **kw) -> tuple[CausalLM, KVCache]:  # type: ignore[no-untyped-def]
    hf = load_hf_config(folder)
    model = build_model(arch_from_hf(hf), hf, folder, torch.float32, CPU, MAX_POSITIONS, mtp_layers=mtp_layers, **kw)
    kv = KVCache(layout_of(model.arch, BLOCK, torch.float32), BLOCKS_PER_SEQ * len(LENGTHS), 0, CPU)
    return model, kv


def _mtp_layer(model: CausalLM) -> MTPLayer:
    assert model.mtp is not None and len(model.mtp) == 1
    layer = model.mtp[0]
    assert isinstance(layer, MTPLayer)
    return layer


def _blocks(seq: int) -> list[int]:
    return list(range(seq * BLOCKS_PER_SEQ, (seq + 1) * BLOCKS_PER_SEQ))


def _step(
    kv: KVCache, numerics: Numerics, parts: list[tuple[int, int, int]], fn: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """fn() in one step's forward context: parts (sequence, start position, tokens), rows in that order."""
    chunks, first = [], 0
    for seq, start, num in parts:
        chunks.append(SeqChunk(first, num, start, _blocks(seq), -1))
        first += num
    with torch.inference_mode(), forward_context(chunks, kv, numerics, config=ForwardConfig()):
        return fn()


def _target(model: CausalLM, kv: KVCache, numerics: Numerics, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every prompt's hidden states [n, hidden], the prompts in one step."""
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    h = _step(kv, numerics, [(i, 0, len(p)) for i, p in enumerate(prompts)], lambda: model(ids, positions))
    return list(h.split([len(p) for p in prompts]))


def _logits(model: CausalLM, kv: KVCache, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits of hidden rows."""
    return _step(kv, Numerics.DEFAULT, [], lambda: model.logits(hidden))


def _mtp(
    model: CausalLM, kv: KVCache, numerics: Numerics, rows: list[tuple[int, int, list[int], torch.Tensor]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One step of MTP layer 0: rows (sequence, first position, next tokens, previous hidden rows) -> each one's
    output rows and logits."""
    layer = _mtp_layer(model)
    ids = torch.tensor([t for _, _, toks, _ in rows for t in toks])
    positions = torch.cat([torch.arange(start, start + len(toks)) for _, start, toks, _ in rows])
    hidden = torch.cat([h for *_, h in rows])

    def run() -> torch.Tensor:
        out = layer(ids, positions, hidden)
        return torch.cat([out, layer.logits(out)], dim=1)

    both = _step(kv, numerics, [(seq, start, len(toks)) for seq, start, toks, _ in rows], run)
    sizes = [len(toks) for _, _, toks, _ in rows]
    width = model.arch.hidden_size
    return list(both[:, :width].split(sizes)), list(both[:, width:].split(sizes))


def _mtp_over_prompts(
    model: CausalLM, kv: KVCache, numerics: Numerics, prompts: list[list[int]], hidden: list[torch.Tensor],
    plans: list[list[int]],
) -> list[torch.Tensor]:  # fmt: skip
    """MTP positions 0..n-2 of every prompt, in chunks of the plan's sizes (chunk k of every prompt in step k):
    each prompt's logits [n - 1, vocab]."""
    done = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for k in range(max(len(p) for p in plans)):
        active = [i for i in range(len(prompts)) if k < len(plans[i])]
        rows = []
        for i in active:
            start, num = done[i], plans[i][k]
            rows.append((i, start, prompts[i][start + 1 : start + num + 1], hidden[i][start : start + num]))
        _, step_logits = _mtp(model, kv, numerics, rows)
        for i, lg in zip(active, step_logits):
            logits[i].append(lg)
            done[i] += plans[i][k]
    assert done == [len(p) - 1 for p in prompts]
    return [torch.cat(lg) for lg in logits]


# ---- against the reference ----------------------------------------------------------------------------


@pytest.mark.parametrize("numerics", [Numerics.DEFAULT, Numerics.TILED], ids=["default", "deterministic"])
@pytest.mark.parametrize(
    "plans", [[[44], [29]], [[20, 24], [3, 1, 25]]], ids=["one-chunk", "chunks"]
)  # one chunk: expanded latents (the tiny shape absorbs under 32 queries); chunks: absorbed, a one-token chunk
def test_mtp_logits_match_the_reference(
    mtp_dir: Path, reference: Reference, numerics: Numerics, plans: list[list[int]]
) -> None:
    """Two prompts batched: the target's hidden states, then MTP positions 0..n-2 (in one chunk or several,
    the MTP layer's earlier positions read from its own KV layer): logits within 1e-4 of the reference's."""
    prompts = random_prompts(LENGTHS, seed=5)
    model, kv = _model(mtp_dir)
    hidden = _target(model, kv, numerics, prompts)
    got = _mtp_over_prompts(model, kv, numerics, prompts, hidden, plans)
    for p, h, lg in zip(prompts, hidden, got):
        ref_h, _ = reference.hidden_and_logits(p)
        torch.testing.assert_close(h, ref_h, rtol=1e-4, atol=1e-4)
        _, ref_logits = reference.mtp(p[1:], ref_h[:-1])
        torch.testing.assert_close(lg, ref_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(lg.argmax(-1), ref_logits.argmax(-1))


def test_chained_drafts_match_the_reference(mtp_dir: Path, reference: Reference) -> None:
    """A decode step's drafting, k = 2: the prompt's MTP positions, then position n - 1 with the target's next
    token t, whose output drafts d1; the chained position n takes d1 and that output as its h, and drafts d2.
    Both drafts' logits within 1e-4 of the reference's, the same tokens."""
    (prompt,) = random_prompts([37], seed=6)
    n = len(prompt)
    model, kv = _model(mtp_dir)
    (h,) = _target(model, kv, Numerics.DEFAULT, [prompt])
    _mtp_over_prompts(model, kv, Numerics.DEFAULT, [prompt], [h], [[n - 1]])
    t = int(_logits(model, kv, h[-1:]).argmax())
    (out1,), (logits1,) = _mtp(model, kv, Numerics.DEFAULT, [(0, n - 1, [t], h[-1:])])
    d1 = int(logits1.argmax())
    (_,), (logits2,) = _mtp(model, kv, Numerics.DEFAULT, [(0, n, [d1], out1)])
    d2 = int(logits2.argmax())

    ref_h, ref_logits = reference.hidden_and_logits(prompt)
    assert t == int(ref_logits[-1].argmax())
    ref_out, ref_mtp = reference.mtp([*prompt[1:], t], ref_h)
    torch.testing.assert_close(logits1[0], ref_mtp[-1], rtol=1e-4, atol=1e-4)
    assert d1 == int(ref_mtp[-1].argmax())
    _, ref_chained = reference.mtp([*prompt[1:], t, d1], torch.cat([ref_h, ref_out[-1:]]))
    torch.testing.assert_close(logits2[0], ref_chained[-1], rtol=1e-4, atol=1e-4)
    assert d2 == int(ref_chained[-1].argmax())

    # the target's KV untouched by the MTP layer's: its decode step at position n gives the reference's logits
    h_n = _step(kv, Numerics.DEFAULT, [(0, n, 1)], lambda: model(torch.tensor([t]), torch.tensor([n])))
    _, ref_next = reference.hidden_and_logits([*prompt, t])
    torch.testing.assert_close(_logits(model, kv, h_n)[0], ref_next[-1], rtol=1e-4, atol=1e-4)


# ---- the model, the KV layout and loading ---------------------------------------------------------------


def test_mtp_layer_built_and_kv_layer_after_the_models(mtp_dir: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """mtp_layers=1: model.mtp holds the layer (a MoE block, as the checkpoint's layer N past
    first_k_dense_replace), sharing the model's embedding; its KV is the pool's full layer N after the model's
    N; one log line; its row-local functions join the numerics probe."""
    hf = load_hf_config(mtp_dir)
    arch = arch_from_hf(hf)
    with caplog.at_level(logging.INFO, logger="engine.models.loader"):
        model, kv = _model(mtp_dir)
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.models.loader"]
    assert lines == ["loaded 1 multi-token-prediction layer(s) (model.layers.4 and on, 44 tensors)"], lines
    assert model.arch.num_mtp_layers == 1 and arch.num_mtp_layers == 0
    layer = _mtp_layer(model)
    assert layer.block.is_sparse and layer.block.spec.cache_index == 4
    assert layer.embed_tokens is model.model.embed_tokens
    names = [n for n, _ in model.named_parameters()]
    assert "model.embed_tokens.weight" in names and not any(n.startswith("mtp.0.embed_tokens") for n in names)
    assert model.sparse_layers() == [model.model.layers[i].mlp for i in (1, 2, 3)]  # the target's only

    plain = layout_of(arch, BLOCK, torch.float32)
    assert kv.layout.num_full_layers == 5 and plain.num_full_layers == 4
    assert kv.layout.page_bytes * 4 == plain.page_bytes * 5

    base = build_model(arch, hf, mtp_dir, torch.float32, CPU, MAX_POSITIONS)
    assert len(model.row_functions()) == len(base.row_functions()) + 2
    probe_padded_is_invariant(model.row_functions()[-2:], torch.float32, CPU)  # they run on the probe's rows


def test_without_mtp_nothing_changes(mtp_dir: Path, tiny_model_dir, caplog) -> None:  # type: ignore[no-untyped-def]
    """An engine not asked for MTP on the checkpoint with an MTP layer: the KV layout of the model alone (that
    of the checkpoint without one), no model.mtp, the layer's tensors skipped with the one log line as before."""
    with caplog.at_level(logging.INFO, logger="engine.models.loader"):
        eng = small_engine(mtp_dir)
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.models.loader"]
    assert any("skipped 44 tensors" in line and "does not do speculative decoding" in line for line in lines), lines
    assert eng.model.mtp is None and eng.model.arch.num_mtp_layers == 0
    assert not any(n.startswith("mtp.") for n in eng.model.state_dict())
    without = small_engine(tiny_model_dir("deepseek_v3"))
    assert eng.layout == without.layout and eng.layout.num_full_layers == 4
    assert eng.layout.page_bytes == without.layout.page_bytes


def test_mtp_asked_of_a_checkpoint_without_it(mtp_dir: Path, tiny_model_dir, tmp_path: Path) -> None:
    """More MTP layers than num_nextn_predict_layers, or any for a family without them: a ValueError naming it;
    a config that declares the layer with its tensors absent: a KeyError naming them under the checkpoint's
    names; an embedding copy that differs from the model's: a ValueError; only copies: the copy is the model's."""
    with pytest.raises(ValueError, match="num_nextn_predict_layers 1"):
        _model(mtp_dir, mtp_layers=2)
    with pytest.raises(ValueError, match="num_nextn_predict_layers 0"):
        _model(tiny_model_dir("llama"))
    with pytest.raises(KeyError, match=r"model\.layers\.4\."):
        _model(tiny_model_dir("deepseek_v3"))  # num_nextn_predict_layers 1 in its config, no tensors

    tensors = load_file(mtp_dir / "model.safetensors")
    for name, change in (("differs", "perturbed"), ("copies", "dropped")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((mtp_dir / "config.json").read_text())
        changed = dict(tensors)
        if change == "perturbed":
            changed["model.layers.4.embed_tokens.weight"] = changed["model.embed_tokens.weight"] + 1e-3
        else:
            del changed["model.embed_tokens.weight"]
        save_file(changed, str(folder / "model.safetensors"))
        if change == "perturbed":
            with pytest.raises(ValueError, match="model.layers.4.embed_tokens.weight"):
                _model(folder)
        else:
            model, _ = _model(folder)
            assert torch.equal(model.model.embed_tokens.weight, tensors["model.layers.4.embed_tokens.weight"])


def test_dummy_weights_with_mtp(mtp_dir: Path) -> None:
    """--load-format dummy builds the MTP layer too (norms at one), and it runs."""
    model, kv = _model(mtp_dir, is_dummy=True)
    layer = _mtp_layer(model)
    assert torch.equal(layer.enorm.weight, torch.ones(64))
    (prompt,) = random_prompts([20], seed=7)
    (h,) = _target(model, kv, Numerics.DEFAULT, [prompt])
    (lg,) = _mtp_over_prompts(model, kv, Numerics.DEFAULT, [prompt], [h], [[19]])
    assert lg.shape == (19, 512) and torch.isfinite(lg).all()


# ---- FP8 ------------------------------------------------------------------------------------------------


def _dequantized(folder: Path, dest: Path) -> Path:
    """A float32 copy of an FP8 checkpoint: every FP8 tensor times its block scales (tests/tiny_models.py)."""
    dest.mkdir()
    tensors = load_file(folder / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = dequantize_reference(t, scale) if scale is not None else t
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _fp8_format(folder: Path, quantization: str | None = None) -> fp8.Fp8Format | None:
    return fp8_format(getattr(load_hf_config(folder), "quantization_config", None), quantization)


def _all_logits(model: CausalLM, kv: KVCache, prompts: list[list[int]]) -> list[torch.Tensor]:
    hidden = _target(model, kv, Numerics.DEFAULT, prompts)
    return _mtp_over_prompts(model, kv, Numerics.DEFAULT, prompts, hidden, [[len(p) - 1] for p in prompts])


def test_fp8_checkpoint_loads_the_mtp_layer(tmp_path: Path) -> None:
    """An FP8 release with an MTP layer (its decoder layer's, eh_proj's and shared_head.head's weights FP8; the
    embedding copy float): the MTP layer holds FP8 weights and gives, bit for bit, the MTP logits of the float32
    checkpoint of the reference-dequantized weights. --quantization fp8 on the float checkpoint quantizes the MTP
    layer's decoder layer as a release whose eh_proj and shared_head stay float ships it: the same logits."""
    shape = {k: FP8_FAMILIES["deepseek_v3"][k] for k in ("moe_intermediate_size", "intermediate_size")}
    original = make_tiny_mtp("deepseek_v3", tmp_path / "float", seed=3, **shape)
    released = to_fp8_checkpoint(original, tmp_path / "fp8", keep_float=("embed_tokens",))
    prompts = random_prompts(LENGTHS, seed=8)

    model, kv = _model(released, fp8_format=_fp8_format(released))
    layer = _mtp_layer(model)
    assert isinstance(layer.eh_proj, fp8.Fp8Linear) and isinstance(layer.shared_head.head, fp8.Fp8Linear)
    assert isinstance(layer.block.self_attn.q_b_proj, fp8.Fp8Linear)
    assert layer.block.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    dense, dense_kv = _model(_dequantized(released, tmp_path / "dense"))
    for a, b in zip(_all_logits(model, kv, prompts), _all_logits(dense, dense_kv, prompts)):
        assert torch.equal(a, b)

    float_head = to_fp8_checkpoint(original, tmp_path / "fp8-float-head", keep_float=("embed_tokens", "eh_proj", "shared_head"))
    shipped, shipped_kv = _model(float_head, fp8_format=_fp8_format(float_head))
    quantized, quantized_kv = _model(original, fp8_format=_fp8_format(original, "fp8"))
    ours = dict(quantized.named_parameters())
    theirs = dict(shipped.named_parameters())
    assert ours.keys() == theirs.keys()
    for name in (n for n in ours if n.startswith("mtp.")):
        a, b = ours[name], theirs[name]
        assert a.dtype == b.dtype, name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if fp8.is_fp8(a) else torch.equal(a, b), name
    assert isinstance(_mtp_layer(quantized).block.self_attn.o_proj, fp8.Fp8Linear)
    assert not isinstance(_mtp_layer(quantized).eh_proj, fp8.Fp8Linear)
    for a, b in zip(_all_logits(quantized, quantized_kv, prompts), _all_logits(shipped, shipped_kv, prompts)):
        assert torch.equal(a, b)


def test_arch_refuses_more_mtp_layers_than_the_checkpoint_has() -> None:
    """ModelArch.num_mtp_layers is bounded by num_nextn_predict_layers, and MTP layer j's cache index follows
    the model's full layers."""
    from transformers import DeepseekV3Config

    arch = arch_from_hf(DeepseekV3Config())
    assert arch.num_nextn_predict_layers == 1 and arch.mtp_cache_index(0) == 61
    with_mtp = dataclasses.replace(arch, num_mtp_layers=1)
    with pytest.raises(ValueError, match="num_nextn_predict_layers 1"):
        dataclasses.replace(arch, num_mtp_layers=2)
    plain, more = layout_of(arch, 128, torch.bfloat16), layout_of(with_mtp, 128, torch.bfloat16)
    assert (plain.num_full_layers, more.num_full_layers) == (61, 62) and more.page_bytes * 61 == plain.page_bytes * 62
