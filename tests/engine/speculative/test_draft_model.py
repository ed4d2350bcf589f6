"""Speculative decoding with a draft model (engine/speculative/draft_model.py) on tiny checkpoints of a 16-token
vocabulary, --deterministic: the drafts are the draft model's greedy chain computed from the whole sequence at
once (its KV, kept in the target's pages, filled step by step: prefill chunks, decodes, verifies with rejected
tails); the output is the target's own, token for token, for several target families; a draft that is the
target itself has every draft accepted (its KV caught up exactly, prefix-cache hits and preemption included); the
draft's pages are the last layers of the pool's; drafts of another vocabulary are refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.arch import ModelArch
from engine.config import ForwardConfig
from engine.core.kv_cache import KVCache, draft_slots, layout_of
from engine.core.sequence import Sequence
from engine.errors import InvalidRequestError
from engine.handoff import KVLayout
from engine.layers.context import SeqChunk, forward_context
from engine.models.registry import arch_from_hf, load_hf_config
from engine.request import SamplingParams
from engine.speculative.draft_model import DraftDrafter, check_vocabulary
from engine.speculative.mtp import MtpDrafter
from tests.engine_utils import random_prompts, small_engine
from tests.tiny_models import make_tiny

VOCAB = dict(vocab_size=16, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# a smaller llama than the targets (tests/tiny_models.py COMMON): other widths, heads and depth, one KV head
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def spec(draft: Path, k: int = 3) -> str:
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, "auto_disable": False})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Targets of three families and a small llama draft, all of the 16-token vocabulary."""
    root = tmp_path_factory.mktemp("draft_model")
    return {
        "llama": make_tiny("llama", root / "llama", **VOCAB),
        "qwen3_hybrid": make_tiny("qwen3_hybrid", root / "qwen3_hybrid", **VOCAB),  # sliding layers: rings roll back
        "deepseek_v3": make_tiny("deepseek_v3", root / "deepseek_v3", **VOCAB),  # latent pages hold the draft's KV
        "draft": make_tiny("llama", root / "draft", seed=1, **VOCAB, **SMALL),
    }


