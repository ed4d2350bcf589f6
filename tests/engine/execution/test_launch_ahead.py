"""Launching the next decode batch ahead (EngineConfig.launch_ahead): the same tokens, logprobs and
finish reasons as stepping one batch at a time; requests that arrive, or are aborted, while a batch
is launched; no batch launched ahead while anything waits or prefills; no memory left behind."""

from __future__ import annotations

import pytest

from engine.request import RequestOutput, SamplingParams
from tests.engine_utils import small_engine

PROMPTS = [[3 + i, 17, 42 + 3 * i, 8, 99 - i, 5] * (1 + i % 3) for i in range(6)]


def params(i: int) -> SamplingParams:
    """Greedy and seeded sampled rows, logprobs, lengths that end the sequences at different steps."""
    if i % 2:
        return SamplingParams(max_tokens=5 + 3 * i, temperature=0.9, top_p=0.8, seed=100 + i, logprobs=2, ignore_eos=True)
    return SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, logprobs=1, stop_token_ids=(7,))


def run(eng, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] | None = None) -> dict[str, list[RequestOutput]]:
    """Steps eng until idle; arrivals[k]: requests added after the k-th step."""
    outs: dict[str, list[RequestOutput]] = {}
    k = 0
    while eng.has_unfinished() or (arrivals and any(j >= k for j in arrivals)):
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        for rid, prompt, p in (arrivals or {}).pop(k, []):
            eng.add_request(rid, prompt, p)
        k += 1
    eng.check_idle()
    return outs


def summary(outs: list[RequestOutput]) -> tuple:
    return (
        [t for o in outs for t in o.new_token_ids],
        [(lp.token_id, lp.logprob, lp.top) for o in outs for lp in o.logprobs],
        [o.finish_reason for o in outs if o.is_finished],
    )


@pytest.mark.parametrize("deterministic", [False, True])
def test_same_outputs_as_one_batch_at_a_time(tiny_model_dir, deterministic: bool) -> None:
    folder = tiny_model_dir("llama")
    got = {}
    for ahead in (False, True):
        eng = small_engine(folder, launch_ahead=ahead, is_deterministic=deterministic)
        for i, prompt in enumerate(PROMPTS):
            eng.add_request(f"r{i}", prompt, params(i), use_prefix_cache=False)
        got[ahead] = {rid: summary(o) for rid, o in run(eng).items()}
        if ahead:
            assert eng.stats().num_launched_ahead_total == eng.ahead.num_launched_ahead >= 10  # most decode steps
    assert got[True] == got[False]
    assert all(reasons for _, _, reasons in got[True].values())  # every request ended, once


