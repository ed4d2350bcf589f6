"""Nothing a request carries crashes the engine: sampling values are checked before use, and a
request that fails while its batch is stepped (sampling, detokenizing, the model run) ends alone
with finish_reason "error", its memory freed, while the engine serves the others."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.execution.draw as draw_module
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.faults import is_fatal
from engine.request import MAX_SEED, RequestOutput, SamplingParams
from tests.engine_utils import small_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True, logprobs=2)
BAD_SEED = 4242  # the request whose sampling the injected fault breaks
PROMPTS = {"a": [3, 4, 5, 6], "b": [7, 8, 9], "c": [10, 11, 12, 13, 14]}


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=2.0), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(seed=MAX_SEED + 1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(seed=True), "seed"),
        (dict(logprobs=True), "top_logprobs"),  # a bool is an int in Python: topk(k=True) crashed
        (dict(logprobs=-1), "top_logprobs"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
        (dict(stop_token_ids=(False,)), "stop_token_ids"),
        (dict(ignore_eos=1), "ignore_eos"),
    ],
)
def test_sampling_values_are_checked(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


@pytest.fixture(scope="module")
def eng(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    from tests.tiny_models import make_tiny

    folder: Path = make_tiny("llama", tmp_path_factory.mktemp("llama"))
    return small_engine(folder, max_model_len=128)


def run(
    eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    eng.check_idle()
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_failed(outs: list[RequestOutput]) -> None:
    last = outs[-1]
    assert last.is_finished and last.finish_reason == "error" and last.error, last
    assert sum(o.is_finished for o in outs) == 1


def test_tiny_temperatures_are_greedy_and_vocab_is_checked(eng: LLMEngine) -> None:
    """temperature 1e-300 divided the logits to inf (multinomial then raised and the rank died):
    below 1e-5 it is greedy, as in vLLM."""
    want = run(eng, {"g": (PROMPTS["a"], GREEDY)})
    for temperature in (1e-300, 5e-324, 1e-6):
        params = SamplingParams(max_tokens=6, temperature=temperature, top_k=5, ignore_eos=True)
        assert tokens(run(eng, {"t": (PROMPTS["a"], params)})["t"]) == tokens(want["g"])
    vocab = eng.arch.vocab_size
    for prompt, params, param in (
        ([3, vocab], GREEDY, "prompt"),
        ([3, -1], GREEDY, "prompt"),
        ([3], SamplingParams(stop_token_ids=(vocab,)), "stop_token_ids"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request("bad", prompt, params)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("bad", [3], GREEDY, seed=-1)
    assert e.value.param == "seed"
    eng.check_idle()


def _clean(eng: LLMEngine) -> dict[str, list[int]]:
    reqs = {"a": (PROMPTS["a"], GREEDY), "c": (PROMPTS["c"], SAMPLED)}
    return {rid: tokens(o) for rid, o in run(eng, reqs).items()}


def test_a_failing_sampling_fails_only_its_request(eng: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    want = _clean(eng)
    real = draw_module.sample

    def faulty(logits: torch.Tensor, params: list[SamplingParams], *rest: Any) -> Any:
        if any(p.seed == BAD_SEED for p in params):
            raise RuntimeError("injected sampling fault")
        return real(logits, params, *rest)

    monkeypatch.setattr(draw_module, "sample", faulty)
    bad = SamplingParams(max_tokens=6, temperature=0.7, seed=BAD_SEED, ignore_eos=True)
    outs = run(eng, {"a": (PROMPTS["a"], GREEDY), "b": (PROMPTS["b"], bad), "c": (PROMPTS["c"], SAMPLED)})
    assert_failed(outs["b"])
    assert {rid: tokens(outs[rid]) for rid in "ac"} == want  # row by row: the same tokens as batched
    assert all(outs[rid][-1].finish_reason == "length" for rid in "ac")


@pytest.mark.parametrize("where", ["add", "release"])
def test_a_failing_detokenizer_fails_only_its_request(eng: LLMEngine, where: str) -> None:
    want = _clean(eng)
    eng.add_request("b", PROMPTS["b"], GREEDY)
    detok = eng._detok["b"]
    calls = [0]
    real: Callable[..., Any] = getattr(detok, where)

    def faulty(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:  # mid-decode: the sequence holds tokens and pages
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real(*args)

    setattr(detok, where, faulty)
    outs = run(eng, {"a": (PROMPTS["a"], GREEDY), "c": (PROMPTS["c"], SAMPLED)})
    assert_failed(outs["b"])
    assert {rid: tokens(outs[rid]) for rid in "ac"} == want


def test_a_failing_model_run_fails_its_batch_and_the_engine_goes_on(
    eng: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = _clean(eng)
    real = eng.runner.run
    calls = [0]

    def faulty(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected model fault")
        return real(*args)

    monkeypatch.setattr(eng.runner, "run", faulty)
    outs = run(eng, {"a": (PROMPTS["a"], GREEDY), "c": (PROMPTS["c"], SAMPLED)})
    assert_failed(outs["a"])  # one final output each: the error (launch-ahead: the batch launched ahead)
    assert_failed(outs["c"])
    monkeypatch.setattr(eng.runner, "run", real)
    assert _clean(eng) == want


def test_a_failing_model_run_without_launch_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.tiny_models import make_tiny

    eng = small_engine(make_tiny("llama", tmp_path), max_model_len=128, launch_ahead=False)
    test_a_failing_model_run_fails_its_batch_and_the_engine_goes_on(eng, monkeypatch)


def test_fatal_errors_still_propagate(eng: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def oom(*args: Any) -> Any:
        raise torch.cuda.OutOfMemoryError("injected")

    monkeypatch.setattr(eng.runner, "run", oom)
    eng.add_request("a", PROMPTS["a"], GREEDY)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        eng.step()
    eng.abort("a")
    eng.step()
    eng.check_idle()


def test_fatal_is_decided_by_type_never_by_message() -> None:
    """A message a client can shape (a grammar library quotes the request's grammar) never makes an
    error fatal; the device's own error types do, whatever they say."""
    for text in ("CUDA error: an illegal memory access was encountered", "CUBLAS_STATUS_EXECUTION_FAILED", "CUDNN_STATUS_BAD_PARAM"):
        assert not is_fatal(RuntimeError(f"the output's grammar failed: /{text}/"))
    for error in (torch.AcceleratorError("x"), torch.cuda.OutOfMemoryError("x"), MemoryError(), KeyboardInterrupt()):
        assert is_fatal(error), error


def test_a_failing_prefill_only_request_frees_its_parked_memory(
    eng: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PE side: the fault hits the output of a sequence that was just parked for its export."""
    real = eng._output

    def faulty(seq: Any, is_final: bool) -> RequestOutput:
        if seq.request_id == "p":
            raise ValueError("injected output fault")
        return real(seq, is_final)

    monkeypatch.setattr(eng, "_output", faulty)
    eng.add_request("p", PROMPTS["a"], GREEDY, prefill_only=True)
    outs = run(eng, {"a": (PROMPTS["b"], GREEDY)})
    assert_failed(outs["p"])
    assert outs["a"][-1].finish_reason == "length"
