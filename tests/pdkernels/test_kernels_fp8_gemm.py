"""The block-scaled FP8 product (pdkernels/fp8_gemm.py) against float64 references: the activations'
per-token-group quantization (scales = group max / 448; values within e4m3's rounding), and the product of
quantized activations by an FP8 weight with 128x128 block scales against the dequantized operands'
product, with ragged M, N and K (partial blocks), a bias, and N tiles narrower than a block. Skipped
without CUDA; TRITON_INTERPRET=1 runs it on the CPU at these small shapes."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_support import DEVICE, require_triton

require_triton()

from engine.layers.fp8 import dequantize, quantize  # noqa: E402
from pdkernels.fp8_gemm import (  # noqa: E402
    block_fp8_matmul,
    cublas_blockwise_supported,
    fp8_linear,
    per_token_group_quant,
    prepare_weight_scales,
    scaled_mm_blockwise,
)

pytestmark = pytest.mark.cuda
IS_CUDA = DEVICE.type == "cuda"
SHAPES = [(1, 96, 128), (5, 200, 300), (70, 256, 256)] + ([(256, 4096, 4096), (3, 1000, 1500)] if IS_CUDA else [])


def _group_scales(scales: torch.Tensor, k: int) -> torch.Tensor:
    return scales.repeat_interleave(128, dim=1)[:, :k]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_per_token_group_quant(m: int, n: int, k: int) -> None:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).to(DEVICE) * 3
    if m > 1:
        x[1, :128] = 0.0  # an all-zero group
    q, scales = per_token_group_quant(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (m, -(-k // 128))
    groups = torch.nn.functional.pad(x.double(), (0, -k % 128)).view(m, -1, 128)
    want = groups.abs().amax(-1).clamp(min=1e-10) / 448
    torch.testing.assert_close(scales.double(), want, rtol=2e-7, atol=0)
    back = q.double() * _group_scales(scales.double(), k)
    # e4m3: relative error 2^-4 for normals, subnormal spacing 2^-9 (times the scale)
    assert ((back - x.double()).abs() <= x.double().abs() * 2**-4 + _group_scales(scales.double(), k) * 2**-9).all()


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("block_n", [256, 128, 64])
def test_block_fp8_matmul(m: int, n: int, k: int, has_bias: bool, block_n: int) -> None:
    """Against float64 (dequantized A) @ (dequantized W).T: the products of FP8 values are exact; what
    remains is the accumulation within a 128-wide K block, the float32 sum across blocks and the output's
    rounding. Hopper's FP8 tensor cores do not accumulate in full float32 (DeepGEMM measures about 14
    bits kept; the reason the kernel promotes to a float32 sum every 128 of K): the bound allows 2^-10 of
    the sum of |products|, still a hundredth of what a wrong scale, row or block would cost."""
    gen = torch.Generator().manual_seed(n + k)
    w8, w_scale = (t.to(DEVICE) for t in quantize(torch.randn(n, k, generator=gen) * 0.05))
    a8, a_scale = per_token_group_quant((torch.randn(m, k, generator=gen) * 2).to(DEVICE))
    bias = (torch.randn(n, generator=gen)).to(DEVICE) if has_bias else None
    out_dtype = torch.bfloat16 if IS_CUDA else torch.float32
    out = block_fp8_matmul(a8, a_scale, w8, w_scale, bias, out_dtype=out_dtype, block_n=block_n)
    a = a8.double() * _group_scales(a_scale.double(), k)
    w = dequantize(w8, w_scale, torch.float64)
    ref = a @ w.t() + (bias.double() if bias is not None else 0)
    accumulation = 2**-10 if IS_CUDA else 1e-5
    bound = torch.finfo(out_dtype).eps * ref.abs() + accumulation * (a.abs() @ w.abs().t()) + 1e-30
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert bool(((out.double() - ref).abs() <= bound).all())


def test_fp8_linear_and_errors() -> None:
    """fp8_linear = per_token_group_quant then block_fp8_matmul, leading dims kept; mismatched scales refused."""
    gen = torch.Generator().manual_seed(3)
    w8, w_scale = (t.to(DEVICE) for t in quantize(torch.randn(160, 200, generator=gen) * 0.05))
    x = torch.randn(2, 3, 200, generator=gen).to(DEVICE)
    out = fp8_linear(x, w8, w_scale)
    a8, a_scale = per_token_group_quant(x.view(6, 200))
    assert out.shape == (2, 3, 160)
    assert torch.equal(out.view(6, 160), block_fp8_matmul(a8, a_scale, w8, w_scale, out_dtype=x.dtype))
    # and close to the float product: activation and weight rounding of e4m3 (2^-4 relative each)
    ref = x.view(6, 200).double() @ dequantize(w8, w_scale, torch.float64).t()
    assert ((out.view(6, 160).double() - ref).abs() <= 0.15 * (x.view(6, 200).double().abs() @ dequantize(
        w8, w_scale, torch.float64).abs().t())).all()
    with pytest.raises(ValueError, match="128-blocks"):
        block_fp8_matmul(a8, a_scale[:, :1], w8, w_scale)
    with pytest.raises(ValueError, match="block_n"):
        block_fp8_matmul(a8, a_scale, w8, w_scale, block_n=96)


@pytest.mark.parametrize("m,n,k", [(1, 96, 128), (3, 200, 300), (8, 256, 1100)] + (
    [(1, 4096, 4096), (8, 28672, 4096), (2, 4096, 14336)] if IS_CUDA else []))  # fmt: skip
@pytest.mark.parametrize("has_bias", [False, True])
def test_fp8_gemv(m: int, n: int, k: int, has_bias: bool) -> None:
    """The decode GEMV with an FP8 weight and its block scales (pdkernels/gemv.py `scale`): x stays in its
    dtype, so the result is the product with the dequantized weight, to float32 accumulation and the
    output's rounding; ragged N and K (partial scale blocks, a K tail inside a tile)."""
    from pdkernels.gemv import GemvConfig, gemv

    gen = torch.Generator().manual_seed(n + k + m)
    dtype = torch.bfloat16 if IS_CUDA else torch.float32
    w8, w_scale = (t.to(DEVICE) for t in quantize(torch.randn(n, k, generator=gen) * 0.05))
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype) if has_bias else None
    config = None if IS_CUDA else GemvConfig(32, 512, 1)  # the interpreter runs programs one by one: wide tiles
    out = gemv(x, w8, bias, config=config, scale=w_scale)
    w = dequantize(w8, w_scale, torch.float64)
    ref = x.double() @ w.t() + (bias.double() if bias is not None else 0)
    bound = torch.finfo(dtype).eps * ref.abs() + 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-30
    assert out.shape == (m, n) and out.dtype == dtype
    assert bool(((out.double() - ref).abs() <= bound).all())
    with pytest.raises(ValueError, match="scale"):
        gemv(x, w8, bias, config=config, scale=torch.ones(7, 7, device=DEVICE))
    with pytest.raises(ValueError, match="share a dtype"):
        gemv(x, w8, bias, config=config)


