"""pdkernels/fused_ops.py against the torch code it replaces (engine/models/decoder.py), on random inputs with
poisoned outputs (skipped without CUDA; TRITON_INTERPRET=1 runs it on the CPU in float32)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_support import DEVICE, DTYPE, require_triton

require_triton()

from engine.layers.norm import RMSNorm  # noqa: E402
from engine.layers.rotary import rotate_half  # noqa: E402
from pdkernels.fused_ops import add_rms_norm, qk_rope_, rms_norm, silu_mul  # noqa: E402

pytestmark = pytest.mark.cuda


def _rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(DEVICE, DTYPE)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's spacing at b's magnitude."""
    eps = torch.finfo(b.dtype).eps
    return float(((a.float() - b.float()).abs() / (b.float().abs().clamp_min(1e-3) * eps)).max())


@pytest.mark.parametrize("is_gemma", [False, True])
@pytest.mark.parametrize("rows,cols", [(1, 4096), (37, 640), (5, 100)])
def test_rms_norm_matches_torch(is_gemma: bool, rows: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(rows * cols + is_gemma)
    norm = RMSNorm(cols, 1e-6, is_gemma).to(DEVICE, DTYPE)
    norm.weight.data = _rand(gen, cols, scale=0.3) + (0.0 if is_gemma else 1.0)
    x = _rand(gen, rows, cols, scale=3.0)
    # torch's own arithmetic, bypassing the CUDA dispatch in RMSNorm.forward
    xf = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = (xf * (1.0 + norm.weight.float())).to(DTYPE) if is_gemma else norm.weight * xf.to(DTYPE)
    got = rms_norm(x, norm.weight, 1e-6, is_gemma)
    assert not got.isnan().any()
    # the mean of squares sums in another order: a bf16 result may round the other way (twice at most)
    assert _ulps(got, ref) <= (2.0 if DTYPE == torch.bfloat16 else 8.0), _ulps(got, ref)


def _assert_rotary_close(got: torch.Tensor, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         slack: float = 1.5) -> None:
    """got against torch's qk * cos + rotate_half(qk) * sin: torch rounds both products and the sum to the
    dtype; the kernel may keep a product unrounded (the compiler can fuse it into the sum): at most one
    rounding of each term and one of the sum apart (slack: in units of eps times the terms' size)."""
    ref = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    eps = torch.finfo(DTYPE).eps
    terms = ((qk * cos[:, None]).float().abs() + (rotate_half(qk) * sin[:, None]).float().abs())
    err = (got.float() - ref.float()).abs()
    assert bool((err <= slack * eps * terms + 1e-30).all()), float((err / terms.clamp_min(1e-30)).max())


def test_rotary_matches_torch() -> None:
    gen = torch.Generator().manual_seed(11)
    tokens, q_heads, kv_heads, dim = 7, 8, 2, 128
    packed = _rand(gen, tokens, q_heads + 2 * kv_heads, dim)
    cos, sin = _rand(gen, tokens, dim), _rand(gen, tokens, dim)
    qk = packed[:, : q_heads + kv_heads].clone()
    v_before = packed[:, q_heads + kv_heads :].clone()
    qk_rope_(packed[:, : q_heads + kv_heads], q_heads, cos, sin)  # no norm weights: rotary alone
    _assert_rotary_close(packed[:, : q_heads + kv_heads], qk, cos, sin)
    assert torch.equal(packed[:, q_heads + kv_heads :], v_before)  # v untouched


@pytest.mark.parametrize("rows,n", [(1, 14336), (9, 1000)])
def test_silu_mul_matches_torch(rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    gate_up = _rand(gen, rows, 2 * n, scale=2.0)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    got = silu_mul(gate_up)
    assert got.shape == ref.shape and not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=2 * torch.finfo(DTYPE).eps, atol=1e-6)


@pytest.mark.parametrize("rows,n", [(1, 14336), (9, 1000)])
def test_gelu_tanh_mul_matches_torch(rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows + n + 1)
    gate_up = _rand(gen, rows, 2 * n, scale=2.0)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.gelu(gate, approximate="tanh") * up
    got = silu_mul(gate_up, "gelu_tanh")
    assert got.shape == ref.shape and not got.isnan().any()
    # tanh computed another way than torch's: within a rounding of the activation, then the product's
    torch.testing.assert_close(got, ref, rtol=4 * torch.finfo(DTYPE).eps, atol=1e-5)
    with pytest.raises(ValueError):
        silu_mul(gate_up, "relu")


@pytest.mark.parametrize("is_gemma", [False, True])
def test_add_rms_norm_with_sandwich_output_norm(is_gemma: bool) -> None:
    """x + norm0(h), then normed (one kernel for the Gemma norm in bf16): exactly the layer-by-layer
    kernels' result."""
    gen = torch.Generator().manual_seed(11)
    x, h = _rand(gen, 7, 4096), _rand(gen, 7, 4096, scale=3.0)
    w0, w = _rand(gen, 4096, scale=0.2) + 1.0, _rand(gen, 4096, scale=0.2) + 1.0
    total, normed = add_rms_norm(x, h, w, 1e-6, is_gemma, h_weight=w0)
    want_total = x + rms_norm(h, w0, 1e-6, is_gemma)
    assert torch.equal(total, want_total)
    assert torch.equal(normed, rms_norm(want_total, w, 1e-6, is_gemma))


def test_add_rms_norm_matches_add_then_norm() -> None:
    gen = torch.Generator().manual_seed(5)
    x, h = _rand(gen, 6, 4096), _rand(gen, 6, 4096)
    weight = _rand(gen, 4096, scale=0.2) + 1.0
    total, normed = add_rms_norm(x, h, weight, 1e-5, False)
    assert torch.equal(total, x + h)
    assert torch.equal(normed, rms_norm(x + h, weight, 1e-5, False))  # the same kernel's arithmetic


@pytest.mark.parametrize("is_gemma", [False, True])
def test_qk_rope_is_norm_then_rotary(is_gemma: bool) -> None:
    """qk_rope_ with norm weights (one launch) against rms_norm per head (q and k each with their own
    weight), then torch's rotary, on a strided view of a packed projection; v untouched. The norm's
    mean of squares may sum in another order than rms_norm's: one more rounding of slack."""
    gen = torch.Generator().manual_seed(12 + is_gemma)
    tokens, q_heads, kv_heads, dim = 7, 24, 8, 128
    packed = _rand(gen, tokens, q_heads + 2 * kv_heads, dim)
    cos, sin = _rand(gen, tokens, dim), _rand(gen, tokens, dim)
    qw = _rand(gen, dim, scale=0.3) + (0.0 if is_gemma else 1.0)
    kw = _rand(gen, dim, scale=0.3) + (0.0 if is_gemma else 1.0)
    normed = torch.cat([rms_norm(packed[:, :q_heads], qw, 1e-6, is_gemma),
                        rms_norm(packed[:, q_heads : q_heads + kv_heads], kw, 1e-6, is_gemma)], dim=1)
    got = packed.clone()
    qk_rope_(got[:, : q_heads + kv_heads], q_heads, cos, sin, qw, kw, 1e-6, is_gemma)
    assert torch.equal(got[:, q_heads + kv_heads :], packed[:, q_heads + kv_heads :])
    _assert_rotary_close(got[:, : q_heads + kv_heads], normed, cos, sin, slack=1.5 if DTYPE == torch.float32 else 3.0)
