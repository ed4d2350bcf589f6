"""The HTTP process's handle on one engine rank: starts the process, talks to it over ZeroMQ, and
notices its death at once (it awaits the process's exit), failing that rank's in-flight requests, then
starts it again as its RestartPolicy allows (backoff, a limit per window; never while stopping): the new
process re-registers with RankReady on the same sockets and the rank is up again.

The ranks of an expert-parallel group (`--ep N`) live and die together (RankGroup): they meet in
collectives every step, so when one dies the others are killed at once (no rank is left waiting in a
collective), every in-flight request of the group fails (503), and the group is started again as one,
with a fresh rendezvous address, under one RestartPolicy. Under `--tp` a rank's process is its
tensor-parallel group's first: a follower that dies fails that process's next collective, it exits,
and the group goes down and comes back as above (its followers die with their ranks' processes).

Outputs are delivered per request to the asyncio.Queue given at submit, as (request_id, event) pairs,
where event is a RequestOutput, a RequestRejected, or a RankDown; P/D ranks add Reserved (CE, then
outputs as for submit) and PrefillResult (PE, the last event of a prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from engine.codec import to_wire
from engine.config import EngineConfig
from engine.request import RequestOutput, SamplingParams
from pd.config import RoleConfig
from pd.messages import (
    AbortRequests,
    AddRequest,
    Message,
    MessageError,
    Prefill,
    PrefillResult,
    RankFatal,
    RankReady,
    RankStats,
    RequestRejected,
    Reserve,
    Reserved,
    Shutdown,
    StepOutputs,
    decode,
    encode,
)
from pd.rank import worker
from pd.rank.restart_policy import RestartPolicy

log = logging.getLogger(__name__)


class RankState(str, enum.Enum):
    STARTING = "starting"
    UP = "up"
    RESTARTING = "restarting"  # dead; the server restarts it after its backoff
    DOWN = "down"  # dead for good: its restart limit was reached, or it never came up
    STOPPED = "stopped"


@dataclass(frozen=True)
class RankDown:
    """The rank's engine process is gone; the request will get nothing more."""

    message: str


RankEvent = RequestOutput | RequestRejected | RankDown | Reserved | PrefillResult


class RankGroup:
    """The ranks of one expert-parallel group. Each member's watch calls member_down when its process
    dies (the others are killed), then restart_delay once it has reaped its own process: the members
    wait for one another, and the last to arrive decides for all (the policy's backoff, or None: the
    group stays down), so they are started again together."""

    def __init__(self, host: str, restart_policy: RestartPolicy | None) -> None:
        self.host = host
        self.members: list[RankClient] = []
        self.restart_policy = restart_policy
        self.address = self._new_address()
        self._decision: asyncio.Future[float | None] | None = None
        self._arrived: set[int] = set()
        self._was_ready = False
        self._waiting = 0

    def _new_address(self) -> str:
        """A port the OS just had free (rank 0's store binds it): a fresh one for each start, so a
        restart never meets the old group's connections."""
        with socket.socket() as s:
            s.bind((self.host, 0))
            return f"{self.host}:{s.getsockname()[1]}"

    def member_down(self, member: RankClient) -> None:
        """member's process died: kill its peers (they would wait for it in a collective)."""
        for m in self.members:
            if m is not member and m.proc is not None and m.proc.returncode is None:
                log.error("engine rank %d: killed with rank %d, its expert-parallel peer", m.index, member.index)
                m.proc.kill()

    async def restart_delay(self, member: RankClient, was_ready: bool) -> float | None:
        """Waits until every member's process is gone; the seconds to wait before starting them again,
        the same for all, or None (not restarted: the group never came up, or the policy's limit)."""
        if self._decision is None or (self._decision.done() and not self._waiting):
            self._decision = asyncio.get_running_loop().create_future()
            self._arrived, self._was_ready = set(), False
        decision = self._decision
        self._arrived.add(member.index)
        self._was_ready |= was_ready
        if len(self._arrived) == len(self.members) and not decision.done():
            delay = None
            if self._was_ready and self.restart_policy is not None:
                delay = self.restart_policy.next_delay_s(time.monotonic())
                if delay is None:
                    log.error("expert-parallel group stays down: %s", self.restart_policy.describe_limit())
                else:
                    self.address = self._new_address()
                    log.warning("restarting the expert-parallel group (%d ranks) in %.1f s", len(self.members), delay)
            decision.set_result(delay)
        self._waiting += 1
        try:
            return await decision
        finally:
            self._waiting -= 1


