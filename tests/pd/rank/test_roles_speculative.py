"""A P/D pair whose CE speculates (engine/speculative/), driven by hand as in test_roles.py on tiny engines
(qwen3_hybrid: full and sliding layers, --deterministic): the PE prefills and hands off as ever, the CE
drafts from its first decode step (prompt lookup needs nothing but the tokens the handoff carries) and
decodes the single engine's tokens; a second turn reuses the CE's retained pages (the decode cache holds
only verified tokens' pages); drafts accepted and rejected, rings and pages rolled back, both idle."""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from engine.request import SamplingParams
from pd.messages import Prefill, PrefillResult, Reserve, Reserved
from tests.engine.speculative.test_mtp_drafts import _reference_drafts
from tests.engine.speculative.test_speculator import NGRAM, oracle_proposer
from tests.engine_utils import small_engine
from tests.pd.rank.test_roles import Side, decode_all, handoff, idle, pd_pair, receiver, run_until


@pytest.fixture
def spec_pd(tiny_model_dir, monkeypatch):
    folder = tiny_model_dir("qwen3_hybrid")
    pe_engine = small_engine(folder, hicache_gb=0.01, is_deterministic=True)
    ce_engine = small_engine(folder, hicache_gb=0, is_deterministic=True, speculative_config=NGRAM)
    with pd_pair(monkeypatch, pe_engine, ce_engine) as (pe, ce):
        yield pe, ce, folder


def speculating_pd(
    monkeypatch: pytest.MonkeyPatch, folder: Path, speculative_config: str
) -> AbstractContextManager[tuple[Side, Side]]:
    """pd_pair of two engines that both speculate with speculative_config (the PE fills the drafter's KV)."""
    pe_engine = small_engine(folder, hicache_gb=0, is_deterministic=True, speculative_config=speculative_config)
    ce_engine = small_engine(folder, hicache_gb=0, is_deterministic=True, speculative_config=speculative_config)
    return pd_pair(monkeypatch, pe_engine, ce_engine)


def test_a_speculating_ce_decodes_like_one_engine_over_two_turns(spec_pd) -> None:
    pe, ce, folder = spec_pd
    single = small_engine(folder, hicache_gb=0, is_deterministic=True)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    first = [(i * 37) % 400 + 3 for i in range(45)]  # > the SWA window (24): the ring wraps
    (want1,) = single.generate([first], params)
    second = first + want1.output_token_ids + [5, 6, 7, 8, 9]
    (want2,) = single.generate([second], params)
    reference = {tuple(first): want1.output_token_ids, tuple(second): want2.output_token_ids}
    assert ce.engine.speculator is not None
    ce.engine.speculator._propose = oracle_proposer(reference, random.Random(3))  # type: ignore[method-assign]

    handoff(pe, ce, "t1", first, params)
    assert decode_all([pe, ce], ce, "t1") == want1.output_token_ids
    # the second turn's reservation names its prompt: the CE's retained pages of it are pinned, the rest sent
    ce.handle(Reserve("t2", len(second) + 1, len(second) + params.max_tokens, 30.0, tuple(second)))
    assert ce.take(Reserved, "t2") is not None
    pe.handle(Prefill("t2", tuple(second), params, receiver(ce), 20.0))
    run_until([pe, ce], lambda: any(isinstance(m, PrefillResult) for m in pe.sent))
    assert pe.take(PrefillResult, "t2").is_handed_off
    assert decode_all([pe, ce], ce, "t2") == want2.output_token_ids
    st = ce.engine.stats()
    assert 0 < st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total
    # the second turn found the first turn's pages on the CE: their tokens are verified ones
    assert st.decode_cache_hit_tokens_total > 0
    idle(pe, ce)