def test_column_major_scales_with_rows_rounded_up() -> None:
    """rows_to (cuBLAS's layout): the same values and scales for the real rows, M rounded up to 4, the
    scales column-major."""
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    q, s = per_token_group_quant(x)
    q4, s4 = per_token_group_quant(x, rows_to=4)
    assert q4.shape == (8, 300) and s4.shape == (8, 3) and s4.stride() == (1, 8)
    assert torch.equal(q4[:5].float(), q.float()) and torch.equal(s4[:5], s)


@pytest.mark.skipif(not cublas_blockwise_supported(DEVICE), reason="cuBLAS's block-scaled FP8 GEMM: Hopper, torch's scaled_mm")
@pytest.mark.parametrize("m,n,k", [(1, 256, 384), (7, 512, 256), (64, 6144, 4096), (300, 4096, 14336)])
def test_cublas_blockwise_matches_the_triton_kernel(m: int, n: int, k: int) -> None:
    """The same quantized operands through cuBLAS (scaled_mm_blockwise) and block_fp8_matmul: equal to the
    accumulation order (the bound of test_block_fp8_matmul), the bias added after."""
    gen = torch.Generator().manual_seed(m + n)
    w8, w_scale = (t.to(DEVICE) for t in quantize(torch.randn(n, k, generator=gen) * 0.05))
    x = (torch.randn(m, k, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16)
    out = scaled_mm_blockwise(x, w8, prepare_weight_scales(w_scale), bias)
    a8, a_scale = per_token_group_quant(x)
    a = a8.double() * _group_scales(a_scale.double(), k)
    w = dequantize(w8, w_scale, torch.float64)
    ref = a @ w.t() + bias.double()
    bound = 2 * torch.finfo(torch.bfloat16).eps * ref.abs() + 2**-10 * (a.abs() @ w.abs().t()) + 1e-30
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert bool(((out.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m,k", [(1, 128), (5, 300), (70, 640)])
def test_activation_fused_into_the_quantization(act: str, m: int, k: int) -> None:
    """act (the down projection's input, [gate | up]): the same FP8 values and scales as fused_ops.silu_mul's
    output quantized, both layouts; and fp8_linear (and cuBLAS where it runs) with act equal to the two
    steps."""
    from pdkernels.fused_ops import silu_mul

    gen = torch.Generator().manual_seed(m * k)
    gate_up = (torch.randn(m, 2 * k, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    mid = silu_mul(gate_up, act)
    for rows_to in (1, 4):
        q, s = per_token_group_quant(mid, rows_to=rows_to)
        qa, sa = per_token_group_quant(gate_up, rows_to=rows_to, act=act)
        assert qa.shape == q.shape and sa.shape == s.shape
        assert torch.equal(qa[:m].float(), q[:m].float()) and torch.equal(sa[:m], s[:m]) and sa.stride() == s.stride()
    n = 256
    w8, w_scale = (t.to(DEVICE) for t in quantize(torch.randn(n, k, generator=gen) * 0.05))
    assert torch.equal(fp8_linear(gate_up, w8, w_scale, act=act), fp8_linear(mid, w8, w_scale))
    if cublas_blockwise_supported(DEVICE) and k % 128 == 0:
        w_t = prepare_weight_scales(w_scale)
        assert torch.equal(scaled_mm_blockwise(gate_up, w8, w_t, act=act), scaled_mm_blockwise(mid, w8, w_t))
    with pytest.raises(ValueError, match="activation"):
        per_token_group_quant(gate_up, act="relu")
    with pytest.raises(ValueError, match="activation"):
        per_token_group_quant(gate_up[:, 1:], act="silu")


@pytest.mark.parametrize("rows_to", [1, 4])
@pytest.mark.parametrize("m,n", [(1, 128), (5, 384), (70, 256)])
def test_norms_quantize_their_output_in_the_same_pass(rows_to: int, m: int, n: int) -> None:
    """fused_ops.rms_norm_quant and add_rms_norm_quant (also with a sandwich norm's output norm): the norm's
    output as before, and the FP8 values and scales per_token_group_quant makes of it, in its layout; no
    quantization where the width is not whole groups of 128. engine/layers/fp8.py's carrier hands them to the GEMM
    in that layout only."""
    from engine.layers import fp8
    from pdkernels.fp8_gemm import CUBLAS_ROWS_TO
    from pdkernels.fused_ops import add_rms_norm, add_rms_norm_quant, rms_norm, rms_norm_quant

    assert fp8.CUBLAS_ROWS_TO == CUBLAS_ROWS_TO
    gen = torch.Generator().manual_seed(m * n)
    x, h = ((torch.randn(m, n, generator=gen) * 3).to(DEVICE, torch.bfloat16) for _ in range(2))
    w, w0 = ((1 + torch.randn(n, generator=gen) * 0.1).to(DEVICE, torch.bfloat16) for _ in range(2))

    def same(quantized: tuple[torch.Tensor, torch.Tensor] | None, normed: torch.Tensor) -> None:
        assert quantized is not None
        q, s = per_token_group_quant(normed, rows_to=rows_to)
        assert quantized[0].dtype == torch.float8_e4m3fn and quantized[0].shape == q.shape
        assert quantized[1].shape == s.shape and quantized[1].stride() == s.stride()
        assert torch.equal(quantized[0][:m].float(), q[:m].float()) and torch.equal(quantized[1][:m], s[:m])

    normed, quantized = rms_norm_quant(x, w, 1e-6, False, rows_to)
    assert torch.equal(normed, rms_norm(x, w, 1e-6, False))
    same(quantized, normed)
    for is_gemma, h_weight in ((False, None), (True, w0)):
        total, normed, quantized = add_rms_norm_quant(x, h, w, 1e-6, is_gemma, h_weight=h_weight, quant_rows=rows_to)
        want_total, want = add_rms_norm(x, h, w, 1e-6, is_gemma, h_weight=h_weight)
        assert torch.equal(total, want_total) and torch.equal(normed, want)
        same(quantized, normed)
    assert rms_norm_quant(x[:, :100].contiguous(), w[:100], 1e-6, False, rows_to)[1] is None
    carried = fp8.with_quantized(normed, quantized, rows_to)
    assert fp8.quantized_input(carried, rows_to) is quantized and fp8.quantized_input(carried, 5 - rows_to) is None
    assert fp8.quantized_input(x, rows_to) is None
