"""The fused projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj) that CUDA engines switch to
after loading: same logits as the separate projections, same weight bytes. Run on the CPU through the
torch fallbacks of the fused code path (the Triton kernels have their own GPU tests)."""

from __future__ import annotations

import pytest
import torch

from tests.engine_utils import prompt_logits, small_engine

FAMILIES = ["llama", "qwen2", "qwen3_hybrid", "gemma3_hybrid"]


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_projections_match_separate(tiny_model_dir, family: str) -> None:
    eng = small_engine(tiny_model_dir(family))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (40, 9)]
    before = prompt_logits(eng, prompts, chunks=[[17, 23], [9]])
    weight_bytes = sum(p.numel() for p in eng.model.parameters())
    eng.model.fuse_projections()
    names = {n for n, _ in eng.model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    assert sum(p.numel() for p in eng.model.parameters()) == weight_bytes
    after = prompt_logits(eng, prompts, chunks=[[17, 23], [9]])
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    eng.check_idle()
