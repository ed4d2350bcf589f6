"""The two rank roles of a P/D pair (pd/rank/prefill_role.py, decode_role.py, role.py) driven by hand on tiny
engines: reserve, prefill, handoff over TCP on loopback, import, decode; waiting for memory, expiry, aborts,
refusals, a CE's local prefill, a fault while admitting or sampling one request; each ending with both
engines idle."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq

from engine.errors import InvalidRequestError
from engine.handoff.ledger import Phase
from engine.request import RequestOutput, SamplingParams
from pd.config import RoleConfig
from pd.messages import (
    AbortRequests,
    AddRequest,
    Prefill,
    PrefillResult,
    RequestRejected,
    Reserve,
    Reserved,
    StepOutputs,
)
from tests.engine_utils import small_engine
from tests.pd.conftest import CLUSTER_TOKEN
from transfer.config import TransferConfig


class Side:
    """An engine and its role, with the loop a rank runs reduced to what the test needs."""

    def __init__(self, engine: Any, role: Any) -> None:
        self.engine, self.role = engine, role
        self.sent: list[Any] = []
        self.outputs: dict[str, list[RequestOutput]] = {}

    def handle(self, msg: Any) -> None:
        if not self.role.handle(msg):
            if isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    self.engine.abort(rid)
            else:
                raise AssertionError(f"the role left {msg} to the loop")

    def turn(self) -> None:
        self.role.tick()
        if self.engine.has_unfinished():
            for o in self.role.on_outputs(self.engine.step()):
                self.outputs.setdefault(o.request_id, []).append(o)
        for m in self.sent:
            if isinstance(m, StepOutputs):
                for o in m.outputs:
                    self.outputs.setdefault(o.request_id, []).append(o)
        self.sent[:] = [m for m in self.sent if not isinstance(m, StepOutputs)]

    def take(self, kind: type, rid: str) -> Any:
        for m in self.sent:
            if isinstance(m, kind) and m.request_id == rid:
                self.sent.remove(m)
                return m
        return None


def run_until(sides: list[Side], cond: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        for s in sides:
            s.turn()
        time.sleep(0.002)


@contextmanager
def pd_pair(monkeypatch: pytest.MonkeyPatch, pe_engine: Any, ce_engine: Any) -> Iterator[tuple[Side, Side]]:
    """(pe, ce): the engines with a PE's and a CE's role on loopback, under the test cluster's token; the
    roles closed and their ZeroMQ context ended on the way out."""
    from pd.rank.decode_role import DecodeRole
    from pd.rank.prefill_role import PrefillRole

    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", CLUSTER_TOKEN)
    monkeypatch.delenv("PDSERVE_CLUSTER_TOKEN_FILE", raising=False)
    ctx = zmq.Context()
    pe, ce = Side(pe_engine, None), Side(ce_engine, None)
    pe.role = PrefillRole(pe_engine, ctx, pe.sent.append, RoleConfig(None, "127.0.0.1", 0, TransferConfig()))
    ce.role = DecodeRole(ce_engine, ctx, ce.sent.append, RoleConfig(None, "127.0.0.1", 0, TransferConfig()))
    try:
        yield pe, ce
    finally:
        pe.role.close()
        ce.role.close()
        ctx.term()


@pytest.fixture
def pd(tiny_model_dir, monkeypatch):
    """(pe, ce, model folder): tiny engines (qwen3_hybrid: full and sliding layers) with their roles."""
    folder = tiny_model_dir("qwen3_hybrid")
    pe_engine = small_engine(folder, hicache_gb=0.01)
    ce_engine = small_engine(folder, hicache_gb=0, kv_cache_gb=0.002, max_num_seqs=4)
    with pd_pair(monkeypatch, pe_engine, ce_engine) as (pe, ce):
        yield pe, ce, folder


def receiver(ce: Side) -> str:
    return ce.role.receiver.address


def handoff(pe: Side, ce: Side, rid: str, prompt: list[int], params: SamplingParams) -> PrefillResult:
    ce.handle(Reserve(rid, len(prompt) + 1, len(prompt) + params.max_tokens, 30.0))
    assert ce.take(Reserved, rid) is not None
    pe.handle(Prefill(rid, tuple(prompt), params, receiver(ce), 20.0))
    result: list[PrefillResult] = []

    def done() -> bool:
        got = pe.take(PrefillResult, rid)
        if got is not None:
            result.append(got)
        return bool(result)

    run_until([pe, ce], done)
    return result[0]


def decode_all(sides: list[Side], ce: Side, rid: str) -> list[int]:
    run_until(sides, lambda: any(o.is_finished for o in ce.outputs.get(rid, [])))
    return [t for o in ce.outputs[rid] for t in o.new_token_ids]


def idle(*sides: Side) -> None:
    for s in sides:
        while s.engine.has_unfinished():
            s.turn()
        s.engine.check_idle()
        assert not getattr(s.role, "jobs", {})  # commits and reservations: check_idle (engine.handoffs)


@pytest.mark.smoke
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=11, ignore_eos=True, logprobs=1),
    ],
)
def test_handoff_decodes_like_one_engine(pd, params):
    pe, ce, folder = pd
    prompt = [(i * 37) % 400 + 3 for i in range(45)]  # > the SWA window (24): the ring wraps
    (want,) = small_engine(folder, hicache_gb=0).generate([prompt], params)
    res = handoff(pe, ce, "a", prompt, params)
    assert (
        res.is_handed_off and res.payload_bytes > 0 and res.transport == "tcp" and res.num_prompt_tokens == 45
    )
    assert decode_all([pe, ce], ce, "a") == want.output_token_ids
    assert (
        ce.outputs["a"][0].new_token_ids[0] == want.output_token_ids[0]
    )  # the PE's first token, re-reported
    if params.logprobs is not None:
        assert len([lp for o in ce.outputs["a"] for lp in o.logprobs]) == 10
    # the same prompt again: the PE's prefix cache serves its full pages, and says so
    res = handoff(pe, ce, "b", prompt, params)
    assert res.num_cached_tokens > 0
    assert decode_all([pe, ce], ce, "b") == want.output_token_ids
    assert ce.role.stats()["handoffs_imported_total"] == 2
    idle(pe, ce)


def test_first_token_that_ends_the_request_is_not_handed_off(pd):
    pe, ce, _ = pd
    ce.handle(Reserve("m", 11, 11, 30.0))
    pe.handle(
        Prefill("m", tuple(range(3, 13)), SamplingParams(max_tokens=1, temperature=0.0), receiver(ce), 20.0)
    )
    run_until([pe, ce], lambda: any(isinstance(m, PrefillResult) for m in pe.sent))
    res = pe.take(PrefillResult, "m")
    assert not res.is_handed_off and res.output is not None and res.output.finish_reason == "length"
    assert len(res.output.new_token_ids) == 1
    ce.handle(AbortRequests(("m",)))  # what the coordinator does: the reservation is not needed
    idle(pe, ce)


def test_reservations_wait_for_memory_expire_and_abort(pd):
    pe, ce, _ = pd
    total = ce.engine.handoffs.num_total_blocks  # 16-token pages
    big = (total - 2) * 16  # commits all but one page
    ce.handle(Reserve("a", 10, big, 30.0))
    ce.handle(Reserve("b", 10, 40, 30.0))  # needs 3 pages: waits for a
    ce.handle(Reserve("c", 10, 10, 30.0))  # behind b (arrival order), though it would fit
    assert ce.take(Reserved, "a") and not ce.take(Reserved, "b") and not ce.take(Reserved, "c")
    assert ce.role.stats()["num_reservations_waiting"] == 2
    ce.handle(Reserve("huge", 10, total * 16 + 1, 30.0))  # more than the whole pool: refused at once
    assert isinstance(ce.take(RequestRejected, "huge"), RequestRejected)
    ce.handle(AbortRequests(("a",)))  # frees a: b and c are granted
    assert ce.take(Reserved, "b") and ce.take(Reserved, "c")
    ce.handle(AbortRequests(("c",)))
    ce.handle(Reserve("e", 10, 10, 0.05))  # a handoff that never arrives
    assert ce.take(Reserved, "e")
    time.sleep(0.1)
    ce.turn()
    (out,) = ce.outputs["e"]
    assert out.is_finished and out.finish_reason == "error" and "expired" in (out.error or "")
    assert ce.role.stats()["reservations_expired_total"] == 1
    # b's handoff is refused once b is aborted; the PE frees its copy and reports the refusal
    ce.handle(AbortRequests(("b",)))
    pe.handle(Prefill("b", tuple(range(3, 12)), SamplingParams(max_tokens=4), receiver(ce), 20.0))
    run_until([pe, ce], lambda: any(isinstance(m, PrefillResult) for m in pe.sent))
    res = pe.take(PrefillResult, "b")
    assert not res.is_handed_off and res.code == "unexpected"
    idle(pe, ce)


def test_pe_abort_in_every_phase_and_unreachable_receiver(pd):
    pe, ce, _ = pd
    params = SamplingParams(max_tokens=4)
    pe.handle(Prefill("q", tuple(range(3, 40)), params, receiver(ce), 20.0))
    pe.handle(AbortRequests(("q",)))  # queued
    pe.handle(Prefill("x", tuple(range(3, 40)), params, "127.0.0.1:1", 5.0))  # nothing listens
    run_until([pe], lambda: any(isinstance(m, PrefillResult) for m in pe.sent))
    res = pe.take(PrefillResult, "x")
    assert not res.is_handed_off and res.code == "transport"
    assert pe.role.stats()["handoff_failures_total"] == 1
    assert pe.take(PrefillResult, "q") is None  # an aborted request gets no answer: its caller left
    idle(pe, ce)


def test_local_prefill_on_the_ce_takes_over_its_reservation(pd):
    _, ce, _ = pd
    h = ce.engine.handoffs
    ce.handle(Reserve("L", 11, 14, 30.0))
    assert ce.take(Reserved, "L")
    add = AddRequest("L", tuple(range(3, 13)), SamplingParams(max_tokens=4, ignore_eos=True))
    assert not ce.role.handle(add)  # the rank loop adds it (what RankWorker does next)
    ce.engine.add_request(add.request_id, list(add.prompt_token_ids), add.params)
    assert h.phase("L") is Phase.LOCAL and h.num_held == 0 and h.num_committed_blocks == 1
    bad = AddRequest("bad", (3, 10**6), SamplingParams())
    assert ce.role.handle(bad)  # refused here: nothing committed
    assert isinstance(ce.take(RequestRejected, "bad"), RequestRejected) and h.phase("bad") is None
    assert len(decode_all([ce], ce, "L")) == 4
    assert h.phase("L") is None  # its commit ended with it
    idle(ce)


def test_an_engine_error_on_the_pe_answers_its_prefill_and_the_rank_serves_on(pd, monkeypatch):
    """The PE samples the first token: a fault there ends that Prefill with an engine_error result
    (its memory freed), and the next Prefill is handed off as usual."""
    import engine.execution.draw as draw_module
    from engine.engine import FAILED

    pe, ce, _ = pd
    real = draw_module.sample

    def faulty(logits: Any, params: list[SamplingParams], *rest: Any) -> Any:
        if any(p.seed == 4242 for p in params):
            raise RuntimeError("injected sampling fault")
        return real(logits, params, *rest)

    monkeypatch.setattr(draw_module, "sample", faulty)
    prompt = list(range(3, 40))
    bad = SamplingParams(max_tokens=4, temperature=0.5, seed=4242)
    res = handoff(pe, ce, "e", prompt, bad)
    assert not res.is_handed_off and res.code == "engine_error"
    assert res.message == FAILED.format(phase="sampling or detokenizing")  # nothing of the exception
    ce.handle(AbortRequests(("e",)))  # what the coordinator does with the reservation
    res = handoff(pe, ce, "ok", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert res.is_handed_off and len(decode_all([pe, ce], ce, "ok")) == 4
    idle(pe, ce)


def test_an_unexpected_admission_error_fails_that_request_alone_on_either_side(pd, monkeypatch):
    """An exception nobody planned for while admitting one request (llguidance 1.6.1 raised TypeError
    building its tokenizer inside add_request, and the PE rank exited): that request gets a generic
    internal error (the PE's engine_error, the CE's RequestRejected is_internal), the error is not
    fatal, nothing is left in the pools, and the next request is served by the same engines."""
    from pd.rank.role import ADMISSION_FAILED

    pe, ce, _ = pd
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def failing(real: Any, culprit: str) -> Any:
        def call(request_id: str, *args: Any, **kwargs: Any) -> Any:
            if request_id == culprit:
                raise TypeError("injected admission fault")
            return real(request_id, *args, **kwargs)

        return call

    # PE: the engine's add_request raises
    monkeypatch.setattr(pe.engine, "add_request", failing(pe.engine.add_request, "bad-pe"))
    res = handoff(pe, ce, "bad-pe", prompt, params)
    assert not res.is_handed_off and res.code == "engine_error" and res.message == ADMISSION_FAILED
    ce.handle(AbortRequests(("bad-pe",)))
    # CE: its reservation's admission raises
    monkeypatch.setattr(ce.engine.handoffs, "enqueue", failing(ce.engine.handoffs.enqueue, "bad-ce"))
    ce.handle(Reserve("bad-ce", len(prompt) + 1, len(prompt) + params.max_tokens, 30.0))
    rejected = ce.take(RequestRejected, "bad-ce")
    assert rejected is not None and rejected.is_internal and rejected.message == ADMISSION_FAILED
    idle(pe, ce)
    res = handoff(pe, ce, "ok", prompt, params)
    assert res.is_handed_off and len(decode_all([pe, ce], ce, "ok")) == 4
    idle(pe, ce)


def test_a_rejection_is_a_400_for_the_requests_fault_and_a_generic_500_otherwise():
    from pd.errors import rejected
    from pd.rank.role import ADMISSION_FAILED, rejection

    fault = rejected(rejection("r", InvalidRequestError("bad top_p", "top_p")))
    assert (fault.status, fault.param) == (400, "top_p")
    other = rejected(rejection("r", TypeError("'NoneType' object is not subscriptable")))
    assert other.status == 500 and other.message == ADMISSION_FAILED  # the exception's text stays in the log
