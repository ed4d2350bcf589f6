"""The golden test on CUDA in bf16, on the real checkpoints (SmolLM2-135M-Instruct, Gemma 3 270M).

Greedy tokens identical to transformers bf16 for 32 new tokens, or parting only on a near-tie (the
reference's top-2 logit gap under 0.05 at that step, reported); in deterministic mode, the engine's
batched and one-at-a-time runs bit-identical. The checks live in bench/checks/gpu_golden.py, which also runs
them on the GPU machine without pytest. Skipped without CUDA or without the converted checkpoints
(`python -m engine.checkpoints fetch NAME`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.checkpoints import models_home

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NEW_TOKENS = 32
TIE_GAP = 0.05
MODELS = ["smollm2-135m-instruct", "gemma3-270m"]


def _gpu_check():
    from bench.checks import gpu_golden

    return gpu_golden


def _folder(name: str) -> Path:
    folder = models_home() / name
    if not (folder / "config.json").is_file():
        pytest.skip(f"{name} is not converted: python -m engine.checkpoints fetch {name}")
    return folder


@pytest.mark.parametrize("name", MODELS)
def test_bf16_greedy_matches_transformers(name: str) -> None:
    gc = _gpu_check()
    folder = _folder(name)
    prompts = gc.prompts_for(folder)
    assert len(prompts["long"]) > 1100
    results = gc.golden(folder, torch.device("cuda"), torch.bfloat16, NEW_TOKENS, TIE_GAP, prompts)
    for line in gc.summary_lines({"models": {name: {"golden": results}}}):
        print(line)
    bad = [r for r in results if r["status"] not in ("identical", "near-tie")]
    assert not bad, bad


@pytest.mark.parametrize("name", MODELS)
def test_deterministic_batched_equals_alone(name: str) -> None:
    gc = _gpu_check()
    folder = _folder(name)
    results = gc.determinism(folder, torch.device("cuda"), torch.bfloat16, NEW_TOKENS)
    for line in gc.summary_lines({"models": {name: {"determinism": results}}}):
        print(line)
    assert all(r["status"] == "identical" for r in results), results
