"""One engine rank: a process that owns an LLMEngine and serves it over ZeroMQ.

    python -m pd.rank.worker --rank I --dp N --inbox ADDR --outbox ADDR --engine-config JSON [--role pe|ce --role-config JSON]

The JSON are an EngineConfig and a RoleConfig encoded by engine/codec.py: a key either class lacks is
an error (the rank reports it and exits), never dropped.

The loop: take every queued AddRequest/AbortRequests, run one engine step while there is work, push
that step's outputs (tokens stream back as they are sampled). When idle it blocks on the inbox and
sends its stats once a second as a heartbeat. It dies with its parent (PR_SET_PDEATHSIG), so no rank
outlives the server holding memory.

`--ep N` (with `--dp N` and `--ep-address HOST:PORT`, which the server gives every rank of the group):
the ranks split every MoE layer's experts (engine/parallel/expert_parallel.py) and step in lockstep: each loop
they agree whether any of them has work, and if so all run one engine step (a rank with nothing to do
runs an empty forward, so every rank enters the same MoE exchanges). Idle, they poll every
EP_IDLE_POLL_S instead of blocking, so a new request waits at most that long for its group.

`--tp N` with `--ep`: one world of every rank's processes (engine/parallel/world.py): the rank's followers join it at
the `--ep-address` too, and the group's first process takes part in the loop above for the group.

`--tp N`: the rank is a tensor-parallel group of N processes holding one model split across them
(engine/parallel/tensor_parallel.py). This process is the group's first: it starts the other N - 1
(pd/rank/tp_follower.py, its children, on the next GPUs: rank i's group takes GPUs i*N .. i*N + N-1),
schedules and samples, and broadcasts every forward's plan; idle, it broadcasts an idle plan every
TP_HEARTBEAT_S. A follower that dies fails this process's next collective, so the rank
exits and the server restarts it, followers and all; a follower dies with this process.

`--role pe|ce` adds a RankRole (pd/rank/prefill_role.py, pd/rank/decode_role.py): the P/D messages it takes, the threads
it runs (KV sender or receiver) and what it does with the engine's outputs. A role's threads never touch
the engine: they queue their news and ring `role.wake`; the role applies it on this thread in tick().
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import zmq

from engine.checkpoints import load_progress
from engine.codec import from_wire, to_wire
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from pd.config import LOG_FORMATS, RoleConfig
from pd.http.request_log import install as install_logging
from pd.kv_events.publisher import KVEventPublisher
from pd.lifecycle import exit_now
from pd.messages import (
    AbortRequests,
    AddRequest,
    Message,
    RankFatal,
    RankReady,
    RankStats,
    Shutdown,
    StepOutputs,
    decode,
    encode,
)
from pd.rank.iteration_tokens import IterationTokens
from pd.rank.role import RankRole, add_request, rejection
from transfer.auth import load_token

if TYPE_CHECKING:  # NOTE: main() imports the engine inside its try, so a failed import is a RankFatal
    from engine.engine import LLMEngine
    from engine.parallel.expert_parallel import ExpertGroup
    from engine.parallel.tensor_parallel import TensorGroup

HEARTBEAT_S = 1.0
BUSY_STATS_EVERY_S = 0.1
EP_IDLE_POLL_S = 0.002  # an idle rank of an expert-parallel group: one `any` collective this often
TP_HEARTBEAT_S = 1.0  # an idle first process of a tensor-parallel group: an idle plan this often
log = logging.getLogger(__spec__.name)  # __name__ is "__main__" under python -m


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def read_configs(engine_json: str, role_json: str | None) -> tuple[EngineConfig, RoleConfig | None]:
    """The rank's EngineConfig and RoleConfig from their JSON; WireError for an unknown or misspelled
    key, a wrong type or a value their checks refuse."""
    role = None if role_json is None else from_wire(RoleConfig, json.loads(role_json))
    return from_wire(EngineConfig, json.loads(engine_json)), role


def engine_config(cfg: EngineConfig, rank: int, dp: int, tp: int = 1, tp_rank: int = 0) -> EngineConfig:
    """EngineConfig of this rank (of process tp_rank of its tensor-parallel group): its own GPU on CUDA,
    a share of the cores on the CPU."""
    import torch

    device = cfg.device
    if device in ("auto", "cuda") and torch.cuda.is_available():
        device = f"cuda:{(rank * tp + tp_rank) % torch.cuda.device_count()}"
    elif device == "auto":
        device = "cpu"
    if device == "cpu" and tp_rank == 0:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (dp * tp)))
    return replace(cfg, device=device)


def start_followers(
    cfg: EngineConfig, rank: int, dp: int, tp: int, log_format: str = "text", world_address: str | None = None
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """The group's rendezvous address and its other N - 1 processes (pd/rank/tp_follower.py), each on
    its own device and a share of the cores, logging as the rank does (log_format). world_address
    (--ep): the group joins the world of every rank's processes there instead (engine/parallel/world.py)."""
    address = world_address
    if address is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
    world = [] if world_address is None else ["--dp-rank", str(rank), "--dp", str(dp)]
    procs = []
    for k in range(1, tp):
        follower = engine_config(cfg, rank, dp, tp, k)
        env = os.environ.copy()
        if follower.device == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (dp * tp)))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pd.rank.tp_follower", "--tp-rank", str(k), "--tp", str(tp), "--address", address,
             *world, "--engine-config", json.dumps(to_wire(follower)), "--log-format", log_format],
            env=env,
        ))  # fmt: skip
    return address, procs


