"""The MoE grouped GEMM (pdkernels/moe_gemm.py) against a float64 reference and fused_moe_reference:
both activations, biases, experts without tokens, a local expert subset, the tile configurations of
the default path, and batch invariance bit for bit. Skipped without CUDA; TRITON_INTERPRET=1 runs it
on the CPU in float32 at tiny shapes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.gpu_support import DEVICE, DTYPE, require_triton

require_triton()

from pdkernels.moe_gemm import (  # noqa: E402
    GemmConfig,
    bi_config,
    fused_moe,
    fused_moe_reference,
    gemm_config,
    grouped_matmul,
    moe_align,
)

pytestmark = pytest.mark.cuda
TOL = 2e-2 if DTYPE == torch.bfloat16 else 1e-5
IS_CUDA = DEVICE.type == "cuda"
# (hidden, intermediate, experts, top_k): the interpreter's tiny layer, and on CUDA wider ones
LAYERS = [(64, 32, 8, 2)] + ([(512, 256, 16, 4), (2048, 768, 128, 8)] if IS_CUDA else [])
TOKENS = [1, 5, 33] + ([200] if IS_CUDA else [])


def _rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(DEVICE, DTYPE)


def _route(gen: torch.Generator, num_tokens: int, num_experts: int, top_k: int,
           experts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token (from `experts` when given) and softmax weights."""
    pool = torch.tensor(experts if experts is not None else range(num_experts))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    return ids.reshape(num_tokens, top_k).to(DEVICE), weights.to(DEVICE, DTYPE)


class Layer:
    """One MoE layer's stacked expert weights (gate rows, then up rows), biases optional."""

    def __init__(self, gen: torch.Generator, hidden: int, inter: int, num_experts: int, has_bias: bool) -> None:
        self.w_gate_up = _rand(gen, num_experts, 2 * inter, hidden, scale=hidden**-0.5)
        self.w_down = _rand(gen, num_experts, hidden, inter, scale=inter**-0.5)
        self.b_gate_up = _rand(gen, num_experts, 2 * inter, scale=0.5) if has_bias else None
        self.b_down = _rand(gen, num_experts, hidden, scale=0.5) if has_bias else None

    def weights(self, first: int = 0, num: int | None = None) -> dict[str, Any]:
        end = None if num is None else first + num

        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[first:end]

        return {"w_gate_up": part(self.w_gate_up), "w_down": part(self.w_down),
                "b_gate_up": part(self.b_gate_up), "b_down": part(self.b_down)}


