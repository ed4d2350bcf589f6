"""The P/D pieces without servers: messages, config, /prefill parsing and auth, and the two rank roles
driven by hand on tiny engines (reserve, prefill, handoff over TCP on loopback, import, decode;
waiting for memory, expiry, aborts, refusals), each ending with both engines idle."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from engine.codec import to_wire
from engine.errors import InvalidRequestError
from engine.handoff.ledger import Phase
from engine.request import RequestOutput, SamplingParams, TokenLogprob
from pd.api.prefill import parse_prefill
from pd.config import RoleConfig, ServerConfig
from pd.disagg.prefill_client import PrefillFailed
from pd.errors import ApiError
from pd.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    MessageError,
    Prefill,
    PrefillBody,
    PrefillReply,
    PrefillResult,
    RequestRejected,
    Reserve,
    Reserved,
    StepOutputs,
    decode,
    encode,
)
from tests.engine_utils import small_engine
from transfer.config import TransferConfig

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


def _raw(kind: str, **fields: Any) -> bytes:
    """A rank message as a peer of another make could send it (no dataclass, no checks)."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": kind, **fields}, use_bin_type=True)


RESERVE = dict(request_id="r", num_tokens=10, num_commit_tokens=30, ttl_s=5.0)
PREFILL = dict(to_wire(Prefill("r", (1, 2), SamplingParams(), "h:1", 30.0)))


@pytest.mark.parametrize(
    "kind, fields, where",
    [
        ("reserve", {**RESERVE, "ttl": 5.0}, "ttl"),  # an unknown field
        ("reserve", {**RESERVE, "num_tokens": True}, "num_tokens"),  # a bool for an int
        ("reserve", {**RESERVE, "num_tokens": "10"}, "num_tokens"),
        ("reserve", {k: v for k, v in RESERVE.items() if k != "ttl_s"}, "ttl_s"),  # a missing field
        ("reserve", {**RESERVE, "num_tokens": 0}, "num_tokens"),  # out of range
        ("reserve", {**RESERVE, "num_commit_tokens": 9}, "num_commit_tokens"),
        ("reserve", {**RESERVE, "ttl_s": 0}, "ttl_s"),
        ("prefill", {**PREFILL, "prompt_token_ids": "12"}, "prompt_token_ids"),  # a string for a list
        ("prefill", {**PREFILL, "prompt_token_ids": [1, True]}, "prompt_token_ids[1]"),
        ("prefill", {**PREFILL, "params": {"top_k": 1.5}}, "params.top_k"),
        ("prefill", {**PREFILL, "params": {"stop": "x"}}, "params.stop"),
        ("prefill", {**PREFILL, "params": {"max_tokens": 0}}, "params.max_tokens"),
        ("prefill", {**PREFILL, "params": {"temprature": 0.0}}, "params.temprature"),
        ("prefill", {**PREFILL, "lease_s": -1.0}, "lease_s"),
        ("abort", {"request_ids": "r"}, "request_ids"),
        ("add", {"request_id": "r", "prompt_token_ids": [1], "params": {}, "use_prefix_cache": 1}, "use_prefix_cache"),
        ("ready", {"rank": 0, "pid": 1, "model_name": "m", "max_model_len": 8, "device": "cpu"}, "eos_token_ids"),
        ("outputs", {"outputs": [{"request_id": "r", "new_token_ids": [1], "extra": 1}]}, "outputs[0].extra"),
        ("prefill_result", {"request_id": "r", "is_handed_off": "yes"}, "is_handed_off"),
    ],
)
def test_rank_messages_are_decoded_strictly(kind: str, fields: dict[str, Any], where: str) -> None:
    with pytest.raises(MessageError) as e:
        decode(_raw(kind, **fields))
    assert e.value.field == where and kind in str(e.value)


def test_message_ranges_are_checked_on_construction_too():
    for bad in (lambda: Reserve("r", 0, 10, 1.0), lambda: Reserve("r", 1, 1, float("nan"))):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        Prefill("r", (), SamplingParams(), "h:1", 1.0)


