"""Logit processors (engine/layers/sampler.py process_logits): logit_bias, min_tokens, repetition, frequency
and presence penalties with OpenAI's and vLLM's meanings, batched and row-invariant; min-p; and the
same through a tiny engine (greedy output moved the way the parameters say, the P/D export/import
path continuing with the same penalties)."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.layers.sampler import process_logits, sample
from engine.request import MIN_REPETITION_PENALTY, RequestOutput, SamplingParams
from tests.engine_utils import small_engine

V = 12
EOS = {11}


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_no_processor_returns_the_logits_untouched() -> None:
    x = torch.randn(3, V)
    assert process_logits(x, [SamplingParams()] * 3, [[1]] * 3, [[2]] * 3, EOS) is x


def test_each_processor_by_hand() -> None:
    base = [2.0, -2.0, 1.0, 0.5, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0]
    x = logits_of(base, base, base, base, base)
    params = [
        SamplingParams(logit_bias=((0, -5.0), (5, 2.5))),
        SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(4,)),
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(max_tokens=8, min_tokens=3, ignore_eos=True),
    ]
    prompts = [[7], [7], [0, 1], [7], [7]]
    outputs = [[3], [3, 3], [2], [3, 3, 2], [3]]
    y = process_logits(x, params, prompts, outputs, EOS)
    assert y[0, 0] == -3.0 and y[0, 5] == 2.5 and y[0, 1] == -2.0
    assert y[1, 11] == y[1, 4] == float("-inf") and y[1, 0] == 2.0  # EOS and the stop id barred
    # repetition: tokens 0, 1 (prompt) and 2 (output): positive logits halved, negative doubled
    assert (y[2, 0], y[2, 1], y[2, 2], y[2, 3]) == (1.0, -4.0, 0.5, 0.5)
    # token 3 twice: 0.5 - 2 * 0.5 - 0.25; token 2 once: 1 - 0.5 - 0.25
    assert y[3, 3] == pytest.approx(-0.75) and y[3, 2] == pytest.approx(0.25) and y[3, 4] == 3.0
    assert y[4, 11] == 4.0 and torch.isfinite(y[4]).all()  # ignore_eos: EOS stays
    # min_tokens reached: nothing barred
    y = process_logits(x[1:2], params[1:2], prompts[1:2], [[3, 3, 3]], EOS)
    assert torch.equal(y, x[1:2])


def test_batched_equals_row_by_row() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 50)
    params = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3),
        SamplingParams(),
        SamplingParams(repetition_penalty=1.3, logit_bias=((4, 10.0),)),
        SamplingParams(max_tokens=9, min_tokens=9, stop_token_ids=(7,)),
        SamplingParams(frequency_penalty=2.0),
        SamplingParams(repetition_penalty=0.8),
    ]
    prompts = [[1, 2, 3], [4], [5, 5, 6], [7], [8, 9], list(range(20))]
    outputs = [[1, 1], [], [6, 7, 7], [2], [9, 9, 9, 9], [30, 31]]
    batched = process_logits(x, params, prompts, outputs, {49})
    for i in range(6):
        alone = process_logits(x[i : i + 1], params[i : i + 1], prompts[i : i + 1], outputs[i : i + 1], {49})
        assert torch.equal(batched[i : i + 1], alone), i
    assert torch.equal(batched[1], x[1])


def test_min_p_drops_the_unlikely_and_logprobs_stay_raw() -> None:
    x = logits_of([5.0, 4.9, 0.0, -1.0] + [-9.0] * (V - 4))
    p = SamplingParams(temperature=1.0, min_p=0.5, seed=1, logprobs=0)
    draws = {sample(x, [p], [s], [0])[0][0] for s in range(200)}
    assert draws <= {0, 1} and len(draws) == 2  # tokens under half the top probability never drawn
    biased = process_logits(x, [SamplingParams(logit_bias=((2, 100.0),), logprobs=0)], [[0]], [[]], EOS)
    tokens, logprobs = sample(biased, [SamplingParams(logprobs=0)], [0], [0], x)
    assert tokens == [2] and logprobs[0] is not None
    assert logprobs[0].logprob == pytest.approx(float(torch.log_softmax(x[0], -1)[2]))  # the model's


@pytest.mark.parametrize(
    "kw",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": 1e-50},  # 0 in float32
        {"repetition_penalty": 1e-10},  # divides a logit past float32's range
        {"min_p": -0.1},
        {"min_tokens": 17},  # more than max_tokens (16)
        {"logit_bias": ((1, 101.0),)},
        {"logit_bias": ((1, 1.0), (1, 2.0))},
        {"logit_bias": ((-1, 1.0),)},
    ],
)
def test_out_of_range_values_are_refused(kw) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def _generate(eng, prompt: list[int], params: SamplingParams, rid: str = "r") -> list[RequestOutput]:
    eng.add_request(rid, prompt, params)
    outs: list[RequestOutput] = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    eng.check_idle()
    return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_through_the_engine(tiny_model_dir) -> None:
    eng = small_engine(tiny_model_dir("llama"), max_model_len=128)
    prompt = [3, 17, 42, 8, 99, 5]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = _tokens(_generate(eng, prompt, greedy))
    # a large negative bias on the first greedy token moves the first choice
    banned = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias=((plain[0], -100.0),))
    assert _tokens(_generate(eng, prompt, banned))[0] != plain[0]
    # a strong frequency penalty: no token repeats more than the unpenalized output's most repeated one
    pen = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    penalized = _tokens(_generate(eng, prompt, pen))
    assert max(penalized.count(t) for t in penalized) <= max(plain.count(t) for t in plain)
    assert len(set(penalized)) >= len(set(plain))
    # min_tokens: EOS pushed to the top still waits for 4 tokens
    eos = min(eng.eos_token_ids)
    eager = SamplingParams(max_tokens=12, temperature=0, logit_bias=((eos, 100.0),))
    assert _tokens(_generate(eng, prompt, eager)) == [eos]
    held = SamplingParams(max_tokens=12, temperature=0, logit_bias=((eos, 100.0),), min_tokens=4)
    outs = _generate(eng, prompt, held)
    assert len(_tokens(outs)) == 5 and _tokens(outs)[-1] == eos and outs[-1].finish_reason == "stop"
    # a token id past the vocabulary is refused by the engine
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        eng.validate("x", prompt, SamplingParams(logit_bias=((10**6, 1.0),)))


def test_the_smallest_repetition_penalty_keeps_the_logits_finite() -> None:
    """At MIN_REPETITION_PENALTY a seen token's logit of 100 becomes 1e5 (1e-50 made it inf, and the
    sampler raised); a barred token stays -inf rather than becoming NaN."""
    x = torch.tensor([[100.0, -100.0, 3.0, 0.0] + [0.0] * 8])
    params = [SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY, max_tokens=8, min_tokens=2)]
    y = process_logits(x, params, [[0, 1]], [[2]], EOS)
    assert y[0, 0] == pytest.approx(1e5) and y[0, 1] == pytest.approx(-0.1) and y[0, 2] == pytest.approx(3000.0)
    assert y[0, 11] == float("-inf") and torch.isfinite(y[0, :11]).all()
