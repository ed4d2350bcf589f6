"""The decode GEMV (pdkernels/gemv.py) against a float64 reference: 1 to 8 rows, bias, ragged N and K
tails, strided x and out, the fused SiLU/GELU(tanh) input bit for bit against fused_ops.silu_mul then
the plain product, the launch configurations, and the errors. Skipped without CUDA; TRITON_INTERPRET=1
runs it on the CPU in float32 at small shapes (where pdl and prefetch are switched off)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.gpu_support import DEVICE, DTYPE, require_triton

require_triton()

from pdkernels.fused_ops import silu_mul  # noqa: E402
from pdkernels.gemv import MAX_ROWS, GemvConfig, gemv, gemv_config  # noqa: E402

pytestmark = pytest.mark.cuda
IS_CUDA = DEVICE.type == "cuda"
EPS = torch.finfo(DTYPE).eps
VEC = 16 // torch.tensor([], dtype=DTYPE).element_size()  # elements per 16-byte load
# (N, K): ragged against the default tiles; on CUDA also the 8B model's shapes
SHAPES = [(96, 320), (48, 64)] + ([(4096, 4096), (1000, 1500), (4096, 14336)] if IS_CUDA else [])
ROWS = [1, 2, 3, 8]
# the tiles under test: the defaults on CUDA; under the interpreter, which runs programs one at a time, wide ones
CFG = None if IS_CUDA else GemvConfig(32, VEC * 64, 2)
# explicit tiles for N and K tails; the last has a K step under VEC * 32 * warps (x through shared memory)
CONFIGS = [GemvConfig(16, VEC * 32, 1), GemvConfig(8, VEC * 64, 2), GemvConfig(4, VEC * 16, 4)]


def _rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(DEVICE, DTYPE)


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """out against x @ w.T (+ bias) in float64: one rounding to the dtype, plus float32 accumulation."""
    ref = x.double() @ w.double().t() + (bias.double() if bias is not None else 0)
    scale = x.double().abs() @ w.double().abs().t()
    err = (out.double() - ref).abs()
    bound = EPS * ref.abs() + 1e-5 * scale + 1e-30
    assert out.shape == ref.shape and out.dtype == DTYPE
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("has_bias", [False, True])
def test_matches_float64(n: int, k: int, m: int, has_bias: bool) -> None:
    gen = torch.Generator().manual_seed(n * k + m * 7 + has_bias)
    x, w = _rand(gen, m, k), _rand(gen, n, k, scale=k**-0.5)
    bias = _rand(gen, n) if has_bias else None
    _check(gemv(x, w, bias, config=CFG), x, w, bias)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_default_config(m: int) -> None:
    """gemv_config's tiles at a small shape (one weight row per program: few columns, many programs)."""
    gen = torch.Generator().manual_seed(m)
    n, k = 40, 3 * VEC * 8
    x, w, bias = _rand(gen, m, k), _rand(gen, n, k, scale=k**-0.5), _rand(gen, n)
    _check(gemv(x, w, bias), x, w, bias)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("m", [1, 3])
def test_ragged_tails(cfg: GemvConfig, m: int) -> None:
    """N not a multiple of BLOCK_N, K not a multiple of BLOCK_K (the masked path), several K steps."""
    gen = torch.Generator().manual_seed(cfg.block_n + m)
    n, k = 2 * cfg.block_n + 3, 2 * cfg.block_k + VEC * 3 + 1
    x, w, bias = _rand(gen, m, k), _rand(gen, n, k, scale=k**-0.5), _rand(gen, n)
    out = torch.full((m, n), float("nan"), dtype=DTYPE, device=DEVICE)
    gemv(x, w, bias, out=out, config=cfg)
    _check(out, x, w, bias)
    k_even = 2 * cfg.block_k  # and the unmasked path with the same tiles
    _check(gemv(x[:, :k_even], w[:, :k_even].contiguous(), config=cfg), x[:, :k_even], w[:, :k_even])


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("cfg", [CFG, CONFIGS[1]])
def test_fused_activation_bit_identical(act: str, m: int, cfg: GemvConfig | None) -> None:
    """gemv(gate_up, w, act=...) == gemv(silu_mul(gate_up, act), w), bit for bit, with and without
    bias and K tails; and both near act(gate) * up @ w.T in float64."""
    gen = torch.Generator().manual_seed(m + (act == "silu"))
    n, k = (40, 200) if not IS_CUDA else (1000, 14336)
    gate_up = _rand(gen, m, 2 * k, scale=2.0)
    w, bias = _rand(gen, n, k, scale=k**-0.5), _rand(gen, n)
    for b in (None, bias):
        fused = gemv(gate_up, w, b, act=act, config=cfg)
        two_step = gemv(silu_mul(gate_up, act), w, b, config=cfg)
        assert torch.equal(fused, two_step), float((fused.float() - two_step.float()).abs().max())
    gate, up = gate_up.double().chunk(2, dim=-1)
    a = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
    ref = a @ w.double().t()
    bound = EPS * ref.abs() + 3 * EPS * (a.abs() @ w.double().abs().t()) + 1e-30
    assert bool(((gemv(gate_up, w, act=act, config=cfg).double() - ref).abs() <= bound).all())


