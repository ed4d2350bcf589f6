"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's) on tiny engines: transformers' values, the
same bits whatever the chunking and the batch, the whole prompt computed (no cached prefix restored, its
pages stored all the same), on the first output only, and carried through an export and import (the
P/D handoff) to the CE's first output."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.request import PromptLogprobs, RequestOutput, SamplingParams
from tests.engine_utils import random_prompts, small_engine

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
WITH_TOP = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=4)


def outputs(eng, rid: str, prompt: list[int], params: SamplingParams, **kw) -> list[RequestOutput]:
    eng.add_request(rid, prompt, params, **kw)
    out = []
    while eng.has_unfinished():
        out += [o for o in eng.step() if o.request_id == rid]
    return out


def first_prompt_logprobs(outs: list[RequestOutput]) -> PromptLogprobs:
    """The prompt logprobs, checked to be on the first output (the one with the first token) only."""
    assert outs[0].new_token_ids and outs[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in outs[1:])
    return outs[0].prompt_logprobs


def hf_prompt_logprobs(folder, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at positions 0..n-2: [n-1, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid", "deepseek_v3"])  # MLA: chunks expanded and absorbed
def test_prompt_logprobs_are_transformers_values(tiny_model_dir, family: str) -> None:
    folder = tiny_model_dir(family)
    (prompt,) = random_prompts([70], seed=3)
    ref = hf_prompt_logprobs(folder, prompt)
    eng = small_engine(folder, max_num_batched_tokens=32)  # the prompt in 3 chunks
    plp = first_prompt_logprobs(outputs(eng, "r", prompt, WITH_TOP))
    assert (plp.num_positions, plp.num_top) == (len(prompt) - 1, 4)
    targets = torch.tensor(prompt[1:])
    want = ref.gather(1, targets.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(plp.logprobs), want, rtol=1e-4, atol=1e-4)
    want_ranks = (ref > want.unsqueeze(1)).sum(-1) + 1
    assert sum(a != b for a, b in zip(plp.ranks, want_ranks.tolist())) <= 1  # a near-tie may flip one
    for i in range(plp.num_positions):
        ids = [t for t, _ in plp.top(i)]
        vals = torch.tensor([x for _, x in plp.top(i)])
        torch.testing.assert_close(vals, ref[i].topk(4).values, rtol=1e-4, atol=1e-4)
        assert torch.all(vals[:-1] >= vals[1:]) and len(set(ids)) == 4
        if plp.ranks[i] <= 4:  # the prompt token is among the top, with the same value
            assert (prompt[i + 1], plp.logprobs[i]) in plp.top(i)
    eng.check_idle()


def test_the_same_bits_whatever_the_chunking_and_the_batch(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen3_hybrid")
    prompt, other, long = random_prompts([61, 40, 90], seed=5)
    alone = small_engine(folder, is_deterministic=True, max_num_batched_tokens=256)
    ref = first_prompt_logprobs(outputs(alone, "r", prompt, WITH_TOP))
    chunked = small_engine(folder, is_deterministic=True, max_num_batched_tokens=24)
    for p in (other, long):  # busy neighbours: their chunks share the steps
        chunked.add_request(f"n{len(p)}", p, GREEDY)
    assert first_prompt_logprobs(outputs(chunked, "r", prompt, WITH_TOP)) == ref
    chunked.check_idle()
    # asking for none changes nothing else: the first token and its logprobs are the same
    lps = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    a = outputs(alone, "a", prompt, lps)
    b = outputs(alone, "b", prompt, dataclasses.replace(lps, prompt_logprobs=0))
    assert [o.logprobs for o in a] == [o.logprobs for o in b] and a[0].prompt_logprobs is None
    zero = first_prompt_logprobs(b)
    assert zero.num_top == 0 and zero.top_ids == () and zero.logprobs == ref.logprobs and zero.ranks == ref.ranks


def test_the_whole_prompt_is_computed_and_its_pages_stored(tiny_model_dir) -> None:
    eng = small_engine(tiny_model_dir("llama"), is_deterministic=True)
    (prompt,) = random_prompts([50], seed=9)  # 3 full pages of 16
    cold = first_prompt_logprobs(outputs(eng, "cold", prompt, WITH_TOP))
    assert eng.prefix_cache is not None and eng.prefix_cache.index.counters.stored_pages == 3
    again = outputs(eng, "again", prompt, WITH_TOP)
    assert again[-1].num_cached_tokens == 0 and first_prompt_logprobs(again) == cold
    plain = outputs(eng, "plain", prompt, GREEDY)  # the pages stored above are a hit for others
    assert plain[-1].num_cached_tokens == 48 and plain[0].prompt_logprobs is None
    eng.check_idle()


def test_a_one_token_prompt_has_no_positions(tiny_model_dir) -> None:
    eng = small_engine(tiny_model_dir("llama"))
    plp = first_prompt_logprobs(outputs(eng, "r", [5], WITH_TOP))
    assert plp == PromptLogprobs(4)
    eng.check_idle()


@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid"])
def test_the_handoff_carries_them_to_the_ce(tiny_model_dir, family: str) -> None:
    folder = tiny_model_dir(family)
    (prompt,) = random_prompts([45], seed=11)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    single = outputs(small_engine(folder, is_deterministic=True), "r", prompt, params)
    pe, ce = small_engine(folder, is_deterministic=True), small_engine(folder, is_deterministic=True)
    parked = outputs(pe, "r", prompt, params, prefill_only=True)
    assert parked[-1].is_handoff_ready
    exp = pe.export_sequence("r")
    assert exp.prompt_logprobs == first_prompt_logprobs(single)
    pe.finish_handoff("r")
    pe.check_idle()
    ce.import_sequence(exp)
    got: list[RequestOutput] = []
    while ce.has_unfinished():
        got += ce.step()
    assert first_prompt_logprobs(got) == first_prompt_logprobs(single)
    assert [t for o in got for t in o.new_token_ids] == [t for o in single for t in o.new_token_ids]
    ce.check_idle()
    exp.request_id, exp.prompt_logprobs = "r2", None  # a handoff that lacks them is refused
    with pytest.raises(InvalidRequestError, match="prompt logprobs"):
        ce.import_sequence(exp)
    ce.check_idle()


def test_prompt_logprobs_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(InvalidRequestError):
        PromptLogprobs(1, (-0.5,), (1,), (), ())  # one position needs one top entry
    with pytest.raises(InvalidRequestError):
        PromptLogprobs(0, (0.5,), (1,))  # a logprob above 0
    with pytest.raises(InvalidRequestError):
        PromptLogprobs(0, (-0.5,), (0,))  # rank 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3_hybrid"])
def test_on_cuda_beside_decode_rows_and_graphs(tiny_model_dir, family: str) -> None:
    """CUDA: the prompt's chunks share steps with rows on the paged decode kernel (and graph replays
    between them), in bf16 deterministic: the alone values, bit for bit; float32: transformers'."""
    folder = tiny_model_dir(family)
    prompt, *others = random_prompts([61, 9, 40], seed=13)
    kw = dict(device="cuda", is_deterministic=True, hicache_gb=0.1)
    alone = small_engine(folder, max_num_batched_tokens=256, **kw)
    ref = first_prompt_logprobs(outputs(alone, "r", prompt, WITH_TOP))
    busy = small_engine(folder, max_num_batched_tokens=24, **kw)
    assert busy.graph_stats is not None
    for i, p in enumerate(others):
        busy.add_request(f"n{i}", p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # the neighbours prefilled and decoding when the prompt comes
        busy.step()
    assert first_prompt_logprobs(outputs(busy, "r", prompt, WITH_TOP)) == ref
    again = outputs(busy, "again", prompt, WITH_TOP)  # its pages were stored: nothing restored for it
    assert again[-1].num_cached_tokens == 0 and first_prompt_logprobs(again) == ref
    for eng in (alone, busy):
        eng.check_idle()
    f32 = small_engine(folder, device="cuda", dtype="float32", hicache_gb=0.1)
    plp = first_prompt_logprobs(outputs(f32, "r", prompt, WITH_TOP))
    want = hf_prompt_logprobs(folder, prompt).gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(plp.logprobs), want, rtol=1e-4, atol=1e-4)
    f32.check_idle()
