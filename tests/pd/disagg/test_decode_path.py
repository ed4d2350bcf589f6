"""The CE's P/D path (pd/disagg/decode_path.py) against a stand-in rank and PE: decode tokens do not wait for
the PE's answer; a request cancelled as its prefill fails leaves no task behind; a /prefill answer the CE
cannot read fails the request with a 502 and drops its reservation."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from engine.request import RequestOutput, SamplingParams
from pd.config import ServerConfig
from pd.disagg.prefill_client import PrefillFailed
from pd.messages import PrefillBody, PrefillReply, Reserved


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

    def choose(
        self, key: str | None, exclude: frozenset[str] = frozenset(), token_ids: list[int] | None = None
    ) -> tuple[_PE, str] | None:
        return None if exclude else (self.pe, "affinity")

    @contextlib.contextmanager
    def attempt(
        self, client: _PE, reason: str, num_tokens: float = 0, token_ids: list[int] | None = None
    ) -> Iterator[None]:
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
