"""The P/D pieces without servers: messages, config, /prefill parsing and auth, and the two rank roles
driven by hand on tiny engines (reserve, prefill, handoff over TCP on loopback, import, decode;
waiting for memory, expiry, aborts, refusals), each ending with both engines idle."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from engine.request import RequestOutput, SamplingParams, TokenLogprob
from pd.config import ServerConfig
from pd.errors import ApiError
from pd.messages import (
    AbortRequests,
    Prefill,
    PrefillResult,
    RequestRejected,
    Reserve,
    Reserved,
    StepOutputs,
    decode,
    encode,
)
from pd.prefill_server import parse_prefill

from engine_utils import small_engine

TOKEN = "unit-test-cluster-token-0123456789"


# ---- messages, config, parsing ---------------------------------------------------------------------


def test_pd_messages_round_trip():
    params = SamplingParams(max_tokens=5, temperature=0.7, seed=3, stop=("x",), logprobs=1)
    out = RequestOutput(
        "r", [1, 2], "ab", [TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.0)))], True, "stop", 4, 2, 2
    )
    for msg in (
        Reserve("r", 10, 30, 5.0),
        Reserved("r"),
        Prefill("r", (1, 2, 3), params, "127.0.0.1:8900", 30.0, False, 7),
        Prefill("r", (1,), SamplingParams(), "[::1]:8900", 1.0),
        PrefillResult("r", True, 3, 2, 0.1, 0.2, 1000, "tcp"),
        PrefillResult("r", False, code="timeout", message="late"),
        PrefillResult("r", False, 3, 0, 0.1, output=out),
    ):
        assert decode(encode(msg)) == msg


def test_role_config_and_defaults():
    pe = ServerConfig.from_argv(["--role", "pe"])
    ce = ServerConfig.from_argv(["--role", "ce", "--dp", "2", "--kv-port-base", "9100"])
    assert (pe.port, ce.port, ServerConfig.from_argv([]).port) == (8889, 8888, 8888)
    assert ce.kv_address(1) == "127.0.0.1:9101" and ce.role_config(1)["kv_port"] == 9101
    assert ServerConfig(role="ce", kv_advertise_host="10.0.0.5").kv_address(0) == "10.0.0.5:8900"
    assert ServerConfig(role="ce", kv_advertise_host="fe80::1").kv_address(0) == "[fe80::1]:8900"
    assert pe.role_config(0)["transport"] == "tcp" and not ServerConfig().is_pd
    for bad in (
        dict(role="x"),
        dict(kv_port_base=65535, dp=2),
        dict(handoff_lease_s=0),
        dict(max_queued_requests=-1),
    ):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


def test_parse_prefill():
    body = {
        "request_id": "r",
        "prompt_token_ids": [1, 2],
        "params": {"max_tokens": 3, "stop": ["a"]},
        "receiver": "h:1",
    }
    msg = parse_prefill(body, 30.0)
    assert msg.params.stop == ("a",) and msg.lease_s == 30.0 and msg.use_prefix_cache and msg.seed is None
    for key, value in (
        ("request_id", 5),
        ("prompt_token_ids", []),
        ("prompt_token_ids", [1, "2"]),
        ("params", {"max_tokens": 0}),
        ("receiver", None),
        ("seed", "x"),
        ("lease_s", -1),
    ):
        with pytest.raises(ApiError) as e:
            parse_prefill({**body, key: value}, 30.0)
        assert e.value.status == 400


# ---- the roles on tiny engines ---------------------------------------------------------------------


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


@pytest.fixture
def pd(tiny_model_dir, monkeypatch):
    """(pe, ce, model folder): tiny engines (qwen3_hybrid: full and sliding layers) with their roles."""
    from pd.ce_rank import DecodeRole
    from pd.pe_rank import PrefillRole

    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", TOKEN)
    monkeypatch.delenv("PDSERVE_CLUSTER_TOKEN_FILE", raising=False)
    folder = tiny_model_dir("qwen3_hybrid")
    ctx = zmq.Context()
    pe_engine = small_engine(folder, hicache_gb=0.01)
    ce_engine = small_engine(folder, hicache_gb=0, kv_cache_gb=0.002, max_num_seqs=4)
    pe = Side(pe_engine, None)
    ce = Side(ce_engine, None)
    pe.role = PrefillRole(pe_engine, ctx, pe.sent.append, {})
    ce.role = DecodeRole(ce_engine, ctx, ce.sent.append, {"kv_host": "127.0.0.1", "kv_port": 0})
    try:
        yield pe, ce, folder
    finally:
        pe.role.close()
        ce.role.close()
        ctx.term()


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
        assert not getattr(s.role, "jobs", {}) and not getattr(s.role, "commits", {})


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
    total = ce.role.total_blocks  # 16-token pages
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


# ---- the coordinator's P/D path: decode tokens do not wait for the PE's answer -----------------------


class _Rank:
    """The CE rank as DisaggregatedPath sees it: grants the reservation, then decodes once told to."""

    index = 0

    def __init__(self) -> None:
        self.events: Any = None
        self.aborted: list[str] = []

    async def reserve(self, rid: str, num_prompt: int, num_total: int, ttl_s: float, events: Any) -> None:
        self.events = events
        events.put_nowait((rid, Reserved(rid)))

    async def abort(self, rids: list[str]) -> None:
        self.aborted += rids

    def decode(self, rid: str, token: int, is_finished: bool) -> None:
        self.events.put_nowait(
            (rid, RequestOutput(rid, [token], is_finished=is_finished, num_prompt_tokens=3))
        )


class _PE:
    """The PE's /prefill whose answer comes only when `answer` is set (its server busy elsewhere)."""

    def __init__(self) -> None:
        import asyncio

        self.answer = asyncio.Event()

    async def prefill(self, body: dict[str, Any]) -> Any:
        from pd.prefill_client import PrefillResponse

        await self.answer.wait()
        return PrefillResponse(True, 3, 2, 0.1, 0.01, 1000, "tcp", None)


def test_decode_tokens_are_not_held_back_by_a_late_prefill_answer():
    import asyncio

    from prometheus_client import CollectorRegistry

    from pd.cluster_metrics import ClusterMetrics
    from pd.disaggregation import DisaggregatedPath

    class Req:
        request_id = "r"
        prompt_token_ids = [1, 2, 3]
        params = SamplingParams(max_tokens=3)
        use_prefix_cache = True

    async def main() -> list[Any]:
        rank, pe = _Rank(), _PE()
        path = DisaggregatedPath(ServerConfig(role="ce"), pe, ClusterMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        out: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        task = asyncio.create_task(path.run(rank, Req(), out, time.monotonic()))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        rank.decode("r", 7, False)  # the CE verified the KV and decodes: the PE has not answered yet
        rank.decode("r", 8, False)
        first = [await asyncio.wait_for(out.get(), 2.0) for _ in range(2)]
        rank.decode("r", 9, True)  # the last one waits for the PE's cached count
        await asyncio.sleep(0.05)
        assert out.empty() and not task.done()
        pe.answer.set()
        last = await asyncio.wait_for(out.get(), 2.0)
        await asyncio.wait_for(task, 2.0)
        assert path.num_held == 0 and not rank.aborted
        return first + [last]

    got = asyncio.run(main())
    outs = [ev for _, ev in got]
    assert [o.new_token_ids for o in outs] == [[7], [8], [9]]  # type: ignore[attr-defined]
    assert outs[-1].is_finished and outs[-1].num_cached_tokens == 2  # type: ignore[attr-defined]
