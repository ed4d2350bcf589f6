"""Speculative decoding on CUDA (skipped without a GPU): a verify as decode rows (1 + k rows per sequence
through the paged decode kernels, replayed from the verify graphs; a sliding layer one launch per row of a
sequence) for full-attention, latent and hybrid models; deterministic mode's tokens and logprobs identical
to the same requests without speculation, graphed and eager."""

from __future__ import annotations

import random

import pytest
import torch

from engine.request import SamplingParams
from tests.engine.speculative.test_speculator import NGRAM, oracle_proposer
from tests.engine_utils import random_prompts, small_engine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
FAMILIES = ["llama", "qwen3", "qwen3_hybrid", "gemma3_hybrid", "deepseek_v3"]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_verify_on_cuda_gives_the_same_tokens(tmp_path_factory, tiny_model_dir, family: str, eager: bool) -> None:
    from tests.tiny_models import FAMILIES as DENSE
    from tests.tiny_models import make_tiny

    folder = tiny_model_dir(family) if family in DENSE else make_tiny(family, tmp_path_factory.mktemp(family))
    base = random_prompts([12], seed=3)[0]
    prompts = [base * 3, random_prompts([30], seed=4)[0], base[:5] * 5, random_prompts([47], seed=5)[0]]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=33, temperature=0.0, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    ]
    kw = dict(device="cuda", is_deterministic=True, max_num_seqs=8, hicache_gb=0.1, enforce_eager=eager)
    ref = small_engine(folder, **kw).generate(prompts, params)
    reference = {tuple(p): s.output_token_ids for p, s in zip(prompts, ref)}
    spec = small_engine(folder, speculative_config=NGRAM, **kw)
    if not eager:
        assert spec.graph_stats is not None and spec.graph_stats.verify_sizes
    assert spec.speculator is not None
    spec.speculator._propose = oracle_proposer(reference, random.Random(11))  # type: ignore[method-assign]
    got = spec.generate(prompts, params)
    for r, g in zip(ref, got):
        assert g.output_token_ids == r.output_token_ids
        assert g.output_logprobs == r.output_logprobs
    st = spec.stats()
    assert 0 < st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total
    spec.check_idle()
