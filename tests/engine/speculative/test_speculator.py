"""Speculative decoding in the engine (engine/speculative/): --speculative-config parsed as vLLM's; prompt
lookup's drafts; the output token-identical to a run without speculation for every family (greedy and
seeded sampling, logprobs, penalties, logit_bias, min_tokens, stop ids, max_tokens, structured output),
with drafts that are accepted and rejected at every position (pages and sliding-window rings rolled
back); the sampled distribution kept (a chi-square test on an 8-token vocabulary); memory all free after."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.sequence import Sequence
from engine.errors import InvalidRequestError
from engine.request import SamplingParams
from engine.speculative.ngram import ngram_draft
from tests.engine_utils import prompt_logits, random_prompts, small_engine
from tests.tiny_models import FAMILIES, make_tiny

# drafts counted: the switch (engine/speculative/switch.py) stays out, tested on its own
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "auto_disable": False})

# ---- the setting ------------------------------------------------------------------------------------


def test_vllm_json_shapes_parse() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 1, 5)
    assert SpeculativeConfig.parse('{"method": "deepseek_mtp", "num_speculative_tokens": 1}').method == "mtp"
    draft = SpeculativeConfig.parse('{"model": "some/draft", "num_speculative_tokens": 4}')
    assert (draft.method, draft.model) == ("draft_model", "some/draft")


@pytest.mark.parametrize(
    "text, says",
    [
        ("ngram", "JSON object"),
        ("[1]", "JSON object"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "lookup_max": 2}', "unknown keys ['lookup_max']"),
        ('{"method": "eagle9", "num_speculative_tokens": 3}', "method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "within 1..7"),
        ('{"method": "ngram", "num_speculative_tokens": "3"}', "must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "min <= max"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "only method draft_model"),
    ],
)
def test_a_bad_setting_is_refused_with_its_reason(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        EngineConfig(speculative_config=text)
    assert says in str(err.value)


def test_methods_that_cannot_apply_are_refused_at_start(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    with pytest.raises(InvalidRequestError, match="'mtp' needs the checkpoint's multi-token-prediction layers"):
        small_engine(folder, speculative_config='{"method": "mtp", "num_speculative_tokens": 1}')
    missing = str(folder.parent / "no-such-draft")
    with pytest.raises(InvalidRequestError, match="--speculative-config: model .*no-such-draft.* not found"):
        small_engine(folder, speculative_config=json.dumps({"model": missing, "num_speculative_tokens": 2}))


# ---- prompt lookup ----------------------------------------------------------------------------------


def test_ngram_draft_takes_the_longest_latest_match() -> None:
    assert ngram_draft([1, 2, 3, 4, 1, 2], 1, 4, 3) == [3, 4, 1]
    # [1, 2] occurs twice before the suffix: the latest occurrence wins
    assert ngram_draft([5, 1, 2, 9, 1, 2, 7, 8, 1, 2], 1, 3, 2) == [7, 8]
    # the longest suffix that occurred wins over a later shorter one: [3, 1, 2] -> 9, not [2] -> 3
    assert ngram_draft([3, 1, 2, 9, 2, 3, 1, 2], 1, 3, 1) == [9]
    assert ngram_draft([1, 2, 3], 1, 3, 2) == []  # nothing repeats
    assert ngram_draft([1, 2, 3, 1], 2, 3, 2) == []  # a 1-token match is below prompt_lookup_min
    # a repeating tail drafts its continuation past the end (copied from the draft itself)
    assert ngram_draft([7, 7, 7, 7], 1, 2, 5) == [7, 7, 7, 7, 7]
    assert ngram_draft([1, 2, 3, 1, 2, 3, 1], 1, 3, 5) == [2, 3, 1, 2, 3]
    # token ids as 4-byte words: a byte-level hit across word boundaries is no match
    assert ngram_draft([256, 1, 0, 0, 0, 1], 2, 2, 2) == []


# ---- lossless, every family -------------------------------------------------------------------------


def oracle_proposer(reference: dict[tuple[int, ...], list[int]], rng: random.Random):
    """A proposer that drafts the reference's own continuation (so drafts get accepted), with one token
    changed at a random place in about half the drafts (so they get rejected there); keyed by prompt."""

    def propose(seq: Sequence, k: int) -> list[int]:
        full = reference[tuple(seq.prompt_token_ids)]
        done = len(seq.output_token_ids)
        draft = list(full[done : done + k]) or [3]
        if rng.random() < 0.5:
            at = rng.randrange(len(draft))
            draft[at] = 3 + (draft[at] + 1) % 500
        return draft

    return propose


ALL_FAMILIES = sorted(FAMILIES) + ["qwen3_moe", "gpt_oss", "deepseek_v3"]


def _params(seed_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True, logprobs=1),
        SamplingParams(
            max_tokens=27, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
            min_tokens=8, stop_token_ids=(seed_token,), logit_bias=((seed_token + 1, 2.0),),
        ),
    ]  # fmt: skip


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_speculation_gives_the_same_tokens_and_logprobs(tmp_path_factory, tiny_model_dir, family: str) -> None:
    folder = tiny_model_dir(family) if family in FAMILIES else make_tiny(family, tmp_path_factory.mktemp(family))
    base = random_prompts([12], seed=3)[0]
    prompts = [base * 3, random_prompts([30], seed=4)[0], base[:5] * 5]
    params = _params(base[3])
    plain = small_engine(folder, is_deterministic=True)
    ref = plain.generate(prompts, params)
    reference = {tuple(p): s.output_token_ids for p, s in zip(prompts, ref)}

    spec = small_engine(folder, is_deterministic=True, speculative_config=NGRAM)
    assert spec.ahead.enabled is False  # a step's drafts need the tokens of the step before
    assert spec.speculator is not None
    spec.speculator._propose = oracle_proposer(reference, random.Random(7))  # type: ignore[method-assign]
    got = spec.generate(prompts, params)
    for r, g in zip(ref, got):
        assert g.output_token_ids == r.output_token_ids
        assert g.output_logprobs == r.output_logprobs
        assert g.finish_reason == r.finish_reason
    spec.check_idle()
    st = spec.stats()
    # drafts were accepted and rejected, at more than the first position
    assert 0 < st.spec_num_accepted_tokens_total < st.spec_num_draft_tokens_total
    assert st.spec_accepted_per_position[1] > 0
    assert sum(st.spec_accepted_per_position) == st.spec_num_accepted_tokens_total
    # every accepted draft token is a token generated, beyond the one per verify
    assert st.num_generation_tokens_total == sum(len(s.output_token_ids) for s in got)


@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid"])
def test_prompt_lookup_is_lossless_in_default_numerics(tiny_model_dir, family: str) -> None:
    """The real proposer, default (not batch-invariant) numerics: the same greedy tokens (the verify's
    chunk computes each position as a prefill chunk would)."""
    folder = tiny_model_dir(family)
    base = random_prompts([20], seed=3)[0]
    prompts = [base * 3, base[:7] * 6]
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = [s.output_token_ids for s in small_engine(folder).generate(prompts, p)]
    spec = small_engine(folder, speculative_config=NGRAM)
    assert [s.output_token_ids for s in spec.generate(prompts, p)] == ref
    spec.check_idle()
    assert spec.stats().spec_num_drafts_total > 0


def test_a_batch_over_disable_by_batch_size_does_not_speculate(tiny_model_dir) -> None:
    folder = tiny_model_dir("gemma3_hybrid")
    cfg = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2, "auto_disable": False})
    eng = small_engine(folder, speculative_config=cfg)
    base = random_prompts([10], seed=5)[0]
    p = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    eng.generate([base * 4] * 3, p)  # three running: never drafts
    assert eng.stats().spec_num_drafts_total == 0
    eng.generate([base * 4] * 2, p)
    assert eng.stats().spec_num_drafts_total > 0


def test_drafts_stop_at_max_tokens_and_the_context(tiny_model_dir) -> None:
    """No draft reaches past max_tokens or max_model_len: the output ends exactly where it would."""
    folder = tiny_model_dir("llama")
    base = random_prompts([6], seed=8)[0]
    prompt = base * 8
    eng = small_engine(folder, speculative_config=NGRAM, max_model_len=len(prompt) + 9)
    assert eng.speculator is not None
    seen: list[int] = []
    eng.speculator._propose = lambda seq, k: seen.append(k) or [3] * k  # type: ignore[method-assign]
    (a,) = eng.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(a.output_token_ids) == 5 and max(seen) <= 3  # 5 tokens: at most 4 more after the first, minus one
    seen.clear()
    (b,) = eng.generate([prompt], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert len(b.output_token_ids) == 9 and a.output_token_ids == b.output_token_ids[:5]
    eng.check_idle()


# ---- the sampled distribution -------------------------------------------------------------------------


def test_sampling_keeps_the_target_distribution(tmp_path) -> None:
    """An 8-token vocabulary, temperature 1, unseeded: the first three output tokens, the second drafted (the
    target's likeliest after the first: accepted often, rejected often) and the third drawn in the same
    verify when it is accepted, follow the target's p(t1) p(t2 | t1) p(t3 | t1, t2) (chi-square over the
    512 cells, rare ones pooled)."""
    folder = make_tiny(
        "llama", tmp_path / "v8", vocab_size=8, num_hidden_layers=1, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    prompt = [3, 5, 1, 6]
    plain = small_engine(folder)
    (first,) = prompt_logits(plain, [prompt])
    p1 = torch.softmax(first, -1)
    p2 = torch.softmax(torch.stack(prompt_logits(plain, [prompt + [a] for a in range(8)])), -1)  # [t1, t2]
    pairs = [[a, b] for a in range(8) for b in range(8)]
    p3 = torch.softmax(torch.stack(prompt_logits(plain, [prompt + ab for ab in pairs])), -1).view(8, 8, 8)
    joint = (p1[:, None, None] * p2[:, :, None] * p3).flatten()
    likeliest = p2.argmax(-1).tolist()

    eng = small_engine(folder, speculative_config=NGRAM, max_num_seqs=128, max_num_batched_tokens=1024)
    assert eng.speculator is not None
    eng.speculator._propose = lambda seq, k: [likeliest[seq.output_token_ids[0]]]  # type: ignore[method-assign]
    n = 2000
    seqs = eng.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True))
    counts = torch.zeros(512)
    for s in seqs:
        a, b, c = s.output_token_ids
        counts[a * 64 + b * 8 + c] += 1
    st = eng.stats()
    assert st.spec_num_drafts_total == n
    assert n // 10 < st.spec_num_accepted_tokens_total < n - n // 10  # both ways, often
    expected = joint * n
    keep = expected >= 5  # cells too rare for the chi-square approximation are pooled into one
    chi2 = float((((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum())
    rest_e, rest_c = float(expected[~keep].sum()), float(counts[~keep].sum())
    chi2 += (rest_c - rest_e) ** 2 / rest_e if rest_e > 0 else 0.0
    dof = int(keep.sum()) - (0 if rest_e > 0 else 1)
    z = 3.09  # the 0.999 quantile of chi-square(dof), by Wilson and Hilferty's approximation
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, f"chi2 {chi2:.1f} over {dof} degrees of freedom (limit {limit:.1f})"
    eng.check_idle()


def test_structured_output_with_drafts_is_unchanged() -> None:
    """SmolLM2 with a JSON schema: drafts the grammar forbids are cut before the forward (Matcher.num_valid),
    the rest verified; the same text as without speculation, and the grammar satisfied."""
    from engine.checkpoints import resolve_model
    from engine.request import StructuredOutput

    folder = resolve_model("smollm2-135m-instruct")
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
              "required": ["city", "zip"]}  # fmt: skip
    so = StructuredOutput("json_schema", json.dumps(schema))
    text = 'Copy this JSON exactly: {"city": "Springfield", "zip": "49007"}'
    outs = []
    for cfg in (None, NGRAM):
        eng = small_engine(folder, max_num_batched_tokens=256, speculative_config=cfg)
        ids = eng.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        (seq,) = eng.generate([ids], SamplingParams(max_tokens=40, temperature=0.0, structured=so))
        outs.append(seq.output_token_ids)
        eng.check_idle()
    assert outs[0] == outs[1]
    assert eng.stats().spec_num_accepted_tokens_total > 0
    json.loads(eng.tokenizer.decode(outs[1], skip_special_tokens=True))
