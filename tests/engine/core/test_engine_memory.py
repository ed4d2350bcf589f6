"""Block pool, state slots, scheduler (budget, admission, preemption, abort) and export/import."""

from __future__ import annotations

import pytest
import torch

from engine.core.block_pool import BlockPool, OutOfBlocksError
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.sequence import Sequence
from engine.handoff.ledger import Grant
from engine.request import SamplingParams
from tests.engine_utils import small_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_block_pool_refcounts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and not pool.can_allocate(2)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    pool.share(a[:1])
    pool.free(a)
    assert pool.num_free == 3 and pool.refcount(a[0]) == 1
    with pytest.raises(AssertionError):
        pool.check_idle()
    pool.free(a[:1])
    with pytest.raises(ValueError):
        pool.free(a[:1])
    pool.check_idle()


def _scheduler(num_blocks: int, budget: int, max_seqs: int = 8, slots: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_seqs, budget, block_size=4, needs_blocks=True, needs_state_slot=True)
    return Scheduler(cfg, BlockPool(num_blocks), BlockPool(slots))


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(3, 3 + n)), GREEDY, 0, 0.0)


def test_scheduler_budget_and_chunking() -> None:
    s = _scheduler(num_blocks=64, budget=10)
    for i, n in enumerate([7, 9, 3]):
        s.add(_seq(f"r{i}", n))
    b = s.schedule()
    assert [q.request_id for q in b.seqs] == ["r0", "r1"] and b.num_new_tokens == [7, 3]  # r1 chunked
    _advance(b)
    b = s.schedule()  # decode first, then the rest of r1's prompt, then r2 within the budget
    assert [q.request_id for q in b.seqs] == ["r0", "r1", "r2"] and b.num_new_tokens == [1, 6, 3]
    _advance(b)
    b = s.schedule()
    assert b.num_new_tokens == [1, 1, 1]