class RankWorker:
    def __init__(
        self,
        rank: int,
        engine: LLMEngine,
        inbox: zmq.Socket,
        outbox: zmq.Socket,
        role: RankRole | None = None,
        ep: ExpertGroup | None = None,
        tp: TensorGroup | None = None,
    ) -> None:
        """ep: the rank's expert-parallel group (the loop then steps in lockstep with its peers); tp: its
        tensor-parallel group, of which this process is the first (idle, it beats every TP_HEARTBEAT_S)."""
        self.rank = rank
        self.ep = ep
        self.tp = tp
        self.last_plan_s = time.monotonic()  # tp: when the followers last heard of this process
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.role = role
        self.last_stats_s = 0.0
        self.added_s: dict[str, float] = {}  # request id -> when it was added, until its first output
        self.iteration_tokens = IterationTokens(self._num_tokens_total())
        self.kv_events: KVEventPublisher | None = None  # --kv-events-config: what the caches gained and lost

    def publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.engine.kv_events.drain())

    def _num_tokens_total(self) -> int:
        return self.engine.num_prompt_tokens_total + self.engine.num_generation_tokens_total

    def send(self, msg: Message) -> None:
        self.outbox.send(encode(msg))

    def stats(self) -> dict[str, Any]:
        self.last_stats_s = time.monotonic()
        stats = asdict(self.engine.stats())
        stats.update(self.iteration_tokens.stats())
        if self.role is not None:
            stats.update(self.role.stats())
        return stats

    def handle(self, msg: Message) -> bool:
        """Applies one message; False on Shutdown."""
        if self.role is not None and self.role.handle(msg):
            return True
        if isinstance(msg, AddRequest):
            error = add_request(self.engine, msg)
            if error is None:
                self.added_s[msg.request_id] = time.monotonic()
            else:
                self.send(rejection(msg.request_id, error))
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.added_s.pop(rid, None)
                self.engine.abort(rid)
        elif isinstance(msg, Shutdown):
            return False
        else:
            log.warning("rank %d: unexpected message %s", self.rank, type(msg).__name__)
        return True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        role = self.role
        if role is not None:
            poller.register(role.wake, zmq.POLLIN)
        parent = os.getppid()
        while True:
            busy = self.engine.has_unfinished()
            idle_s = HEARTBEAT_S if role is None else min(HEARTBEAT_S, role.poll_timeout_s())
            if self.ep is not None:
                idle_s = min(idle_s, EP_IDLE_POLL_S)
            ready = poller.poll(0 if busy else max(1, int(idle_s * 1000)))
            if role is not None:
                while True:
                    try:
                        role.wake.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                role.tick()
            if ready:
                while True:
                    try:
                        data = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if not self.handle(decode(data)):
                        return
                self.publish_kv_events()  # a role's handoff may index pages outside a step
            has_work = self.engine.has_unfinished()
            if self.ep is not None:
                has_work = self.ep.any(has_work)  # NOTE: every rank of the group, every loop
            if has_work:
                step_start_s = self.last_plan_s = time.monotonic()
                outputs = self.engine.step()
                self.iteration_tokens.observe(self._num_tokens_total())
                # NOTE: approximate: a prompt prefilled in several chunks counts its earlier chunks as queueing.
                queue_times_s = {
                    o.request_id: step_start_s - self.added_s.pop(o.request_id)
                    for o in outputs
                    if o.request_id in self.added_s and (o.new_token_ids or o.is_finished)
                }
                if role is not None:
                    outputs = role.on_outputs(outputs)
                now = time.monotonic()
                finished = any(o.is_finished for o in outputs)
                stats = self.stats() if finished or now - self.last_stats_s >= BUSY_STATS_EVERY_S else None
                if outputs or stats is not None:
                    self.send(StepOutputs(tuple(outputs), stats, queue_times_s))
                self.publish_kv_events()
            else:
                if self.tp is not None and time.monotonic() - self.last_plan_s >= TP_HEARTBEAT_S:
                    self.engine.heartbeat()  # NOTE: a follower gone fails it: the rank exits and restarts
                    self.last_plan_s = time.monotonic()
                if time.monotonic() - self.last_stats_s >= HEARTBEAT_S:
                    if os.getppid() != parent:
                        return  # orphaned (PDEATHSIG is Linux-only)
                    self.send(RankStats(self.stats()))