def _glu64(gate_up: torch.Tensor, activation: str | None, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    if activation is None:
        return gate_up
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "swiglu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def _moe64(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: Layer, activation: str) -> torch.Tensor:
    """The layer in float64, token by token and slot by slot, no rounding between the steps."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            gate_up = layer.w_gate_up[e].double() @ x[t].double()
            if layer.b_gate_up is not None:
                gate_up = gate_up + layer.b_gate_up[e].double()
            y = layer.w_down[e].double() @ _glu64(gate_up, activation)
            if layer.b_down is not None:
                y = y + layer.b_down[e].double()
            out[t] += weights[t, slot].double() * y
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def test_moe_align_ordering() -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_experts, top_k = 37, 8, 3
    ids, _ = _route(gen, num_tokens, num_experts, top_k)
    flat = ids.reshape(-1).cpu()
    order, offsets = moe_align(ids, num_experts)
    order, offsets = order.cpu(), offsets.cpu()
    assert order.dtype == torch.int64 and offsets.dtype == torch.int32 and offsets.shape == (num_experts + 1,)
    assert torch.equal(order.sort().values, torch.arange(num_tokens * top_k))  # every assignment, once
    assert torch.equal(offsets[1:] - offsets[:-1], torch.bincount(flat, minlength=num_experts).int())
    for e in range(num_experts):
        rows = order[offsets[e] : offsets[e + 1]]
        assert (flat[rows] == e).all()
        assert (rows[1:] > rows[:-1]).all()  # stable: token order, then slot order
    # a local subset: experts [3, 6) only, numbered from 0
    order, offsets = moe_align(ids, num_experts, first_expert=3, num_local=3)
    order, offsets = order.cpu(), offsets.cpu()
    local = torch.nonzero((flat >= 3) & (flat < 6)).squeeze(1)
    assert order.shape == local.shape and torch.equal(order.sort().values, local)
    assert offsets[0] == 0 and offsets[-1] == local.numel()
    for e in range(3):
        rows = order[offsets[e] : offsets[e + 1]]
        assert (flat[rows] == 3 + e).all() and (rows[1:] > rows[:-1]).all()
    with pytest.raises(ValueError):
        moe_align(ids, num_experts, first_expert=6, num_local=3)


@pytest.mark.parametrize("activation", [None, "swiglu", "swiglu_oai"])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_grouped_matmul_matches_float64(activation: str | None, has_bias: bool, batch_invariant: bool) -> None:
    """Uneven expert sizes, empty experts (first, middle, last), K not a multiple of the K step, N not
    a multiple of the column tile; rows past the last offset are not written."""
    gen = torch.Generator().manual_seed(hash((activation, has_bias, batch_invariant)) % 1000)
    k, n = (40, 2 * 24) if not IS_CUDA else (1000, 2 * 600)
    counts = [0, 3, 17, 0, 1, 20, 0]
    num_experts, used = len(counts), sum(counts)
    x = _rand(gen, used + 5, k)
    w = _rand(gen, num_experts, n, k, scale=k**-0.5)
    bias = _rand(gen, num_experts, n) if has_bias else None
    offsets = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    out = grouped_matmul(x, w, offsets, bias, activation, batch_invariant=batch_invariant)
    assert out.shape == (used + 5, n // 2 if activation else n) and out.dtype == DTYPE
    ref = torch.cat([x[offsets[e] : offsets[e + 1]].double() @ w[e].double().t()
                     + (bias[e].double() if bias is not None else 0) for e in range(num_experts)])
    ref = _glu64(ref, activation)
    assert not out[:used].isnan().any()
    assert _rel_err(out[:used], ref) < TOL
    # weights stored [E, K, N] (Hugging Face's gpt-oss layout) and passed as a transposed view
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    out_t = grouped_matmul(x, w_t, offsets, bias, activation, batch_invariant=batch_invariant)
    assert torch.equal(out_t[:used], out[:used])


@pytest.mark.parametrize("rows_per_expert", [3, 40, 100, 300])
def test_grouped_matmul_default_tiles(rows_per_expert: int) -> None:
    """Each of the default path's row tiles (decode to prefill), several tiles per expert."""
    gen = torch.Generator().manual_seed(rows_per_expert)
    k, n, num_experts = (64, 32, 2) if not IS_CUDA else (2048, 1536, 8)
    x = _rand(gen, rows_per_expert * num_experts, k)
    w = _rand(gen, num_experts, n, k, scale=k**-0.5)
    counts = [rows_per_expert + (e % 2) * 2 - 1 for e in range(num_experts)]
    offsets = torch.tensor([0] + counts).cumsum(0).to(torch.int32).to(DEVICE)
    cfg = gemm_config(x.shape[0], num_experts, n // 2, k, is_glu=True, batch_invariant=False)
    out = grouped_matmul(x, w, offsets, activation="swiglu")
    ref = torch.cat([x[offsets[e] : offsets[e + 1]].double() @ w[e].double().t() for e in range(num_experts)])
    assert _rel_err(out[: sum(counts)], _glu64(ref, "swiglu")) < TOL, cfg


@pytest.mark.parametrize("hidden,inter,num_experts,top_k", LAYERS)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("activation,has_bias", [("swiglu", False), ("swiglu_oai", True), ("swiglu", True)])
def test_fused_moe_matches_reference(hidden: int, inter: int, num_experts: int, top_k: int, num_tokens: int,
                                     activation: str, has_bias: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 7 + hidden + has_bias)
    layer = Layer(gen, hidden, inter, num_experts, has_bias)
    x = _rand(gen, num_tokens, hidden)
    ids, weights = _route(gen, num_tokens, num_experts, top_k)
    ref = fused_moe_reference(x, ids, weights, **layer.weights(), activation=activation)
    if num_tokens <= 33:
        assert _rel_err(ref, _moe64(x, ids, weights, layer, activation)) < TOL
    for batch_invariant in (False, True):
        out = fused_moe(x, ids, weights, **layer.weights(), activation=activation, batch_invariant=batch_invariant)
        assert out.shape == x.shape and out.dtype == x.dtype and not out.isnan().any()
        assert _rel_err(out, ref) < TOL, batch_invariant


def test_experts_without_tokens() -> None:
    """Every token routed to two of eight experts: six experts have no rows. The last token is padding
    (expert ids -1, as a CUDA graph's dummy slot): zeros."""
    gen = torch.Generator().manual_seed(3)
    hidden, inter, num_experts = LAYERS[0][:3]
    layer = Layer(gen, hidden, inter, num_experts, has_bias=True)
    x = _rand(gen, 9, hidden)
    ids, weights = _route(gen, 9, num_experts, 2, experts=[1, num_experts - 2])
    ref = fused_moe_reference(x, ids, weights, **layer.weights())
    assert _rel_err(ref, _moe64(x, ids, weights, layer, "swiglu")) < TOL
    ids[-1] = -1
    padded = fused_moe_reference(x, ids, weights, **layer.weights())
    assert torch.equal(padded[:-1], ref[:-1]) and (padded[-1] == 0).all()
    for batch_invariant in (False, True):
        out = fused_moe(x, ids, weights, **layer.weights(), batch_invariant=batch_invariant)
        assert _rel_err(out, padded) < TOL and (out[-1] == 0).all()


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai"])
def test_local_expert_subset(activation: str) -> None:
    """Experts [first, first + num) of a partition: the reference's partial sum (a token's other slots
    weighted zero, bit for bit in batch-invariant mode), zeros for tokens with no local expert, and
    the partials adding up to the whole layer."""
    gen = torch.Generator().manual_seed(11)
    hidden, inter, num_experts, top_k = LAYERS[0]
    layer = Layer(gen, hidden, inter, num_experts, has_bias=True)
    num_tokens = 33
    x = _rand(gen, num_tokens, hidden)
    ids, weights = _route(gen, num_tokens, num_experts, top_k)
    ids[0] = torch.tensor([0, 1][:top_k] + list(range(2, top_k)))  # token 0: experts of the first part only
    kw: dict[str, Any] = {"activation": activation}
    whole = fused_moe(x, ids, weights, **layer.weights(), **kw)
    parts = []
    for first, num in ((0, 3), (3, num_experts - 3)):
        is_local = (ids >= first) & (ids < first + num)
        masked = torch.where(is_local, weights, torch.zeros_like(weights))
        ref = fused_moe_reference(x, ids, weights, **layer.weights(first, num), first_expert=first, **kw)
        assert torch.equal(ref, fused_moe_reference(x, ids, masked, **layer.weights(), **kw))
        bi = fused_moe(x, ids, weights, **layer.weights(first, num), first_expert=first, batch_invariant=True, **kw)
        assert torch.equal(bi, fused_moe(x, ids, masked, **layer.weights(), batch_invariant=True, **kw))
        out = fused_moe(x, ids, weights, **layer.weights(first, num), first_expert=first, **kw)
        assert _rel_err(out, ref) < TOL
        none_local = ~is_local.any(dim=1)
        assert none_local.any() and (out[none_local] == 0).all() and (bi[none_local] == 0).all()
        parts.append(out.float())
    assert _rel_err(parts[0] + parts[1], whole) < TOL


@pytest.mark.parametrize("hidden,inter,num_experts,top_k", LAYERS)
@pytest.mark.parametrize("activation,has_bias", [("swiglu", False), ("swiglu_oai", True)])
def test_batch_invariant_bit_identical(hidden: int, inter: int, num_experts: int, top_k: int, activation: str,
                                       has_bias: bool) -> None:
    """A token's output alone equals its row in a batch of 33 (others routed differently), in a batch
    of a different size, and in a shuffled batch."""
    gen = torch.Generator().manual_seed(hidden + top_k)
    layer = Layer(gen, hidden, inter, num_experts, has_bias)
    batch = 33
    x = _rand(gen, batch, hidden)
    ids, weights = _route(gen, batch, num_experts, top_k)
    kw: dict[str, Any] = {**layer.weights(), "activation": activation, "batch_invariant": True}
    full = fused_moe(x, ids, weights, **kw)
    for t in range(batch):
        alone = fused_moe(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], **kw)
        assert torch.equal(alone[0], full[t]), t
    assert torch.equal(fused_moe(x[:17], ids[:17], weights[:17], **kw), full[:17])
    perm = torch.randperm(batch, generator=gen).to(DEVICE)
    assert torch.equal(fused_moe(x[perm], ids[perm], weights[perm], **kw), full[perm])
    if IS_CUDA:  # many tokens per expert: several row tiles each, the prefill regime
        big = 2048
        xb = torch.cat([x, _rand(gen, big, hidden)])
        ib, wb = _route(gen, big, num_experts, top_k)
        out = fused_moe(xb, torch.cat([ids, ib]), torch.cat([weights, wb]), **kw)
        assert torch.equal(out[:batch], full)


@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("activation,has_bias", [("swiglu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_path(num_tokens: int, activation: str, has_bias: bool, fp8: bool) -> None:
    """A few tokens' experts as one GEMV per assignment (moe_gemv.py, fused_moe's default up to
    MAX_GEMV_TOKENS): against fused_moe_reference and the grouped GEMM (gemv_tokens=0) for float and FP8
    weights; a padding slot (-1) and another rank's experts add nothing (a local subset's partial sums
    equal the reference's with those slots weighted zero); the config fills the device's programs."""
    from engine.layers.fp8 import dequantize, quantize
    from pdkernels.moe_gemm import MAX_GEMV_TOKENS
    from pdkernels.moe_gemv import moe_gemv_config

    assert num_tokens <= MAX_GEMV_TOKENS
    gen = torch.Generator().manual_seed(17 * num_tokens + has_bias + 2 * fp8)
    hidden, inter, num_experts, top_k = (256, 128, 8, 2) if not IS_CUDA else (2048, 768, 128, 8)
    layer = Layer(gen, hidden, inter, num_experts, has_bias)
    kw: dict[str, Any] = {"activation": activation}
    weights_kw = layer.weights()
    if fp8:
        gu8, gu_s = (t.to(DEVICE) for t in quantize(layer.w_gate_up.float().cpu()))
        d8, d_s = (t.to(DEVICE) for t in quantize(layer.w_down.float().cpu()))
        weights_kw = {**weights_kw, "w_gate_up": dequantize(gu8, gu_s, DTYPE), "w_down": dequantize(d8, d_s, DTYPE)}
        kw.update(w_gate_up_scale=gu_s, w_down_scale=d_s)
    x = _rand(gen, num_tokens, hidden)
    ids, weights = _route(gen, num_tokens, num_experts, top_k)
    ids[-1, -1] = -1  # a padding slot
    ref = fused_moe_reference(x, ids, weights, **weights_kw, activation=activation)
    held = {**weights_kw, **({"w_gate_up": gu8, "w_down": d8} if fp8 else {})}
    out = fused_moe(x, ids, weights, **held, **kw)
    grouped = fused_moe(x, ids, weights, **held, **kw, gemv_tokens=0)
    assert out.shape == x.shape and out.dtype == x.dtype and not out.isnan().any()
    assert _rel_err(out, ref) < TOL and _rel_err(out, grouped) < TOL
    first, num = 3, num_experts - 3
    part = {k: (v[first : first + num] if v is not None else None) for k, v in held.items()}
    if fp8:
        part.update(w_gate_up_scale=gu_s[first : first + num], w_down_scale=d_s[first : first + num])
    local = fused_moe(x, ids, weights, **part, **{k: v for k, v in kw.items() if "scale" not in k}, first_expert=first)
    masked = torch.where((ids >= first) & (ids < first + num), weights, torch.zeros_like(weights))
    assert _rel_err(local, fused_moe_reference(x, ids, masked, **weights_kw, activation=activation)) < TOL
    cfg = moe_gemv_config(inter, hidden, num_tokens * top_k, True, 1 if fp8 else 2)
    assert cfg.block_k == (16 if fp8 else 8) * 32 * cfg.num_warps and cfg.block_n >= 1


def test_empty_and_invalid() -> None:
    gen = torch.Generator().manual_seed(5)
    hidden, inter, num_experts, top_k = LAYERS[0]
    layer = Layer(gen, hidden, inter, num_experts, has_bias=False)
    x = _rand(gen, 0, hidden)
    ids = torch.zeros(0, top_k, dtype=torch.int64, device=DEVICE)
    assert fused_moe(x, ids, ids.to(DTYPE), **layer.weights()).shape == (0, hidden)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=DEVICE)
    assert grouped_matmul(x, layer.w_down.transpose(1, 2), offsets).shape == (0, inter)
    x = _rand(gen, 3, hidden)
    with pytest.raises(ValueError):
        grouped_matmul(x, layer.w_gate_up, offsets, activation="gelu")
    with pytest.raises(ValueError):
        grouped_matmul(x, layer.w_gate_up, offsets.long())
    with pytest.raises(ValueError):
        fused_moe(x, ids[:0], ids[:0].to(DTYPE), **layer.weights())


def test_config_depends_on_weight_shape_only() -> None:
    """Batch-invariant mode: one configuration for every M and expert count; the default one by shape."""
    bi = bi_config(768, 2048, True)
    assert all(gemm_config(m, e, 768, 2048, True, True) == bi for m in (1, 64, 65536) for e in (1, 128))
    assert gemm_config(8, 128, 768, 2048, True, False).block_m == 16
    assert gemm_config(65536, 128, 768, 2048, True, False).block_m == 128
    # FP8 x FP8 prefill: the w8a8 sweep's fastest tiles (BLOCK_K the scale block)
    assert gemm_config(65536, 128, 768, 2048, True, False, fp8_x=True) == GemmConfig(64, 128, 128, 8, 3)
    assert gemm_config(65536, 128, 2048, 768, False, False, fp8_x=True) == GemmConfig(64, 128, 128, 4, 4)
    assert all(min(c.block_m, c.block_n, c.block_k) >= 16 for c in (bi, bi_config(8, 8, False)))  # tl.dot


@pytest.mark.skipif(not IS_CUDA, reason="CUDA graphs and timing need the GPU")
def test_cuda_graph_and_bandwidth_report() -> None:
    """fused_moe has no host sync, so a CUDA graph captures it; prints the GB/s of expert weights read
    at Qwen3-30B-A3B's layer shape in decode (not a bar)."""
    gen = torch.Generator().manual_seed(9)
    hidden, inter, num_experts, top_k = 2048, 768, 128, 8
    layer = Layer(gen, hidden, inter, num_experts, has_bias=False)
    for num_tokens in (1, 64):
        x = _rand(gen, num_tokens, hidden)
        ids, weights = _route(gen, num_tokens, num_experts, top_k)
        eager = fused_moe(x, ids, weights, **layer.weights())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(x, ids, weights, **layer.weights())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        us = start.elapsed_time(end) / 20 * 1e3
        nbytes = ids.unique().numel() * 3 * hidden * inter * 2
        print(f"fused_moe T={num_tokens}: {us:.1f} us, {nbytes / us / 1e3:,.0f} GB/s of expert weights read")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_sparse_moe_fused_path_matches_its_torch_path(family: str, batch_invariant: bool) -> None:
    """engine/layers/moe.py's CUDA branch (SparseMoE.fused_experts: these kernels, with gpt-oss's biases in
    the model's gate-then-up order and its clamped SwiGLU) against the module's torch path on the CPU
    in float32, with the same routing."""
    import copy

    from engine.layers.moe import SparseMoE
    from pdkernels import moe_gemm

    gen = torch.Generator().manual_seed(17)
    hidden, inter, num_experts, top_k = LAYERS[0]
    is_oss = family == "gpt_oss"
    moe = SparseMoE(hidden, inter, num_experts, top_k, not is_oss, F.silu,
                    routing="topk_softmax" if is_oss else "softmax_topk",
                    activation="swiglu_oai" if is_oss else "swiglu", has_bias=is_oss)
    with torch.no_grad():
        for p in moe.parameters():  # wide enough that gpt-oss's clamps bite
            p.copy_(torch.randn(p.shape, generator=gen) * (0.4 if p.dim() == 3 else 1.0))
    moe.requires_grad_(False)
    x = torch.randn(33, hidden, generator=gen)
    with torch.no_grad():
        ref = moe(x)
        weights, experts = moe.route(moe.router_logits(x))
        on_device = copy.deepcopy(moe).to(DEVICE, DTYPE)
        out = on_device.fused_experts(moe_gemm, x.to(DEVICE, DTYPE), experts.to(DEVICE), weights.to(DEVICE, DTYPE),
                                      batch_invariant)
    assert _rel_err(out.cpu(), ref) < TOL


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 33] + ([200] if IS_CUDA else []))
def test_fp8_experts(batch_invariant: bool, num_tokens: int) -> None:
    """FP8 expert weights with 128x128 block scales (engine/layers/fp8.py quantize): fused_moe dequantizes each
    weight tile in registers, so it matches fused_moe_reference on the dequantized weights to the
    tolerance of the float path (the products then run in x's dtype, as with float weights); the
    grouped GEMM alone likewise, gate and up blocks stacked (I a multiple of 128). Refusals: FP8 weights
    without scales, scales of the wrong shape."""
    from engine.layers.fp8 import dequantize, quantize

    gen = torch.Generator().manual_seed(num_tokens + batch_invariant)
    hidden, inter, num_experts, top_k = (256, 128, 4, 2) if not IS_CUDA else (1024, 256, 16, 4)
    gu8, gu_s = (t.to(DEVICE) for t in quantize(torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.05))
    d8, d_s = (t.to(DEVICE) for t in quantize(torch.randn(num_experts, hidden, inter, generator=gen) * 0.05))
    x = _rand(gen, num_tokens, hidden)
    ids, weights = _route(gen, num_tokens, num_experts, top_k)
    dense = {"w_gate_up": dequantize(gu8, gu_s, DTYPE), "w_down": dequantize(d8, d_s, DTYPE)}
    ref = fused_moe_reference(x, ids, weights, **dense, activation="swiglu")
    out = fused_moe(x, ids, weights, gu8, d8, batch_invariant=batch_invariant, w_gate_up_scale=gu_s,
                    w_down_scale=d_s)  # fmt: skip
    assert out.shape == x.shape and out.dtype == x.dtype and not out.isnan().any()
    assert _rel_err(out, ref) < TOL
    counts = [num_tokens, 0, num_tokens] + [0] * (num_experts - 3)  # experts 0 and 2
    offsets = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
    rows = torch.cat([x, x])
    got = grouped_matmul(rows, gu8, offsets.to(DEVICE), activation="swiglu", w_scale=gu_s)
    want = torch.cat([rows[:num_tokens].double() @ dense["w_gate_up"][0].double().t(),
                      rows[num_tokens:].double() @ dense["w_gate_up"][2].double().t()])
    assert _rel_err(got, _glu64(want, "swiglu")) < TOL
    with pytest.raises(ValueError, match="scales"):
        grouped_matmul(rows, gu8, offsets.to(DEVICE), activation="swiglu")
    with pytest.raises(ValueError, match="block scales"):
        grouped_matmul(rows, gu8, offsets.to(DEVICE), activation="swiglu", w_scale=gu_s[:, :1])


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 33] + ([200] if IS_CUDA else []))
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai"])
def test_fp8_activations(batch_invariant: bool, num_tokens: int, activation: str) -> None:
    """fused_moe(fp8_activations=True): x and the activation quantized per row and 128-column group, both
    projections in FP8 (gate/up with the gather fused, down with the scatter): against
    fused_moe_reference(fp8_activations=True) on the dequantized weights, the same quantization in torch,
    to the float path's tolerance; against the float path itself within FP8's own error. Refused without
    FP8 weights or with K not a multiple of 128."""
    from engine.layers.fp8 import dequantize, quantize

    gen = torch.Generator().manual_seed(7 * num_tokens + batch_invariant)
    hidden, inter, num_experts, top_k = (256, 128, 4, 2) if not IS_CUDA else (1024, 256, 16, 4)
    gu8, gu_s = (t.to(DEVICE) for t in quantize(torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.05))
    d8, d_s = (t.to(DEVICE) for t in quantize(torch.randn(num_experts, hidden, inter, generator=gen) * 0.05))
    biases = {}
    if activation == "swiglu_oai":  # gpt-oss's: biases too
        biases = {"b_gate_up": _rand(gen, num_experts, 2 * inter, scale=0.1), "b_down": _rand(gen, num_experts, hidden, scale=0.1)}
    x = _rand(gen, num_tokens, hidden)
    ids, weights = _route(gen, num_tokens, num_experts, top_k)
    dense = {"w_gate_up": dequantize(gu8, gu_s, DTYPE), "w_down": dequantize(d8, d_s, DTYPE)}
    ref = fused_moe_reference(x, ids, weights, **dense, **biases, activation=activation, fp8_activations=True)
    out = fused_moe(x, ids, weights, gu8, d8, **biases, activation=activation, batch_invariant=batch_invariant,
                    w_gate_up_scale=gu_s, w_down_scale=d_s, fp8_activations=True)  # fmt: skip
    assert out.shape == x.shape and out.dtype == x.dtype and not out.isnan().any()
    assert _rel_err(out, ref) < TOL
    float_path = fused_moe_reference(x, ids, weights, **dense, **biases, activation=activation)
    assert _rel_err(out, float_path) < 0.1  # e4m3's 3 mantissa bits on the activations
    with pytest.raises(ValueError, match="FP8 rows"):
        fused_moe(x, ids, weights, dense["w_gate_up"], dense["w_down"], **biases, activation=activation,
                  fp8_activations=True)  # fmt: skip


