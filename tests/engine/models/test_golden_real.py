"""Golden tests on the real checkpoints (CPU, float32): SmolLM2-135M-Instruct and Gemma 3 270M.

Greedy tokens identical to transformers for 64 new tokens (or parting only on a near-tie, reported),
last-position logits within float32 tolerance, in default and deterministic mode."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from engine.checkpoints import resolve_model
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams
from tests.engine_utils import compare_greedy, hf_greedy, prompt_logits

NEW_TOKENS = 64


def _long_prompt(tokenizer) -> list[int]:
    """Over 1,100 tokens of varied text, so several 512-token windows slide."""
    text = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return ids[:1150]


def _smollm_prompt(tokenizer) -> list[int]:
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Explain in a few sentences why the sky is blue, then name three planets."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def reference():
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            folder = resolve_model(name)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(folder))
            prompt = _long_prompt(tok) if name.startswith("gemma") else _smollm_prompt(tok)
            cache[name] = (folder, prompt, _long_prompt(tok), *hf_greedy(folder, prompt, NEW_TOKENS))
        return cache[name]

    return get


def _engine(name: str, is_deterministic: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=name, device="cpu", is_deterministic=is_deterministic, max_model_len=2048, kv_cache_gb=0.5)
    )


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_real_checkpoint_matches_transformers(reference, name: str) -> None:
    folder, prompt, _, ref_tokens, ref_logits, ref_first = reference(name)
    if name.startswith("gemma"):
        assert len(prompt) > 1100
    eng = _engine(str(folder), is_deterministic=False)
    # the prompt's last-position logits are those its first token is sampled from: recorded on the way
    # (a separate prefill of the long prompt would cost as much again)
    firsts: list[torch.Tensor] = []
    run = eng.runner.run

    def recording_run(seqs, num_new, **kw):  # type: ignore[no-untyped-def]
        sampled, logits = run(seqs, num_new, **kw)
        if sampled and not firsts:
            firsts.append(logits[0].float().clone())
        return sampled, logits

    eng.runner.run = recording_run  # type: ignore[method-assign]
    try:
        (seq,) = eng.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    finally:
        eng.runner.run = run  # type: ignore[method-assign]
    torch.testing.assert_close(firsts[0], ref_first, rtol=1e-4, atol=2e-3)
    note = compare_greedy(seq.output_token_ids, ref_tokens, ref_logits, tie_gap=1e-3)
    print(f"{name}: {note or f'{NEW_TOKENS}/{NEW_TOKENS} tokens identical'}")
    eng.check_idle()


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_real_checkpoint_deterministic_is_batch_and_chunk_invariant(reference, name: str) -> None:
    folder, _, long_prompt, *_ = reference(name)
    prompt = long_prompt[:600]  # more than a 512-token window
    eng = _engine(str(folder), is_deterministic=True)
    others = [prompt[7:40], prompt[100:357]]
    (alone,) = prompt_logits(eng, [prompt])
    batched = prompt_logits(eng, [others[0], prompt, others[1]])[1]
    chunked = prompt_logits(eng, [others[1], prompt], chunks=[[257], [300, 1, 171, 128]])[1]
    assert torch.equal(alone, batched) and torch.equal(alone, chunked)
    eng.check_idle()


@pytest.mark.parametrize("name, user_len", [("smollm2-135m-instruct", 150), ("gemma3-270m", 600)])
def test_real_checkpoint_multi_turn_prefix_cache_identical(name: str, user_len: int) -> None:
    """Each turn's output with the host prefix cache equals the output without it; later turns hit.
    For Gemma the turns grow past 1,200 tokens, so restored prefixes span several 512-token windows.
    The two requests of a turn run in one batch (deterministic: the batch changes no logit; a decode step
    of two costs what one of one does)."""
    from transformers import AutoTokenizer

    folder = resolve_model(name)
    tok = AutoTokenizer.from_pretrained(str(folder))
    words = tok(inspect.getsource(json.decoder) + inspect.getsource(json.encoder), add_special_tokens=False)["input_ids"]
    assert len(words) >= 3 * user_len
    eng = LLMEngine(EngineConfig(model=name, device="cpu", is_deterministic=True, max_model_len=2048, kv_cache_gb=0.5, hicache_gb=0.5))
    history: list[int] = []
    hits = []
    for turn in range(3):
        history += words[turn * user_len : (turn + 1) * user_len]
        outs: dict[str, list[int]] = {}
        for use_cache in (False, True):
            eng.add_request(f"{turn}-{use_cache}", history, SamplingParams(max_tokens=8, temperature=0.0), use_prefix_cache=use_cache)
            outs[f"{turn}-{use_cache}"] = []
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] += o.new_token_ids
                if o.is_finished and o.request_id.endswith("True"):
                    hits.append(o.num_cached_tokens)
        assert outs[f"{turn}-True"] == outs[f"{turn}-False"], f"turn {turn} differs with the cache"
        history += outs[f"{turn}-True"]
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])
    if name.startswith("gemma"):
        assert hits[-1] > 2 * 512
    eng.check_idle()