def test_strided_x_and_out() -> None:
    """x a column slice of a wider tensor (row stride != K), out a column slice too; gate/up likewise."""
    gen = torch.Generator().manual_seed(5)
    m, n, k = 3, 72, 136
    big = _rand(gen, m, k + 40)
    x = big[:, 24 : 24 + k]
    assert x.stride(0) == k + 40 and not x.is_contiguous()
    w, bias = _rand(gen, n, k, scale=k**-0.5), _rand(gen, n)
    canvas = torch.full((m, n + 10), float("nan"), dtype=DTYPE, device=DEVICE)
    out = canvas[:, 5 : 5 + n]
    assert gemv(x, w, bias, out=out, config=CFG) is out
    _check(out, x, w, bias)
    assert canvas[:, :5].isnan().all() and canvas[:, 5 + n :].isnan().all()  # nothing outside out written
    assert torch.equal(out, gemv(x.contiguous(), w, bias, config=CFG))
    gate_up = _rand(gen, m, 2 * k + 16)[:, 8 : 8 + 2 * k]
    assert torch.equal(gemv(gate_up, w, act="silu", config=CFG), gemv(silu_mul(gate_up.contiguous()), w, config=CFG))


def test_pdl_and_prefetch_same_result() -> None:
    """pdl and prefetch change the launch, never the arithmetic (both off under the interpreter)."""
    gen = torch.Generator().manual_seed(9)
    n, k = (64, 320) if not IS_CUDA else (4096, 4096)
    w, bias = _rand(gen, n, k, scale=k**-0.5), _rand(gen, n)
    for m in (1, 8):
        x = _rand(gen, m, k)
        ref = gemv(x, w, bias, config=CFG)
        for pdl, prefetch in ((True, 0), (True, 2), (False, 1), (True, 1000)):
            assert torch.equal(gemv(x, w, bias, pdl=pdl, prefetch=prefetch, config=CFG), ref), (pdl, prefetch)


@pytest.mark.skipif(not IS_CUDA, reason="CUDA graphs need the GPU")
def test_pdl_chain_in_cuda_graph() -> None:
    """Two dependent products launched with PDL in a CUDA graph: the second waits for the first's output
    (gdc_wait), across replays with new inputs."""
    gen = torch.Generator().manual_seed(13)
    k = 4096
    w1, w2 = _rand(gen, k, k, scale=k**-0.5), _rand(gen, k, k, scale=k**-0.5)
    x = _rand(gen, 2, k)
    h = torch.empty(2, k, dtype=DTYPE, device=DEVICE)
    y = torch.empty(2, k, dtype=DTYPE, device=DEVICE)

    def step() -> None:
        gemv(x, w1, out=h, pdl=True, prefetch=2)
        gemv(h, w2, out=y, pdl=True, prefetch=2)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        x.copy_(_rand(gen, 2, k))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, gemv(gemv(x, w1), w2))


def test_config() -> None:
    for n, k in ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096), (1024, 4096)):
        for m in range(1, MAX_ROWS + 1):
            cfg = gemv_config(n, k, m)
            assert -(-n // cfg.block_n) >= 132, (n, k, m, cfg)  # a program per H200 multiprocessor at least
            assert cfg.block_k == 8 * 32 * cfg.num_warps == 1024, cfg  # one 16-byte run per thread and row
    assert gemv_config(4096, 4096, 1).block_n == 16 and gemv_config(4096, 4096, 8).block_n == 8
    assert gemv_config(4096, 200, 1) == GemvConfig(16, 256, 1)  # a short K: fewer warps
    assert gemv_config(4096, 4096, 1, elem_bytes=4).block_k == 512


def test_empty_and_invalid() -> None:
    gen = torch.Generator().manual_seed(3)
    n, k = 40, 64
    w, x = _rand(gen, n, k), _rand(gen, 2, k)
    assert gemv(x[:0], w).shape == (0, n)
    bias = _rand(gen, 5)
    assert torch.equal(gemv(_rand(gen, 2, 0), _rand(gen, 5, 0), bias), bias.expand(2, 5))
    bad: list[tuple[dict[str, Any], str]] = [
        ({"x": _rand(gen, MAX_ROWS + 1, k)}, "at most"),
        ({"x": _rand(gen, 2, k + 1)}, "does not fit"),
        ({"act": "silu"}, "does not fit"),  # x must be [M, 2K] with an activation
        ({"x": _rand(gen, 2, 2 * k), "act": "relu"}, "unknown activation"),
        ({"x": _rand(gen, 2, k, 1)}, "needs x"),
        ({"x": _rand(gen, k, 2).t()}, "last axis"),
        ({"w": _rand(gen, k, n).t()}, "contiguous"),
        ({"bias": _rand(gen, n + 1)}, "bias"),
        ({"w": w.double()}, "dtype"),
        ({"out": torch.empty(2, n + 1, dtype=DTYPE, device=DEVICE)}, "out must be"),
        ({"prefetch": -1}, "prefetch"),
        ({"config": GemvConfig(12, 256, 4)}, "powers of two"),
    ]
    for kw, msg in bad:
        args: dict[str, Any] = {"x": x, "w": w, **kw}
        with pytest.raises(ValueError, match=msg):
            gemv(args.pop("x"), args.pop("w"), **args)