def _advance(batch) -> None:
    """What the engine does after a step: count computed tokens, sample for finished prefills."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.output_token_ids.append(5)


def test_scheduler_admission_waits_for_memory_and_slots() -> None:
    s = _scheduler(num_blocks=4, budget=100, slots=1)
    s.add(_seq("a", 10))  # needs ceil(11/4) = 3 blocks and the only slot
    s.add(_seq("b", 2))
    b = s.schedule()
    assert [q.request_id for q in b.seqs] == ["a"] and len(s.waiting) == 1
    s.finish(s.running[0], "stop")
    b = s.schedule()
    assert [q.request_id for q in b.seqs] == ["b"]
    s.finish(s.running[0], "stop")
    s.blocks.check_idle()
    s.slots.check_idle()


def test_scheduler_preempts_newest_when_pages_run_out() -> None:
    s = _scheduler(num_blocks=4, budget=100)
    s.add(_seq("old", 3))  # 1 block (3+1 tokens)
    s.add(_seq("new", 7))  # 2 blocks
    _advance(s.schedule())
    assert s.blocks.num_free == 1
    old = s.running[0]  # pretend it decoded 8 more tokens: its next one needs 2 more pages
    old.output_token_ids += [5] * 8
    old.num_computed = old.num_tokens - 1
    b = s.schedule()
    assert [q.request_id for q in b.seqs] == ["old"]
    assert s.num_preemptions >= 1 and s.waiting and s.waiting[0].request_id == "new"
    assert s.waiting[0].num_computed == 0 and not s.waiting[0].block_ids


def test_engine_abort_in_every_phase_frees_everything(tiny_model_dir) -> None:
    eng = small_engine(tiny_model_dir("gemma3_hybrid"), max_num_batched_tokens=32, max_num_seqs=2)
    long = list(range(3, 103))
    eng.add_request("prefilling", long, GREEDY)
    eng.add_request("decoding", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    eng.add_request("waiting", [8, 9], GREEDY)
    outs = eng.step() + eng.step()
    assert eng.scheduler.find("prefilling").is_prefilling
    for rid in ("prefilling", "decoding", "waiting"):
        eng.abort(rid)
    eng.abort("unknown")  # a no-op
    outs = eng.step()
    assert {o.request_id: o.finish_reason for o in outs if o.is_finished} == {
        "prefilling": "abort",
        "decoding": "abort",
        "waiting": "abort",
    }
    eng.check_idle()


@pytest.mark.parametrize(
    "make_params, param",
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(temperature=-0.1), "temperature"),
        (lambda: SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: SamplingParams(logprobs=99), "top_logprobs"),
    ],
)
def test_bad_sampling_params(make_params, param: str) -> None:
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        make_params()
    assert e.value.param == param


def test_bad_requests_leave_nothing_allocated(tiny_model_dir) -> None:
    from engine.errors import InvalidRequestError

    eng = small_engine(tiny_model_dir("llama"), max_model_len=128)
    cases = [
        ([], GREEDY, "empty"),
        ([3, 512], GREEDY, "[0, 512)"),
        ([3, -1], GREEDY, "[0, 512)"),
        ([3] * 125, SamplingParams(max_tokens=8), "maximum context length is 128"),
    ]
    for prompt, params, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg.replace("[", r"\[").replace(")", r"\)")):
            eng.add_request("bad", prompt, params)
    eng.add_request("ok", [3, 4], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("ok", [3, 4], GREEDY)
    while eng.has_unfinished():
        eng.step()
    eng.check_idle()


@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid", "mistral", "deepseek_v3"])
@pytest.mark.parametrize("is_deterministic", [False, True], ids=["default", "deterministic"])
def test_export_import_round_trip(tiny_model_dir, family: str, is_deterministic: bool) -> None:
    """A sequence exported mid-generation and imported into a fresh engine continues identically."""
    folder = tiny_model_dir(family)
    prompt = torch.randint(3, 512, (70,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = small_engine(folder, is_deterministic=is_deterministic)
    (full,) = ref.generate([prompt], params)

    src = small_engine(folder, is_deterministic=is_deterministic)
    src.add_request("r", prompt, params)
    while len(src.scheduler.find("r").output_token_ids) < 11:
        src.step()
    exp = src.export_sequence("r")
    src.abort("r")
    src.step()
    src.check_idle()

    dst = small_engine(folder, is_deterministic=is_deterministic, kv_cache_gb=0.03)
    dst.import_sequence(exp)
    tokens: list[int] = []
    while dst.has_unfinished():
        for out in dst.step():
            tokens += out.new_token_ids
    assert tokens == full.output_token_ids  # the imported outputs are reported too, then the rest
    dst.check_idle()


def test_import_refuses_mismatched_layout(tiny_model_dir) -> None:
    from engine.errors import InvalidRequestError

    eng = small_engine(tiny_model_dir("llama"))
    eng.add_request("r", [3, 4, 5, 6, 7], GREEDY)
    eng.step()
    exp = eng.export_sequence("r")
    exp.pages = exp.pages[..., :-1]
    exp.request_id = "r2"
    with pytest.raises(InvalidRequestError, match="shape"):
        eng.import_sequence(exp)


def test_seeded_sampling_is_batch_independent(tiny_model_dir) -> None:
    eng = small_engine(tiny_model_dir("qwen2"), is_deterministic=True)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=123, ignore_eos=True)
    (alone,) = eng.generate([[3, 4, 5, 6]], p)
    batch = eng.generate([[9, 9, 9], [3, 4, 5, 6], [7] * 20], [GREEDY, p, GREEDY])
    assert alone.output_token_ids == batch[1].output_token_ids
    other = eng.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=12, temperature=0.9, seed=124, ignore_eos=True))
    assert other[0].output_token_ids != alone.output_token_ids
    top1 = eng.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=12, temperature=0.7, top_k=1, ignore_eos=True))
    greedy = eng.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert top1[0].output_token_ids == greedy[0].output_token_ids


def test_logprobs_and_stop_token_ids(tiny_model_dir) -> None:
    eng = small_engine(tiny_model_dir("llama"))
    (g,) = eng.generate([[3, 4, 5]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3))
    assert len(g.output_logprobs) == 6
    for tok, lp in zip(g.output_token_ids, g.output_logprobs):
        assert lp.token_id == tok and lp.top[0][0] == tok and lp.logprob <= 0.0 and len(lp.top) == 3
    stop_at = g.output_token_ids[2]
    (s,) = eng.generate([[3, 4, 5]], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop_at,)))
    assert s.output_token_ids == g.output_token_ids[: g.output_token_ids.index(stop_at) + 1]
    assert s.finish_reason == "stop"
    eng.check_idle()


@pytest.mark.parametrize("family", ["gemma3_hybrid", "llama", "deepseek_v3"])
def test_prefill_only_handoff_to_a_reserved_decoder(tiny_model_dir, family: str) -> None:
    """PE engine parks after the first token; the CE engine reserves memory first, imports, and
    decodes: the tokens equal a single engine's, seeded sampling included."""
    folder = tiny_model_dir(family)
    prompt = list(range(3, 60))
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, logprobs=2)
    (ref,) = small_engine(folder, is_deterministic=True).generate([prompt], params)

    pe = small_engine(folder, is_deterministic=True)
    ce = small_engine(folder, is_deterministic=True)
    ce.handoffs.enqueue("r", len(prompt) + 1, len(prompt) + params.max_tokens, 30.0)
    assert ce.handoffs.grant() == [Grant("r")]
    used = ce.stats().num_free_blocks
    pe.add_request("r", prompt, params, prefill_only=True)
    outs = []
    while pe.has_unfinished():
        outs += pe.step()
    assert outs[-1].is_handoff_ready and not outs[-1].is_finished and len(outs[-1].new_token_ids) == 1
    exp = pe.export_sequence("r")
    pe.finish_handoff("r")
    pe.check_idle()

    ce.import_sequence(exp)
    assert ce.stats().num_free_blocks == used  # the reservation became the sequence's memory
    tokens, logprobs = [], []
    while ce.has_unfinished():
        for o in ce.step():
            tokens += o.new_token_ids
            logprobs += o.logprobs
    assert tokens == ref.output_token_ids
    assert [lp.logprob for lp in logprobs] == [lp.logprob for lp in ref.output_logprobs]
    ce.check_idle()