@pytest.mark.parametrize("num_tokens", [3, 21])
def test_fp8_activations_given_tiles(num_tokens: int) -> None:
    """fused_moe(fp8_activations=True) with given tiles (moe_layer.py's sweep) whose column tiles cross N's
    edge (BLOCK_N 256 over I = H = 384: the weight tiles' boundary check; K is always whole 128-column
    steps) and an expert without rows, against fused_moe_reference(fp8_activations=True). Refused: a K
    step other than 128 with FP8 rows, given tiles with batch_invariant."""
    from engine.layers.fp8 import dequantize, quantize

    gen = torch.Generator().manual_seed(11 * num_tokens)
    hidden, inter, num_experts, top_k = 384, 384, 4, 2
    gu8, gu_s = (t.to(DEVICE) for t in quantize(torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.05))
    d8, d_s = (t.to(DEVICE) for t in quantize(torch.randn(num_experts, hidden, inter, generator=gen) * 0.05))
    x = _rand(gen, num_tokens, hidden)
    ids, weights = _route(gen, num_tokens, num_experts, top_k, experts=[0, 2, 3])  # expert 1: no rows
    dense: dict[str, Any] = {"w_gate_up": dequantize(gu8, gu_s, DTYPE), "w_down": dequantize(d8, d_s, DTYPE)}
    ref = fused_moe_reference(x, ids, weights, **dense, fp8_activations=True)
    fp8: dict[str, Any] = {"w_gate_up_scale": gu_s, "w_down_scale": d_s, "fp8_activations": True}
    configs = (GemmConfig(16, 256, 128, 4, 2), GemmConfig(32, 256, 128, 4, 2))  # M, N, K tiles, warps, stages
    out = fused_moe(x, ids, weights, gu8, d8, **fp8, configs=configs)
    assert out.shape == x.shape and not out.isnan().any()
    assert _rel_err(out, ref) < TOL
    assert _rel_err(out, fused_moe(x, ids, weights, gu8, d8, **fp8)) < TOL  # the default tiles
    with pytest.raises(ValueError, match="tiles"):
        fused_moe(x, ids, weights, gu8, d8, **fp8, configs=(GemmConfig(16, 64, 64, 4, 2), configs[1]))
    with pytest.raises(ValueError, match="batch-invariant"):
        fused_moe(x, ids, weights, gu8, d8, **fp8, configs=configs, batch_invariant=True)