def reference_drafts(drafter: DraftDrafter, tokens: list[int], k: int) -> list[int]:
    """The draft model's greedy chain of k after `tokens`: each token one full forward of the whole sequence on
    a scratch cache, the last row's argmax."""
    model, out = drafter.model, list(tokens)
    for _ in range(k):
        layout = layout_of(model.arch, 16, torch.float32)
        num_blocks = -(-len(out) // 16)
        kv = KVCache(layout, num_blocks, 0, torch.device("cpu"))
        chunk = SeqChunk(0, len(out), 0, list(range(num_blocks)), -1)
        with forward_context([chunk], kv, drafter.numerics, config=ForwardConfig()):
            hidden = model(torch.tensor(out), torch.arange(len(out)))
            out.append(int(model.logits(hidden[-1:]).argmax(-1)))
    return out[len(tokens) :]


def record_drafts(drafter: DraftDrafter | MtpDrafter) -> list[tuple[list[int], list[int]]]:
    """Every non-empty proposal from now on, with the sequence's tokens when it was made."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recording(seq: Sequence, k: int) -> list[int]:
        got = propose(seq, k)
        if got:
            seen.append((seq.token_ids(0, seq.num_tokens), got))
        return got

    drafter.propose = recording  # type: ignore[method-assign]
    return seen


PROMPTS = [random_prompts([40], seed=1, vocab=16)[0], random_prompts([23], seed=2, vocab=16)[0]]
PARAMS = [
    SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True),
]


def test_drafts_are_the_draft_models_greedy_chain_and_the_output_is_unchanged(models) -> None:
    target = models["llama"]
    ref = small_engine(target, is_deterministic=True, max_num_batched_tokens=24).generate(PROMPTS, PARAMS)
    eng = small_engine(target, is_deterministic=True, max_num_batched_tokens=24, speculative_config=spec(models["draft"]))
    drafter = eng.speculator.draft_model if eng.speculator is not None else None
    assert drafter is not None and drafter.model.arch.hidden_size == 32
    plain = layout_of(eng.arch, 16, torch.float32)
    assert eng.kv.layout.num_full_layers > plain.num_full_layers  # the draft's layers ride in every page
    seen = record_drafts(drafter)
    got = eng.generate(PROMPTS, PARAMS)
    for r, g in zip(ref, got):
        assert g.output_token_ids == r.output_token_ids
        assert g.output_logprobs == r.output_logprobs
    eng.check_idle()
    st = eng.stats()
    assert st.spec_num_drafts_total == len(seen) > 10
    assert 0 < st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total
    assert any(len(d) == 3 for _, d in seen)
    for tokens, drafts in seen[:: max(1, len(seen) // 12)]:
        assert drafts == reference_drafts(drafter, tokens, len(drafts))


@pytest.mark.parametrize("family", ["qwen3_hybrid", "deepseek_v3"])
def test_other_families_decode_the_same_tokens(models, family: str) -> None:
    target = models[family]
    ref = small_engine(target, is_deterministic=True, max_num_batched_tokens=24).generate(PROMPTS, PARAMS)
    eng = small_engine(target, is_deterministic=True, max_num_batched_tokens=24, speculative_config=spec(models["draft"]))
    got = eng.generate(PROMPTS, PARAMS)
    for r, g in zip(ref, got):
        assert g.output_token_ids == r.output_token_ids
        assert g.output_logprobs == r.output_logprobs
    assert eng.stats().spec_num_draft_tokens_total > 0
    eng.check_idle()


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_the_target_as_its_own_draft_has_every_draft_accepted(models, family: str) -> None:
    """The draft KV equals the target's wherever the target reads: chunked prefills, verifies, and a second round
    whose prompts extend the first's, restored from the host prefix cache (pages stored with both models' KV)."""
    target = models[family]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    eng = small_engine(
        target, is_deterministic=True, max_num_batched_tokens=24, hicache_gb=0.01, speculative_config=spec(target)
    )
    first = eng.generate(PROMPTS, params)
    second = eng.generate([p + s.output_token_ids + [5, 6] for p, s in zip(PROMPTS, first)], params)
    st = eng.stats()
    assert st.cache_hit_tokens_total > 0
    assert st.spec_num_drafts_total > 10
    assert st.spec_num_accepted_tokens_total == st.spec_num_draft_tokens_total
    assert st.spec_accepted_per_position[0] == st.spec_num_drafts_total
    single = small_engine(target, is_deterministic=True, hicache_gb=0)
    for got in (first, second):
        want = single.generate([s.prompt_token_ids for s in got], params)
        assert [s.output_token_ids for s in got] == [w.output_token_ids for w in want]
    eng.check_idle()


def test_a_preempted_sequence_recomputes_the_drafts_kv_too(models) -> None:
    """Six pages for two sequences that need ten: one is preempted and recomputed from its prompt, the draft's
    KV with it (the target as its own draft: still every draft accepted)."""
    target = models["llama"]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    page_bytes = layout_of(make_arch(target), 16, torch.float32, draft=layout_of(make_arch(target), 16, torch.float32)).page_bytes
    eng = small_engine(
        target, is_deterministic=True, max_num_batched_tokens=24, hicache_gb=0, kv_cache_gb=6 * page_bytes / 2**30,
        speculative_config=spec(target),
    )  # fmt: skip
    assert eng.memory.num_blocks == 6
    got = eng.generate(PROMPTS, params)
    want = small_engine(target, is_deterministic=True, hicache_gb=0).generate(PROMPTS, params)
    assert [s.output_token_ids for s in got] == [w.output_token_ids for w in want]
    st = eng.stats()
    assert st.num_preemptions_total > 0
    assert 0 < st.spec_num_accepted_tokens_total == st.spec_num_draft_tokens_total
    eng.check_idle()


def test_the_drafts_pages_are_the_last_layers_of_the_pools() -> None:
    """KVCache.draft_cache: the draft's page [layers, 2, block, heads, dim] lies in the pool page's last
    draft_slots layers (rounded up to whole layers of the pool's shape), the pool's own layers untouched."""
    draft = KVLayout(3, 0, 16, 0, 1, 24, torch.float32)  # 2304 values a page
    for own in (KVLayout(4, 0, 16, 0, 2, 16, torch.float32), KVLayout(2, 0, 16, 0, 1, 40, torch.float32, "latent")):
        slots = draft_slots(own, draft)
        assert slots == -(-2304 // (own.planes * 16 * own.num_kv_heads * own.head_dim))
        pool = KVCache(dataclasses.replace(own, num_full_layers=own.num_full_layers + slots), 5, 0, torch.device("cpu"))
        pool.pages.zero_()
        view = pool.draft_cache(draft)
        assert view.layout == draft and view.pages.shape == draft.page_shape(5)
        view.pages[3] = torch.arange(2304, dtype=torch.float32).view(draft.page_shape(1)[1:]) + 1
        assert pool.pages[:, : own.num_full_layers].abs().sum() == 0 and pool.pages[[0, 1, 2, 4]].abs().sum() == 0
        assert torch.equal(pool.pages[3, own.num_full_layers :].flatten()[:2304], torch.arange(2304.0) + 1)
    with pytest.raises(ValueError, match="share the pool's block_size"):
        draft_slots(KVLayout(4, 0, 32, 0, 2, 16, torch.float32), draft)


def make_arch(folder: Path) -> ModelArch:
    return arch_from_hf(load_hf_config(folder))


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


def test_a_draft_of_another_vocabulary_is_refused(models, tmp_path) -> None:
    other = make_tiny("llama", tmp_path / "other", vocab_size=32, **SMALL)
    with pytest.raises(InvalidRequestError, match="--speculative-config: model .* vocab_size 32 differs from the target's 16"):
        small_engine(models["llama"], speculative_config=spec(other))
    hybrid = models["qwen3_hybrid"]
    with pytest.raises(InvalidRequestError, match="--speculative-config: model .* has sliding-window layers"):
        small_engine(models["llama"], speculative_config=spec(hybrid))
    # with tokenizers, their vocabularies are compared (vocab_size may differ by padding rows)
    a: Any = FakeTokenizer({"a": 0, "b": 1})
    check_vocabulary("d", 32, a, 16, FakeTokenizer({"a": 0, "b": 1}))
    with pytest.raises(InvalidRequestError, match="tokenizer's vocabulary differs from the target's"):
        check_vocabulary("d", 16, a, 16, FakeTokenizer({"a": 0, "c": 1}))
    with pytest.raises(InvalidRequestError, match="no tokenizer to compare"):
        check_vocabulary("d", 16, a, 16, None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_draft_model_on_cuda_gives_the_same_tokens(models, eager: bool) -> None:
    """CUDA, bf16, deterministic: the target's verify as decode rows (graphed or eager), the draft's catch-up and
    chain on the prefill path over its view of the pages; the same tokens as without speculation."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    kw: dict[str, Any] = dict(device="cuda", is_deterministic=True, max_num_seqs=8, hicache_gb=0.1, enforce_eager=eager)
    ref = small_engine(models["llama"], **kw).generate(PROMPTS, params)
    for draft in (models["draft"], models["llama"]):
        eng = small_engine(models["llama"], speculative_config=spec(draft), **kw)
        got = eng.generate(PROMPTS, params)
        for r, g in zip(ref, got):
            assert g.output_token_ids == r.output_token_ids
            assert g.output_logprobs == r.output_logprobs
        st = eng.stats()
        assert st.spec_num_accepted_tokens_total > 0
        eng.check_idle()


def test_a_failing_draft_forward_costs_drafts_never_tokens(models, caplog) -> None:
    """The draft model's forward raises on some steps: logged, those steps' sequences go on without drafts, the
    tokens are the target's all the same."""
    target = models["llama"]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = small_engine(target, is_deterministic=True, hicache_gb=0).generate(PROMPTS, params)
    eng = small_engine(target, is_deterministic=True, hicache_gb=0, speculative_config=spec(models["draft"]))
    drafter = eng.speculator.draft_model if eng.speculator is not None else None
    assert drafter is not None
    forward, calls = drafter._forward, [0]

    def flaky(*args: Any) -> list[int]:
        calls[0] += 1
        if calls[0] % 7 == 3:
            raise RuntimeError("a draft forward failed")
        return forward(*args)

    drafter._forward = flaky  # type: ignore[method-assign]
    got = eng.generate(PROMPTS, params)
    assert [s.output_token_ids for s in got] == [w.output_token_ids for w in want]
    assert "the drafter failed" in caplog.text
    assert eng.stats().spec_num_draft_tokens_total > 0
    eng.check_idle()