def test_reservations_gate_admission_and_free_on_abort(tiny_model_dir) -> None:
    eng = small_engine(tiny_model_dir("llama"), kv_cache_gb=None, max_num_seqs=2)
    for rid in ("a", "b", "c"):
        eng.handoffs.enqueue(rid, 10, 10, 30.0)
    assert eng.handoffs.grant() == [Grant("a"), Grant("b")]  # max_num_seqs reached: c waits
    eng.abort("a")
    assert eng.handoffs.grant() == [Grant("c")]
    for rid in ("b", "c", "nothing"):
        eng.abort(rid)
    eng.check_idle()


def test_import_of_a_finished_first_token_ends_at_once(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    pe, ce = small_engine(folder), small_engine(folder)
    pe.add_request("r", [3, 4, 5], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), prefill_only=True)
    while pe.has_unfinished():
        pe.step()
    exp = pe.export_sequence("r")
    pe.abort("r")  # aborting a parked sequence frees it too
    pe.step()
    pe.check_idle()
    exp.params = SamplingParams(max_tokens=1, temperature=0.0)  # as if max_tokens=1 had been asked
    ce.import_sequence(exp)
    (out,) = ce.step()
    assert out.is_finished and out.finish_reason == "length" and out.new_token_ids == exp.output_token_ids
    ce.check_idle()
