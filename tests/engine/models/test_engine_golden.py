"""The engine's golden tests: same greedy tokens and logits as transformers on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams
from tests.engine_utils import compare_greedy, hf_greedy, prompt_logits, small_engine
from tests.tiny_models import FAMILIES

NEW_TOKENS = 64


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("is_deterministic", [False, True], ids=["default", "deterministic"])
def test_tiny_greedy_matches_transformers(tiny_model_dir, family: str, is_deterministic: bool) -> None:
    folder = tiny_model_dir(family)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 512, (90,), generator=gen).tolist()  # > several 24-token windows, 16-token pages
    ref_tokens, ref_logits, ref_first = hf_greedy(folder, prompt, NEW_TOKENS)

    eng = small_engine(folder, is_deterministic=is_deterministic, max_num_batched_tokens=40)  # prompt in 3 chunks
    (first,) = prompt_logits(eng, [prompt])
    torch.testing.assert_close(first, ref_first, rtol=1e-4, atol=1e-4)

    (seq,) = eng.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    note = compare_greedy(seq.output_token_ids, ref_tokens, ref_logits, tie_gap=1e-3)
    if note:
        print(f"{family}: {note}")
    eng.check_idle()
