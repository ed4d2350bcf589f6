"""Deterministic mode: a sequence's logits are bit-identical whatever else is in the batch, where it
sits in the batch, and however its prompt is chunked; decode steps likewise. On the CPU (float32) and,
where there is one, on CUDA (bfloat16, the batch-invariant Triton kernels)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.numerics import Numerics, run_rows
from engine.request import SamplingParams
from tests.engine_utils import prompt_logits, small_engine

FAMILIES = ["llama", "gemma3_hybrid", "qwen3_hybrid"]
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def _engine(folder, device: str, **kw):
    # NOTE: no host prefix cache on CUDA: its default 32 GiB of pinned memory takes seconds to allocate,
    # and the properties here do not involve it.
    return small_engine(folder, is_deterministic=True, device=device, **({"hicache_gb": 0.0} if device == "cuda" else {}),
                        **kw)


def _prompts(n: int, lengths: list[int], seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (L,), generator=gen).tolist() for L in lengths[:n]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_batch_and_chunk_invariant(tiny_model_dir, family: str, device: str) -> None:
    eng = _engine(tiny_model_dir(family), device)
    if device == "cuda":
        assert eng.numerics is Numerics.BATCH_INVARIANT
    target, *others = _prompts(4, [77, 5, 130, 33])
    (alone,) = prompt_logits(eng, [target])
    batched = prompt_logits(eng, [others[0], target, others[1], others[2]])[1]
    first_in_batch = prompt_logits(eng, [target, others[2]])[0]
    chunked = prompt_logits(eng, [target], chunks=[[30, 1, 29, 17]])[0]
    chunked_in_batch = prompt_logits(eng, [others[1], target], chunks=[[50, 80], [13, 40, 24]])[1]
    for other in (batched, first_in_batch, chunked, chunked_in_batch):
        assert torch.equal(alone, other), (alone - other).abs().max()
    eng.check_idle()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_logits_batch_invariant(tiny_model_dir, family: str, device: str) -> None:
    """The same request's decode-step logits alone and among requests of other lengths."""
    eng = _engine(tiny_model_dir(family), device, max_num_batched_tokens=48)
    captured: dict[str, list[torch.Tensor]] = {}
    run = eng.runner.run

    def recording_run(seqs, num_new, **kw):
        sampled, logits = run(seqs, num_new, **kw)
        for j, i in enumerate(sampled):
            captured.setdefault(seqs[i].request_id, []).append(logits[j].clone())
        return sampled, logits

    eng.runner.run = recording_run  # type: ignore[method-assign]
    target, *others = _prompts(4, [61, 9, 100, 40], seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng.add_request("alone", target, params)
    while eng.has_unfinished():
        eng.step()
    for i, p in enumerate(others):
        eng.add_request(f"o{i}", p, SamplingParams(max_tokens=5 + 4 * i, temperature=0.0, ignore_eos=True))
    eng.add_request("batched", target, params)
    while eng.has_unfinished():
        eng.step()
    # a sequence fed ahead has one more row computed after its last token, which the engine drops
    alone, batched = captured["alone"][:12], captured["batched"][:12]
    assert len(alone) == len(batched) == 12
    for a, b in zip(alone, batched):
        assert torch.equal(a, b), (a - b).abs().max()
    eng.check_idle()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_row_functions_batch_invariant_on_cuda(tiny_model_dir, family: str) -> None:
    """Every row-local function of the model (norms, projections, rotary, MLP, logits) under
    BATCH_INVARIANT: row i of an M-row call equals row i computed alone, for several M."""
    eng = _engine(tiny_model_dir(family), "cuda")
    gen = torch.Generator().manual_seed(9)
    for fn, widths in eng.model.row_functions():
        xs = [torch.randn(200, w, generator=gen).to("cuda", eng.dtype) for w in widths]
        with torch.inference_mode():
            alone = torch.cat([run_rows(fn, tuple(x[i : i + 1] for x in xs), Numerics.BATCH_INVARIANT)
                               for i in range(200)])
            for m in (1, 3, 16, 17, 64, 200):
                rows = run_rows(fn, tuple(x[:m] for x in xs), Numerics.BATCH_INVARIANT)
                assert torch.equal(rows, alone[:m]), (fn, m)


def test_default_mode_is_close_but_may_differ(tiny_model_dir) -> None:
    """Sanity of the comparison itself: in default mode batched logits agree to float tolerance."""
    eng = small_engine(tiny_model_dir("llama"))
    target, other = _prompts(2, [77, 130])
    (alone,) = prompt_logits(eng, [target])
    batched = prompt_logits(eng, [other, target])[1]
    torch.testing.assert_close(alone, batched, rtol=1e-4, atol=1e-4)