class RankClient:
    def __init__(
        self,
        index: int,
        dp: int,
        engine: EngineConfig,
        socket_dir: str,
        ctx: zmq.asyncio.Context,
        role: str = "single",
        role_config: RoleConfig | None = None,
        restart_policy: RestartPolicy | None = None,
        group: RankGroup | None = None,
        log_format: str = "text",
        tp: int = 1,
    ) -> None:
        """engine: what the rank builds its engine from (its device is resolved in the rank);
        role_config: pe|ce ranks' RoleConfig; restart_policy: None never restarts a dead process;
        group: the rank's expert-parallel group (its policy then decides restarts);
        log_format: the rank process's log lines (the server's --log-format); tp: the rank's
        tensor-parallel processes (its process starts the others, which die with it)."""
        self.tp = tp
        self.index = index
        self.dp = dp
        self.engine = engine
        self.role = role
        self.role_config = role_config
        self.inbox_addr = f"ipc://{socket_dir}/rank{index}-in"
        self.outbox_addr = f"ipc://{socket_dir}/rank{index}-out"
        self.ctx = ctx
        self.state = RankState.STARTING
        self.info: RankReady | None = None
        self.stats: dict[str, Any] = {}
        self.down_reason: str | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.restart_policy = restart_policy
        self.group = group
        self.log_format = log_format
        if group is not None:
            group.members.append(self)
        self.num_restarts = 0
        self._stopping = False
        self._streams: dict[str, asyncio.Queue[tuple[str, RankEvent]]] = {}
        self._ready: asyncio.Future[RankReady] = asyncio.get_running_loop().create_future()
        self._tasks: list[asyncio.Task[None]] = []
        self._fatal: str | None = None
        self._push = ctx.socket(zmq.PUSH)
        self._pull = ctx.socket(zmq.PULL)

    # ---- what routing and /health look at -----------------------------------------------------

    @property
    def is_up(self) -> bool:
        return self.state is RankState.UP

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "rank": self.index,
            "state": self.state.value,
            "num_inflight": self.num_inflight,
            "num_restarts": self.num_restarts,
        }
        if self.info:
            d["device"] = self.info.device
        for key in ("num_running", "num_waiting", "kv_usage", "num_free_blocks", "num_total_blocks"):
            if key in self.stats:
                d[key] = self.stats[key]
        if self.down_reason:
            d["error"] = self.down_reason
        return d

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(self.inbox_addr)
        self._pull.bind(self.outbox_addr)
        await self._spawn()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def _spawn(self) -> None:
        """Starts the rank's process; it connects to the sockets bound in start and sends RankReady."""
        self._fatal = None
        role_args = (
            [] if self.role_config is None else ["--role-config", json.dumps(to_wire(self.role_config))]
        )
        if self.group is not None:
            # every process of every member: --dp x --tp (engine/parallel/world.py)
            role_args += ["--ep", str(len(self.group.members) * self.tp), "--ep-address", self.group.address]
        if self.tp > 1:
            role_args += ["--tp", str(self.tp)]
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            worker.__name__,
            "--rank",
            str(self.index),
            "--dp",
            str(self.dp),
            "--inbox",
            self.inbox_addr,
            "--outbox",
            self.outbox_addr,
            "--engine-config",
            json.dumps(to_wire(self.engine)),
            "--role",
            self.role,
            "--log-format",
            self.log_format,
            *role_args,
            env=os.environ.copy(),
        )

    async def wait_ready(self, timeout_s: float) -> RankReady:
        return await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Asks the rank to exit, then kills it if it does not; nothing is restarted from here on."""
        self._stopping = True
        if self.proc is not None and self.proc.returncode is None:
            self.state = RankState.STOPPED
            with contextlib.suppress(zmq.ZMQError, asyncio.TimeoutError):
                # a process still starting may not have connected yet: PUSH would wait for it
                await asyncio.wait_for(self._push.send(encode(Shutdown())), 1.0)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.proc is not None and self.proc.returncode is None:  # spawned while the watch was cancelled
            self.proc.kill()
            await self.proc.wait()
        # NOTE: the watch, cancelled above, may not have told the requests in flight (it sleeps after the
        # exit): each is told here, or its handler waits for an answer that never comes and the server's
        # stop waits for the handler
        streams, self._streams = self._streams, {}
        for rid, q in streams.items():
            q.put_nowait((rid, RankDown(f"engine rank {self.index} stopped")))
        self._push.close(linger=0)
        self._pull.close(linger=0)

    # ---- requests -----------------------------------------------------------------------------

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue[tuple[str, RankEvent]],
        use_prefix_cache: bool = True,
    ) -> None:
        """Generation: the request's outputs (or a rejection, or RankDown) arrive on queue."""
        msg = AddRequest(request_id, tuple(prompt_token_ids), params, use_prefix_cache)
        await self._request(request_id, msg, queue)

    async def reserve(
        self,
        request_id: str,
        num_tokens: int,
        num_commit_tokens: int,
        ttl_s: float,
        queue: asyncio.Queue[tuple[str, RankEvent]],
        token_ids: tuple[int, ...] = (),
    ) -> None:
        """CE: asks for memory for a handed-off sequence of these prompt tokens; Reserved (with the
        tokens its decode cache holds) or a rejection arrives on queue."""
        msg = Reserve(request_id, num_tokens, num_commit_tokens, ttl_s, token_ids)
        await self._request(request_id, msg, queue)

    async def prefill(self, msg: Prefill, queue: asyncio.Queue[tuple[str, RankEvent]]) -> None:
        """PE: prefill and hand off; one PrefillResult (or RankDown) arrives on queue."""
        await self._request(msg.request_id, msg, queue)

    async def _request(
        self, request_id: str, msg: Message, queue: asyncio.Queue[tuple[str, RankEvent]]
    ) -> None:
        if not self.is_up:
            queue.put_nowait(
                (request_id, RankDown(self.down_reason or f"engine rank {self.index} is {self.state.value}"))
            )
            return
        # The coordinator refuses duplicate ids (409); this is a backstop. The same queue is the same
        # request going on (a CE's reservation, then its local prefill).
        if self._streams.get(request_id, queue) is not queue:
            queue.put_nowait(
                (request_id, RequestRejected(request_id, f"request id {request_id!r} is in flight already"))
            )
            return
        self._streams[request_id] = queue
        await self._push.send(encode(msg))

    async def abort(self, request_ids: list[str]) -> None:
        ids = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        if ids and self.is_up:
            await self._push.send(encode(AbortRequests(tuple(ids))))

    # ---- background tasks ---------------------------------------------------------------------

    def _deliver(self, request_id: str, event: RankEvent, is_final: bool) -> None:
        q = self._streams.pop(request_id, None) if is_final else self._streams.get(request_id)
        if q is not None:
            q.put_nowait((request_id, event))

    async def _read(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                msg = decode(data)
            except MessageError as e:
                log.error("rank %d sent an undecodable message: %s", self.index, e)
                continue
            if isinstance(msg, StepOutputs):
                for o in msg.outputs:
                    if o.request_id in msg.queue_times_s:
                        o.queue_time_s = msg.queue_times_s[o.request_id]  # type: ignore[attr-defined]
                    self._deliver(o.request_id, o, o.is_finished)
                if msg.stats is not None:
                    self.stats = msg.stats
            elif isinstance(msg, RankStats):
                self.stats = msg.stats
            elif isinstance(msg, RequestRejected):
                self._deliver(msg.request_id, msg, True)
            elif isinstance(msg, Reserved):
                self._deliver(msg.request_id, msg, False)
            elif isinstance(msg, PrefillResult):
                self._deliver(msg.request_id, msg, True)
            elif isinstance(msg, RankReady):
                self.info, self.stats = msg, msg.stats
                if self.state is RankState.STARTING:
                    self.state = RankState.UP
                    self.down_reason = None
                if not self._ready.done():
                    self._ready.set_result(msg)
            elif isinstance(msg, RankFatal):
                self._fatal = msg.message

    async def _watch(self) -> None:
        """Awaits the process; on its death fails the in-flight requests, then restarts it (a new
        process) when the rank had been ready once, the server is not stopping and the policy allows."""
        while True:
            assert self.proc is not None
            code = await self.proc.wait()  # NOTE: reaped, so its KV receiver port is free to rebind
            await asyncio.sleep(0.05)  # let a RankFatal sent just before the exit arrive
            stopping = self._stopping or self.state is RankState.STOPPED
            reason = f"engine rank {self.index} exited with code {code}"
            if self._fatal:  # clients and /health get the error's type; its text (paths...) goes to the log
                reason += f": {self._fatal.split(':', 1)[0]}"
            if not stopping:
                self.state = RankState.DOWN
                self.down_reason = reason
                log.error("%s (pid %d): %s", reason, self.proc.pid, self._fatal or "killed or crashed")
                if self.group is not None:
                    self.group.member_down(self)
            was_ready = self._ready.done() and self._ready.exception() is None
            if not self._ready.done():  # the server's log says why it cannot start: the error's text too
                self._ready.set_exception(RuntimeError(f"{reason} ({self._fatal})" if self._fatal else reason))
            streams, self._streams = self._streams, {}
            for rid, q in streams.items():
                q.put_nowait((rid, RankDown(reason)))
            if self.group is not None and not stopping:
                policy = self.group.restart_policy
                delay_s = await self.group.restart_delay(self, was_ready)
                if delay_s is None:
                    if was_ready and policy is not None:
                        self.down_reason = f"{reason}; not restarted: {policy.describe_limit()}"
                    return
            else:
                if stopping or not was_ready or self.restart_policy is None:
                    return
                delay_s = self.restart_policy.next_delay_s(time.monotonic())
                if delay_s is None:
                    self.down_reason = f"{reason}; not restarted: {self.restart_policy.describe_limit()}"
                    log.error("engine rank %d stays down: %s", self.index, self.restart_policy.describe_limit())
                    return
            log.warning("restarting engine rank %d in %.1f s", self.index, delay_s)
            self.state = RankState.RESTARTING
            self.down_reason = f"{reason}; restarting in {delay_s:g} s"
            await asyncio.sleep(delay_s)
            if self._stopping:
                return
            self.state = RankState.STARTING
            self.down_reason = f"{reason}; restarting"
            self.num_restarts += 1
            await self._spawn()
            if self._stopping:  # stop() ran while the process was being created
                assert self.proc is not None
                self.proc.kill()
                await self.proc.wait()
                return
