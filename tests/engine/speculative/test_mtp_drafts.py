"""Speculative decoding with DeepSeek-V3's own multi-token-prediction layer (engine/speculative/mtp.py) on tiny
checkpoints that carry one (tests/tiny_models.py make_tiny_mtp), --deterministic: the drafts are what the MTP
layer predicts from the whole sequence at once (its KV filled step by step in lockstep with the target's:
prefill chunks, decodes, verifies with rejected tails), the chained second draft included; the output is
the target's own, token for token, greedy and seeded; memory all free after."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.core.sequence import Sequence
from engine.layers.context import SeqChunk, forward_context
from engine.request import SamplingParams
from tests.engine.speculative.test_draft_model import record_drafts
from tests.engine_utils import random_prompts, small_engine
from tests.tiny_models import make_tiny_mtp

# the drafts counted: the switch (engine/speculative/switch.py) would stop drafting where they do not pay
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2, "auto_disable": False})


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> Path:
    # a 16-token vocabulary: the random MTP head guesses right often enough for drafts to be accepted
    return make_tiny_mtp("deepseek_v3", tmp_path_factory.mktemp("mtp"), vocab_size=16, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)  # fmt: skip


def _reference_drafts(eng, tokens: list[int]) -> list[int]:
    """The MTP layer's two chained drafts after `tokens` (its last token not yet computed), from one forward
    of the target over tokens[:-1] and one MTP forward over every position, then one chained row."""
    seq = Sequence("ref", tokens[:-1], SamplingParams(), 0, 0.0)
    eng.scheduler.allocate(seq)
    try:
        runner = eng.runner
        runner.keep_hidden = True
        runner.run([seq], [len(tokens) - 1])
        hidden = runner.last_hidden
        mtp = eng.model.mtp[0]
        c = len(tokens) - 1

        def forward(chunk: SeqChunk, ids: list[int], positions: list[int], prev: torch.Tensor) -> tuple[torch.Tensor, int]:
            with forward_context([chunk], eng.kv, eng.numerics, config=eng.config.forward):
                out = mtp(torch.tensor(ids), torch.tensor(positions), prev)
                return out, int(mtp.logits(out[-1:]).argmax(-1))

        out, d1 = forward(SeqChunk(0, c, 0, seq.block_ids, seq.state_slot), tokens[1:], list(range(c)), hidden)
        _, d2 = forward(SeqChunk(0, 1, c, seq.block_ids, seq.state_slot), [d1], [c], out[-1:])
        return [d1, d2]
    finally:
        eng.scheduler.release(seq)


def test_mtp_drafts_are_the_layers_own_predictions_and_the_output_is_unchanged(mtp_model) -> None:
    prompts = [random_prompts([40], seed=1, vocab=16)[0], random_prompts([23], seed=2, vocab=16)[0]]
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True),
    ]
    plain = small_engine(mtp_model, is_deterministic=True, max_num_batched_tokens=24)  # prompts in chunks
    assert plain.model.mtp is None  # built only when asked for
    ref = plain.generate(prompts, params)

    eng = small_engine(mtp_model, is_deterministic=True, max_num_batched_tokens=24, speculative_config=MTP)
    assert eng.model.mtp is not None and eng.speculator is not None and eng.speculator.mtp is not None
    assert eng.kv.layout.num_full_layers == plain.kv.layout.num_full_layers + 1  # the MTP layer's KV
    seen = record_drafts(eng.speculator.mtp)
    got = eng.generate(prompts, params)
    for r, g in zip(ref, got):
        assert g.output_token_ids == r.output_token_ids
        assert g.output_logprobs == r.output_logprobs
    eng.check_idle()
    st = eng.stats()
    assert st.spec_num_drafts_total == len(seen) > 10
    assert 0 < st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total
    assert any(len(d) == 2 for _, d in seen)

    checker = small_engine(mtp_model, is_deterministic=True, speculative_config=MTP)
    for tokens, drafts in seen[:: max(1, len(seen) // 12)]:
        assert drafts == _reference_drafts(checker, tokens)[: len(drafts)]
    checker.check_idle()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_mtp_on_cuda_gives_the_same_tokens(mtp_model, eager: bool) -> None:
    """CUDA, bf16, deterministic: the target's verify as decode rows (graphed or eager), the MTP layer's
    catch-up and chain on the prefill path; the same tokens as without speculation."""
    prompts = [random_prompts([40], seed=1, vocab=16)[0], random_prompts([23], seed=2, vocab=16)[0]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    kw = dict(device="cuda", is_deterministic=True, max_num_seqs=8, hicache_gb=0.1, enforce_eager=eager)
    ref = small_engine(mtp_model, **kw).generate(prompts, params)
    eng = small_engine(mtp_model, speculative_config=MTP, **kw)
    got = eng.generate(prompts, params)
    for r, g in zip(ref, got):
        assert g.output_token_ids == r.output_token_ids
        assert g.output_logprobs == r.output_logprobs
    st = eng.stats()
    assert 0 < st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total
    eng.check_idle()