def kv_event_publisher(cfg: EngineConfig, rank: int, role: RoleConfig | None, ctx: zmq.Context) -> KVEventPublisher | None:
    events = cfg.kv_events()
    if events is None or not events.publishes:
        return None
    try:
        token: bytes | None = load_token(token_file=role.token_file if role is not None else None)
    except (ValueError, OSError):
        token = None  # a loopback endpoint needs none; another refuses to start without it
    try:
        return KVEventPublisher(events, rank, token, ctx)
    except ValueError as e:  # a setting refused (one line at start, as the engine's own)
        raise InvalidRequestError(str(e)) from None


def make_role(
    name: str, config: RoleConfig | None, engine: LLMEngine, ctx: zmq.Context, outbox: zmq.Socket
) -> RankRole | None:
    def send(msg: Message) -> None:
        outbox.send(encode(msg))

    if name == "single":
        return None
    if config is None:
        raise ValueError(f"--role {name} needs --role-config")
    if name == "pe":
        from pd.rank.prefill_role import PrefillRole

        return PrefillRole(engine, ctx, send, config)
    if name == "ce":
        from pd.rank.decode_role import DecodeRole

        return DecodeRole(engine, ctx, send, config)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pd.rank.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--inbox", required=True, help="ZeroMQ address the server pushes requests to")
    p.add_argument("--outbox", required=True, help="ZeroMQ address the rank pushes outputs to")
    p.add_argument("--engine-config", required=True, help="the EngineConfig as JSON (engine/codec.py)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel processes: --dp x --tp (every process of every rank)")
    p.add_argument("--ep-address", default=None, help="--ep N: the group's rendezvous (rank 0 hosts it)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel processes of this rank (this one is the first)")
    p.add_argument("--role", choices=("single", "pe", "ce"), default="single")
    p.add_argument("--role-config", default=None, help="pe|ce: the RoleConfig as JSON (engine/codec.py)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="the server's --log-format")
    args = p.parse_args(argv)
    die_with_parent()
    # The server drains on SIGTERM/SIGINT (a terminal's Ctrl-C reaches the whole group) and then tells
    # its ranks to stop: a rank ends on Shutdown, or with its server (PR_SET_PDEATHSIG), not on these.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    install_logging("info", args.log_format, rank=args.rank)
    # the weight load's bar on a terminal names the rank where there are several, as its log lines do
    several = args.dp > 1 or args.tp > 1
    load_progress.configure(f"rank{args.rank}" if several else "", is_bar_allowed=args.log_format == "text")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(args.inbox)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(args.outbox)
    followers: list[subprocess.Popen[bytes]] = []
    serving = False  # past the engine's start: a failure from here on is no refused setting
    try:
        from engine.engine import LLMEngine

        requested, role_config = read_configs(args.engine_config, args.role_config)
        cfg = engine_config(requested, args.rank, args.dp, args.tp)
        tp = ep = None
        if args.ep > 1 and (args.ep != args.dp * args.tp or not args.ep_address):
            raise ValueError("--ep N needs N = --dp x --tp and --ep-address")
        if args.tp > 1 and args.ep > 1:  # one world of every rank's processes (engine/parallel/world.py)
            from engine.parallel.world import join_world

            _, followers = start_followers(requested, args.rank, args.dp, args.tp, args.log_format, args.ep_address)
            tp, ep = join_world(args.rank, args.dp, 0, args.tp, args.ep_address, cfg.torch_device())
        elif args.tp > 1:
            from engine.parallel.tensor_parallel import init_group as init_tp_group

            address, followers = start_followers(requested, args.rank, args.dp, args.tp, args.log_format)
            tp = init_tp_group(0, args.tp, address, cfg.torch_device())
        elif args.ep > 1:
            from engine.parallel.expert_parallel import init_group

            ep = init_group(args.rank, args.ep, args.ep_address, cfg.torch_device())
        t0 = time.monotonic()
        engine = LLMEngine(cfg, tp)
        log.info(
            "engine %s on %s ready in %.1f s (numerics %s)",
            engine.model_name, cfg.device, time.monotonic() - t0, engine.numerics.value,
        )  # fmt: skip
        role = make_role(args.role, role_config, engine, ctx, outbox)
        worker = RankWorker(args.rank, engine, inbox, outbox, role, ep, tp)
        worker.kv_events = kv_event_publisher(cfg, args.rank, role_config, ctx)
        eos = tuple(sorted(engine.eos_token_ids))
        worker.send(
            RankReady(
                args.rank,
                os.getpid(),
                engine.model_name,
                engine.max_model_len,
                eos,
                cfg.device,
                worker.stats(),
            )
        )
        serving = True
        try:
            worker.run()
        finally:
            if role is not None:
                role.close()
            if worker.kv_events is not None:
                worker.kv_events.close()
        engine.close()  # the followers end
        for f in followers:
            f.wait(timeout=30)
    except KeyboardInterrupt:
        return 130
    except BaseException as e:
        if isinstance(e, InvalidRequestError) and not serving:
            # the engine refused a setting as it started (--speculative-config, ...): its message names it,
            # and every rank fails the same way, so one line each, no traceback
            log.error("engine refused its settings: %s", e)
            fatal = f"{type(e).__module__}.{type(e).__name__}: {e}"
        else:
            msg = traceback.format_exc()
            log.error("engine failed:\n%s", msg)
            fatal = msg.strip().splitlines()[-1]
        outbox.send(encode(RankFatal(fatal)))
        outbox.close(linger=2000)
        return 1
    finally:
        inbox.close(linger=0)
        for f in followers:
            if f.poll() is None:
                f.kill()
    outbox.close(linger=2000)
    return 0


if __name__ == "__main__":
    exit_now(main())