def test_role_config_and_defaults():
    pe = ServerConfig.from_argv(["--role", "pe", "--transport", "ipc", "--ipc-arena-gb", "0.5"])
    ce = ServerConfig.from_argv(["--role", "ce", "--dp", "2", "--kv-port-base", "9100"])
    assert (pe.http_port, ce.http_port, ServerConfig.from_argv([]).http_port) == (8889, 8888, 8888)
    assert ServerConfig.from_argv(["--role", "pe", "--port", "7000"]).http_port == 7000
    assert ce.kv_address(1) == "127.0.0.1:9101"
    assert ce.role_config(1) == RoleConfig(None, "127.0.0.1", 9101, TransferConfig())
    assert ServerConfig(role="ce", kv_advertise_host="10.0.0.5").kv_address(0) == "10.0.0.5:8900"
    assert ServerConfig(role="ce", kv_advertise_host="fe80::1").kv_address(0) == "[fe80::1]:8900"
    transfer = pe.role_config(0).transfer
    assert (transfer.transport, transfer.ipc_arena_bytes) == ("ipc", 1 << 29) and not ServerConfig().is_pd
    nixl = ServerConfig.from_argv(["--role", "ce", "--nixl-arena-mb", "64"]).role_config(0).transfer
    assert [nixl.nixl_arena_bytes(d) for d in ("cpu", "cuda")] == [64 << 20, 64 << 20]
    assert [TransferConfig().nixl_arena_bytes(d) for d in ("cpu", "cuda")] == [256 << 20, 2048 << 20]
    assert TransferConfig(nixl_arena_mb=0).nixl_arena_bytes("cuda") == 0
    with pytest.raises(ValueError, match="nixl_arena_mb"):
        TransferConfig(nixl_arena_mb=-1)
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
    assert parse_prefill({**body, "lease_s": None, "seed": None}, 30.0) == msg
    assert parse_prefill({**body, "lease_s": 5, "seed": 3, "use_prefix_cache": False}, 30.0) == Prefill(
        "r", (1, 2), SamplingParams(max_tokens=3, stop=("a",)), "h:1", 5.0, False, 3
    )
    assert parse_prefill(to_wire(PrefillBody("r", (1, 2), msg.params, "h:1")), 30.0) == msg
    for key, value, param in (
        ("request_id", 5, "request_id"),
        ("prompt_token_ids", [], "prompt_token_ids"),
        ("prompt_token_ids", [1, "2"], "prompt_token_ids[1]"),
        ("prompt_token_ids", "12", "prompt_token_ids"),  # a string for a list
        ("params", {"max_tokens": 0}, "params.max_tokens"),
        ("params", {"top_k": True}, "params.top_k"),  # a bool for an int
        ("params", {"max_tokens": 3, "n": 2}, "params.n"),  # an unknown field
        ("receiver", None, "receiver"),
        ("seed", "x", "seed"),
        ("lease_s", -1, "lease_s"),
        ("use_prefix_cache", 1, "use_prefix_cache"),
        ("priority", 1, "priority"),  # an unknown field
    ):
        with pytest.raises(ApiError) as e:
            parse_prefill({**body, key: value}, 30.0)
        assert (e.value.status, e.value.param) == (400, param), (key, value, e.value.message)
    for bad, param in (({k: v for k, v in body.items() if k != "receiver"}, "receiver"), ([body], None), (None, None)):
        with pytest.raises(ApiError) as e:
            parse_prefill(bad, 30.0)
        assert (e.value.status, e.value.param) == (400, param)  # a missing field; not an object at all


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
    from pd.rank.decode_role import DecodeRole
    from pd.rank.prefill_role import PrefillRole

    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", TOKEN)
    monkeypatch.delenv("PDSERVE_CLUSTER_TOKEN_FILE", raising=False)
    folder = tiny_model_dir("qwen3_hybrid")
    ctx = zmq.Context()
    pe_engine = small_engine(folder, hicache_gb=0.01)
    ce_engine = small_engine(folder, hicache_gb=0, kv_cache_gb=0.002, max_num_seqs=4)
    pe = Side(pe_engine, None)
    ce = Side(ce_engine, None)
    pe.role = PrefillRole(pe_engine, ctx, pe.sent.append, RoleConfig(None, "127.0.0.1", 0, TransferConfig()))
    ce.role = DecodeRole(ce_engine, ctx, ce.sent.append, RoleConfig(None, "127.0.0.1", 0, TransferConfig()))
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


# ---- the coordinator's P/D path: decode tokens do not wait for the PE's answer -----------------------


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


class _Rank:
    """The CE rank as DecodePath sees it: grants the reservation, then decodes once told to."""

    index = 0

    def __init__(self) -> None:
        self.events: Any = None
        self.aborted: list[str] = []

    async def reserve(
        self, rid: str, num_prompt: int, num_total: int, ttl_s: float, events: Any, token_ids: Any = ()
    ) -> None:
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

    async def prefill(self, body: PrefillBody, max_body_bytes: int | None = None) -> PrefillReply:
        await self.answer.wait()
        return PrefillReply(True, 3, 2, 0.1, 0.01, 1000, "tcp", None)


