"""DecoderLayer.forward_chained (the CUDA path: each residual add inside the norm that follows it, a
family's layer variant included) against forward(), on the CPU: pdkernels/fused_ops.py's norms stood in by
their arithmetic in torch, so the chaining's logic (which add goes in which norm, the sandwich output norm
carried to the next layer) is checked where CI runs; the kernels themselves are checked on the GPU
(tests/pdkernels/test_kernels_fused_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import engine.models.decoder as decoder
from engine.request import SamplingParams
from tests.engine_utils import prompt_logits, small_engine


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """engine/layers/norm.py RMSNorm's arithmetic."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * (1.0 + w.float())).type_as(x)
    return w * xf.to(x.dtype)


def _add_rms_norm(x, h, w, eps, unit_offset, h_weight=None):  # noqa: ANN001, ANN202
    total = x + (h if h_weight is None else _norm(h, h_weight, eps, unit_offset))
    return total, _norm(total, w, eps, unit_offset)


TORCH_OPS = SimpleNamespace(
    rms_norm=_norm,
    rms_norm_quant=lambda x, w, eps, unit_offset, rows_to=0: (_norm(x, w, eps, unit_offset), None),
    add_rms_norm=_add_rms_norm,
    add_rms_norm_quant=lambda x, h, w, eps, unit_offset, h_weight=None, quant_rows=0: (
        *_add_rms_norm(x, h, w, eps, unit_offset, h_weight), None
    ),
)


@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid", "qwen3_moe"])
def test_chained_residuals_match_the_plain_forward(tiny_model_dir, family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = small_engine(tiny_model_dir(family))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (40, 23)]
    plain = prompt_logits(eng, prompts)
    (ref,) = eng.generate([prompts[0]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    calls = []

    def chained(self, ops, x, pending, cos, sin):  # noqa: ANN001, ANN202
        calls.append(type(self).__name__)
        return real(self, ops, x, pending, cos, sin)

    real = decoder.DecoderLayer.forward_chained
    monkeypatch.setattr(decoder, "fused_ops_for", lambda x: TORCH_OPS)
    monkeypatch.setattr(decoder.DecoderLayer, "forward_chained", chained)
    got = prompt_logits(eng, prompts)
    (seq,) = eng.generate([prompts[0]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert calls and len(set(calls)) == 1  # every layer went through the chained path
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert seq.output_token_ids == ref.output_token_ids
    eng.check_idle()