def test_mtp_on_both_sides_decodes_like_one_engine(tmp_path, monkeypatch) -> None:
    """DeepSeek-V3 with its MTP layer, --speculative-config mtp on the PE and the CE: the PE's prefill fills the
    MTP layer's KV for the whole prompt (its pages carry it), the CE drafts from its first decode step on."""
    from tests.tiny_models import make_tiny_mtp

    folder = make_tiny_mtp("deepseek_v3", tmp_path / "mtp", vocab_size=16, bos_token_id=None, eos_token_id=None,
                           pad_token_id=None)  # fmt: skip
    mtp = '{"method": "mtp", "num_speculative_tokens": 2, "auto_disable": false}'
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = [(i * 7) % 13 + 2 for i in range(40)]
    (want,) = small_engine(folder, hicache_gb=0, is_deterministic=True).generate([prompt], params)
    with speculating_pd(monkeypatch, folder, mtp) as (pe, ce):
        seen: list[tuple[list[int], list[int]]] = []
        propose = ce.engine.speculator.mtp.propose

        def recording(seq, k):  # type: ignore[no-untyped-def]
            got = propose(seq, k)
            if got:
                seen.append((seq.token_ids(0, seq.num_tokens), got))
            return got

        ce.engine.speculator.mtp.propose = recording
        assert handoff(pe, ce, "m", prompt, params).is_handed_off
        assert decode_all([pe, ce], ce, "m") == want.output_token_ids
        # the CE's drafts are the MTP layer's predictions from the whole sequence: the KV the PE sent held its prompt
        checker = small_engine(folder, hicache_gb=0, is_deterministic=True, speculative_config=mtp)
        for tokens, drafts in seen[:4]:
            assert drafts == _reference_drafts(checker, tokens)[: len(drafts)]
        st = ce.engine.stats()
        assert 0 < st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total
        assert pe.engine.stats().spec_num_drafts_total == 0  # a PE only prefills
        idle(pe, ce)


@pytest.mark.parametrize("draft", ["small", "self"])
def test_a_draft_model_on_both_sides_decodes_like_one_engine(tmp_path, monkeypatch, draft: str) -> None:
    """--speculative-config draft_model on the PE and the CE (a small llama, or the target itself): the PE's
    prefill fills the draft's KV of the whole prompt in the pages it hands off; the CE drafts from its first
    decode step on, its drafts the draft model's greedy chain over the whole sequence (the target as its own
    draft: every one accepted), and decodes the single engine's tokens; a second turn reuses the CE's retained
    pages, the draft's KV in them too."""
    from tests.engine.speculative.test_draft_model import SMALL, VOCAB, record_drafts, reference_drafts, spec
    from tests.tiny_models import make_tiny

    folder = make_tiny("llama", tmp_path / "target", **VOCAB)
    drafter_folder = make_tiny("llama", tmp_path / "draft", seed=1, **VOCAB, **SMALL) if draft == "small" else folder
    config = spec(drafter_folder)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = [(i * 7) % 13 + 2 for i in range(40)]
    single = small_engine(folder, hicache_gb=0, is_deterministic=True)
    (want,) = single.generate([prompt], params)
    second = prompt + want.output_token_ids + [5, 6, 7]
    (want2,) = single.generate([second], params)
    with speculating_pd(monkeypatch, folder, config) as (pe, ce):
        drafter = ce.engine.speculator.draft_model
        seen = record_drafts(drafter)
        assert handoff(pe, ce, "d", prompt, params).is_handed_off
        assert decode_all([pe, ce], ce, "d") == want.output_token_ids
        ce.handle(Reserve("d2", len(second) + 1, len(second) + params.max_tokens, 30.0, tuple(second)))
        assert ce.take(Reserved, "d2") is not None
        pe.handle(Prefill("d2", tuple(second), params, receiver(ce), 20.0))
        run_until([pe, ce], lambda: any(isinstance(m, PrefillResult) for m in pe.sent))
        assert pe.take(PrefillResult, "d2").is_handed_off
        assert decode_all([pe, ce], ce, "d2") == want2.output_token_ids
        for tokens, drafts in [*seen[:4], *seen[-4:]]:
            assert drafts == reference_drafts(drafter, tokens, len(drafts))
        st = ce.engine.stats()
        assert st.decode_cache_hit_tokens_total > 0
        assert st.spec_num_drafts_total == len(seen) > 4
        if draft == "self":
            assert st.spec_num_accepted_tokens_total == st.spec_num_draft_tokens_total
        else:
            assert 0 < st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total
        assert pe.engine.stats().spec_num_drafts_total == 0  # a PE only prefills
        idle(pe, ce)