class _OnePE:
    """A PrefillPool of one PE, as DecodePath sees it."""

    def __init__(self, pe: _PE) -> None:
        self.pe = pe

    def __len__(self) -> int:
        return 1

    def choose(self, key: str | None, exclude: frozenset[str] = frozenset()) -> tuple[_PE, str] | None:
        return None if exclude else (self.pe, "affinity")

    @contextlib.contextmanager
    def attempt(self, client: _PE, reason: str) -> Iterator[None]:
        yield


def test_decode_tokens_are_not_held_back_by_a_late_prefill_answer():
    import asyncio

    from prometheus_client import CollectorRegistry

    from pd.disagg.decode_path import DecodePath
    from pd.disagg.metrics import ClusterMetrics

    class Req:
        request_id = "r"
        prompt_token_ids = [1, 2, 3]
        params = SamplingParams(max_tokens=3)
        use_prefix_cache = True

    async def main() -> list[Any]:
        rank, pe = _Rank(), _PE()
        path = DecodePath(ServerConfig(role="ce"), _OnePE(pe), ClusterMetrics(CollectorRegistry()))  # type: ignore[arg-type]
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


def test_a_request_cancelled_as_its_prefill_fails_leaves_no_task_behind():
    """The client leaves (the request's task is cancelled) in the very turn of the loop in which the PE's
    failure arrives: nothing is left for asyncio to complain of when it collects the tasks (the prefill's
    exception unread: "Task exception was never retrieved"; the wait for the rank's next event still
    pending: "Task was destroyed but it is pending!"), and no reservation counts as held."""
    import asyncio
    import gc

    from prometheus_client import CollectorRegistry

    from pd.disagg.decode_path import DecodePath
    from pd.disagg.metrics import ClusterMetrics

    class FailingPE(_PE):
        async def prefill(self, body: PrefillBody, max_body_bytes: int | None = None) -> PrefillReply:
            await self.answer.wait()
            raise PrefillFailed("engine_error", "the prefill engine failed", 500)

    class Req:
        request_id = "r"
        prompt_token_ids = [1, 2, 3]
        params = SamplingParams(max_tokens=3)
        use_prefix_cache = True

    complaints: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: complaints.append(ctx["message"]))
        rank, pe = _Rank(), FailingPE()
        path = DecodePath(ServerConfig(role="ce"), _OnePE(pe), ClusterMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        task = asyncio.create_task(path.run(rank, Req(), asyncio.Queue(), time.monotonic()))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        pe.answer.set()  # the prefill fails in the loop's next turn ...
        task.cancel()  # ... the turn in which the request's task is cancelled
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert path.num_held == 0

    asyncio.run(main())
    gc.collect()
    assert complaints == []


# ---- /prefill's answer: a 200 the CE cannot read is a failed prefill, never a crash ------------------


GOOD_REPLY = to_wire(
    PrefillReply(False, 3, 1, 0.1, 0.0, 0, "tcp", RequestOutput("r", [5], "x", [TokenLogprob(5, -0.1)], True, "length"))
)


@pytest.mark.parametrize(
    "answer",
    [
        {"handed_off": True},  # missing fields
        {**GOOD_REPLY, "num_prompt_tokens": "3"},  # a wrong type
        {**GOOD_REPLY, "handed_off": 1},
        {**GOOD_REPLY, "output": {"request_id": "r", "new_token_ids": "5"}},
        {**GOOD_REPLY, "surprise": 1},  # an unknown field
        [1, 2],
    ],
)
def test_malformed_prefill_answer_is_a_failed_prefill(answer: Any) -> None:
    assert _post_prefill(answer) == ("bad_response", 200)


def test_prefill_answer_decodes() -> None:
    got = _post_prefill(GOOD_REPLY)
    assert isinstance(got, PrefillReply) and to_wire(got) == GOOD_REPLY
    assert got.output is not None and got.output.logprobs == [TokenLogprob(5, -0.1)]


def _post_prefill(answer: Any) -> Any:
    """What PrefillClient.prefill makes of a PE whose /prefill answers 200 with `answer`: the reply,
    or (code, status) of the PrefillFailed it raised."""
    import asyncio

    import orjson
    from aiohttp import web

    from pd.disagg.prefill_client import PrefillClient

    bodies: list[Any] = []

    async def prefill(request: web.Request) -> web.Response:
        bodies.append(orjson.loads(await request.read()))
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def main() -> Any:
        app = web.Application()
        app.router.add_post("/prefill", prefill)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = PrefillClient(f"http://127.0.0.1:{port}", TOKEN.encode(), 10.0)
        await client.start()
        try:
            return await client.prefill(PrefillBody("r", (1, 2, 3), SamplingParams(max_tokens=2), "h:1"))
        except PrefillFailed as e:
            return e.code, e.status
        finally:
            await client.stop()
            await runner.cleanup()

    got = asyncio.run(main())
    assert bodies == [to_wire(PrefillBody("r", (1, 2, 3), SamplingParams(max_tokens=2), "h:1"))]
    return got


def test_unreadable_prefill_answer_fails_the_request_cleanly():
    """A 200 the CE cannot read: the request ends with a 502 (no local prefill: the PE may have handed
    the KV off), and its CE reservation is dropped."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from pd.disagg.decode_path import DecodePath, PhaseError
    from pd.disagg.metrics import ClusterMetrics

    class BadPE:
        async def prefill(self, body: PrefillBody, max_body_bytes: int | None = None) -> PrefillReply:
            raise PrefillFailed("bad_response", "the prefill engine's answer does not decode", 200)

    class Req:
        request_id = "r"
        prompt_token_ids = [1, 2, 3]
        params = SamplingParams(max_tokens=3)
        use_prefix_cache = True

    async def main() -> tuple[Any, list[str]]:
        rank = _Rank()
        cfg = ServerConfig(role="ce", fallback_local_prefill=True)
        path = DecodePath(cfg, _OnePE(BadPE()), ClusterMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        out: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        await asyncio.wait_for(path.run(rank, Req(), out, time.monotonic()), 5.0)  # type: ignore[arg-type]
        return out.get_nowait(), rank.aborted

    (rid, ev), aborted = asyncio.run(main())
    assert rid == "r" and isinstance(ev, PhaseError) and ev.error.status == 502
    assert ev.error.code == "bad_response" and aborted == ["r"]


def test_an_engine_error_on_the_pe_answers_its_prefill_and_the_rank_serves_on(pd, monkeypatch):
    """The PE samples the first token: a fault there ends that Prefill with an engine_error result
    (its memory freed), and the next Prefill is handed off as usual."""
    import engine.engine as engine_module
    from engine.engine import FAILED

    pe, ce, _ = pd
    real = engine_module.sample

    def faulty(logits: Any, params: list[SamplingParams], *rest: Any) -> Any:
        if any(p.seed == 4242 for p in params):
            raise RuntimeError("injected sampling fault")
        return real(logits, params, *rest)

    monkeypatch.setattr(engine_module, "sample", faulty)
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


def test_what_a_decode_engine_forwards_fits_the_prefill_engines_limit():
    """A body the CE took (at --max-body-bytes, a schema full of quotes, a prompt at the context's
    length) grew past the PE's own --max-body-bytes as a /prefill body: 502 for a valid request
    (issue 29). The PE's /prefill now takes ServerConfig.prefill_max_body_bytes, which holds it."""
    import dataclasses as dc

    import orjson

    from pd.api.protocol import parse_chat_request

    cfg = ServerConfig(max_body_bytes=65536)
    cfg = dc.replace(cfg, engine=dc.replace(cfg.engine, max_model_len=2048))
    quotes = '"' * 20_000
    body = {"messages": [{"role": "user", "content": "Hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "q", "schema": {"type": "object", "description": quotes}}}}
    raw = orjson.dumps(body)
    assert len(raw) <= cfg.max_body_bytes
    params = parse_chat_request(orjson.loads(raw)).sampling.params(16, None, 0)
    prefill = PrefillBody("r" * 64, tuple([151_935] * 2047), params, "pe-host.example:8900", seed=2**63 - 1)
    forwarded = len(orjson.dumps(to_wire(prefill)))
    assert cfg.max_body_bytes < forwarded <= cfg.prefill_max_body_bytes


async def test_a_prefill_body_over_the_limit_is_a_413_and_is_not_sent():
    from pd.disagg.decode_path import _prefill_error
    from pd.disagg.prefill_client import PrefillClient

    client = PrefillClient("http://127.0.0.1:9", TOKEN.encode(), 10.0)  # nothing listens there
    await client.start()
    try:
        with pytest.raises(PrefillFailed) as e:
            await client.prefill(PrefillBody("r", tuple(range(1, 2000)), SamplingParams(max_tokens=2), "h:1"), 1024)
    finally:
        await client.stop()
    assert e.value.status == 413 and e.value.code == "request_too_large"
    error = _prefill_error(e.value)
    assert (error.status, error.code) == (413, "request_too_large")