def test_arrivals_and_aborts_while_a_batch_is_launched(tiny_model_dir) -> None:
    folder = tiny_model_dir("gemma3_hybrid")  # sliding layers: state slots too
    late = [("late-a", PROMPTS[1], params(1)), ("late-b", PROMPTS[2], params(2))]
    got = {}
    for ahead in (False, True):
        # deterministic: a request's tokens do not depend on the batch it shares, which differs here
        eng = small_engine(folder, launch_ahead=ahead, is_deterministic=True)
        for i in (0, 3, 5):
            eng.add_request(f"r{i}", PROMPTS[i], params(i), use_prefix_cache=False)
        got[ahead] = {rid: summary(o) for rid, o in run(eng, {4: late[:1], 7: late[1:]}).items()}
    assert got[True] == got[False] and {"late-a", "late-b"} <= set(got[True])

    eng = small_engine(folder, launch_ahead=True, is_deterministic=True)
    for i in (0, 1, 2):
        eng.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    outs: dict[str, list[RequestOutput]] = {}
    while eng.ahead.launched is None:  # prefill, then the first decode step launches the next one
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert {s.request_id for s in eng.ahead.launched.seqs} == {"r0", "r1", "r2"}
    eng.abort("r1")  # its row is in the launched batch
    eng.add_request("r3", PROMPTS[3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    step = eng.step()
    for o in step:
        outs.setdefault(o.request_id, []).append(o)
    assert [o.finish_reason for o in step if o.request_id == "r1"] == ["abort"]
    assert eng.ahead.launched is None  # r3 waits: nothing launched ahead
    before = len([t for o in outs["r1"] for t in o.new_token_ids])
    for rid, o in run(eng).items():
        outs.setdefault(rid, []).extend(o)
    assert len([t for o in outs["r1"] for t in o.new_token_ids]) == before  # no token after the abort
    assert [o.finish_reason for o in outs["r1"] if o.is_finished] == ["abort"]
    assert len([t for o in outs["r3"] for t in o.new_token_ids]) == 3
    assert all(len([t for o in outs[r] for t in o.new_token_ids]) == 30 for r in ("r0", "r2"))


def test_aborting_the_whole_launched_batch_leaves_nothing_behind(tiny_model_dir) -> None:
    eng = small_engine(tiny_model_dir("llama"), launch_ahead=True)
    for i in range(3):
        eng.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while eng.ahead.launched is None:
        eng.step()
    for i in range(3):
        eng.abort(f"r{i}")
    assert not eng.scheduler.has_unfinished() and eng.has_unfinished()  # the launched batch is still due
    finals = [o for o in eng.step() if o.is_finished]
    assert sorted(o.request_id for o in finals) == ["r0", "r1", "r2"] and not eng.has_unfinished()
    eng.check_idle()


def test_on_by_default_off_by_flag_and_never_while_a_prompt_is_computed(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    eng = small_engine(folder)
    eng.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert eng.ahead.enabled and eng.ahead.num_launched_ahead > 0
    eng = small_engine(folder, launch_ahead=False)
    eng.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert not eng.ahead.enabled and eng.ahead.num_launched_ahead == 0
    eng = small_engine(folder, launch_ahead=True, max_num_batched_tokens=8)  # prompts take several chunks
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.add_request("b", PROMPTS[5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    held_back = 0
    while eng.has_unfinished():
        eng.step()
        if any(s.num_uncomputed > 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
            assert eng.ahead.launched is None  # b's prompt is still being computed
            held_back += 1
        elif eng.ahead.launched is not None:
            assert eng.ahead.launched.num_new == [1] * len(eng.ahead.launched.seqs)
    assert held_back >= 2 and eng.ahead.num_launched_ahead > 0
    eng.check_idle()


# ---- fed ahead: the next batch launched before this one's tokens reach the host ---------------------


def greedy(i: int, stop: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, stop_token_ids=stop, ignore_eos=True)


def fed_run(folder, ahead: bool, requests, **kw) -> tuple[dict, object]:
    eng = small_engine(folder, launch_ahead=ahead, **kw)
    for rid, prompt, p in requests:
        eng.add_request(rid, prompt, p, use_prefix_cache=False)
    return {rid: summary(o) for rid, o in run(eng).items()}, eng


@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid"])
def test_fed_ahead_same_outputs_sequences_ending_in_flight(tiny_model_dir, family: str) -> None:
    """Greedy rows without logprobs: the next batch is fed the argmax on the device. Stop ids taken from
    a first run's outputs end some sequences mid-stream, after their next row was launched (so the
    batches differ from one step at a time: deterministic numerics, a row's logits batch-invariant)."""
    deterministic = True
    folder = tiny_model_dir(family)
    first, _ = fed_run(folder, False, [(f"r{i}", p, greedy(i)) for i, p in enumerate(PROMPTS)])
    stops = {i: (first[f"r{i}"][0][2 + i],) for i in (1, 3, 4)}  # a token each of these emitted mid-way
    requests = [(f"r{i}", p, greedy(i, stops.get(i, ()))) for i, p in enumerate(PROMPTS)]
    got = {}
    for ahead in (False, True):
        got[ahead], eng = fed_run(folder, ahead, requests, is_deterministic=deterministic)
        if ahead:
            assert eng.stats().num_fed_ahead_total == eng.ahead.num_fed_ahead >= 10
            assert eng.ahead.num_fed_ahead <= eng.ahead.num_launched_ahead
    assert got[True] == got[False]
    for i in stops:  # they did end early, on their stop id
        tokens, _, reasons = got[True][f"r{i}"]
        assert reasons == ["stop"] and tokens[-1] == stops[i][0] and len(tokens) < greedy(i).max_tokens


def test_fed_ahead_only_for_greedy_rows_and_falls_back_without_pages(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    mixed = [(f"r{i}", p, greedy(i)) for i, p in enumerate(PROMPTS[:4])]
    mixed.append(("sampled", PROMPTS[4], SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)))
    got = {}
    for ahead in (False, True):
        got[ahead], eng = fed_run(folder, ahead, mixed, is_deterministic=True)
    assert got[True] == got[False]
    # the sampled request (8 tokens) holds the batch to plain launches; after it, the greedy rows are fed
    assert 0 < eng.ahead.num_fed_ahead < eng.ahead.num_launched_ahead
    eng = small_engine(folder, launch_ahead=True, is_deterministic=True)
    eng.scheduler.grow_all = lambda seqs, n: False  # no pages for the next token without preempting
    for rid, prompt, p in mixed[:4]:
        eng.add_request(rid, prompt, p, use_prefix_cache=False)
    assert {rid: summary(o) for rid, o in run(eng).items()} == {r: got[False][r] for r, _, _ in mixed[:4]}
    assert eng.ahead.num_fed_ahead == 0 and eng.ahead.num_launched_ahead > 0


def test_abort_and_arrival_while_a_fed_batch_is_launched(tiny_model_dir) -> None:
    eng = small_engine(tiny_model_dir("gemma3_hybrid"), launch_ahead=True, is_deterministic=True)
    for i in range(3):
        eng.add_request(f"r{i}", PROMPTS[i], greedy(5), use_prefix_cache=False)
    outs: dict[str, list[RequestOutput]] = {}
    while eng.ahead.num_fed_ahead < 2:
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert eng.ahead.launched is not None
    eng.abort("r0")
    eng.add_request("new", PROMPTS[3], greedy(0), use_prefix_cache=False)
    for rid, o in run(eng).items():
        outs.setdefault(rid, []).extend(o)
    assert [o.finish_reason for o in outs["r0"] if o.is_finished] == ["abort"]
    assert len(summary(outs["r0"])[0]) < greedy(5).max_tokens
    assert all(len(summary(outs[r])[0]) == greedy(5).max_tokens for r in ("r1", "r2"))
    assert len(summary(outs["new"])[0]) == greedy(0).max_tokens
    alone, _ = fed_run(tiny_model_dir("gemma3_hybrid"), False, [("r1", PROMPTS[1], greedy(5))], is_deterministic=True)
    assert summary(outs["r1"]) == alone["r1"]  # deterministic: the same tokens as alone
