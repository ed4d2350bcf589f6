"""`--dp 2 --tp 2 --ep 4` on the CPU: one world of four processes over gloo on loopback (engine/parallel/world.py).
Engine rank 0 is this process (its scheduler) and a spawned follower; engine rank 1 is a spawned
scheduler and its follower. Attention is tensor-parallel inside each pair, the routed experts are split
over all four (two whole experts of eight each), and the two schedulers step in lockstep.

Against a single `--tp 1 --ep 1` engine: greedy tokens identical and logits within 1e-4 (float32), on
both engine ranks, one of them idle for its last steps (its pair then runs empty exchanges). In
deterministic mode a sequence's logits are bit-identical whatever its batch and the other rank's load,
and with expert rebalancing moving experts every two steps.

The world lives for the module; the engines change inside it: each scheduler stops its running engine's
follower (close()), then broadcasts the next engine's config, which the follower builds."""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.parallel.expert_parallel import ExpertGroup
from engine.parallel.tensor_parallel import PLAN_STEP, PLAN_STOP, TensorGroup
from engine.parallel.world import join_world, leave_world
from tests.engine_utils import decode_logits, random_prompts

pytestmark = pytest.mark.slow

DP, TP = 2, 2
BASE = dict(device="cpu", block_size=16, max_num_batched_tokens=64, kv_cache_gb=0.05, max_num_seqs=16, hicache_gb=0.0)
TIMEOUT_S = 600.0
Logits = dict[str, list[torch.Tensor]]


def _follower(dp_rank: int, address: str) -> None:
    """A tensor-parallel process other than its group's first: builds each engine its scheduler announces
    and follows it, until the scheduler says stop."""
    torch.set_num_threads(1)
    tp, _ = join_world(dp_rank, DP, 1, TP, address, torch.device("cpu"))
    try:
        while True:
            kind, config = tp.receive_plan()
            if kind == PLAN_STOP:
                return
            LLMEngine(EngineConfig(**config), tp).follow()
    finally:
        leave_world()


def _peer_channel(ep: ExpertGroup, dp_rank: int) -> TensorGroup:
    """Commands from engine rank 0's scheduler to engine rank 1's, over the schedulers' group (the plan
    broadcast of a TensorGroup on it)."""
    return TensorGroup(dp_rank, DP, torch.device("cpu"), group=ep.schedulers, control=ep.schedulers)


def _switch(tp: TensorGroup, engine: LLMEngine | None, key: Any, config: dict[str, Any]) -> tuple[LLMEngine, Any]:
    """The scheduler's engine for config: the running one, or (its follower told) a new one."""
    if engine is not None and key == config:
        return engine, key
    if engine is not None:
        engine.close()
    tp.send_plan(PLAN_STEP, config)
    return LLMEngine(EngineConfig(**config), tp), config


def _scheduler(address: str, results: Any) -> None:
    """Engine rank 1's scheduler: for each command of rank 0's, generates its prompts in lockstep with it
    and sends back their logits (numpy, per request)."""
    torch.set_num_threads(1)
    tp, ep = join_world(1, DP, 0, TP, address, torch.device("cpu"))
    peer = _peer_channel(ep, 1)
    engine: LLMEngine | None = None
    key: Any = None
    try:
        while True:
            kind, cmd = peer.receive_plan()
            if kind == PLAN_STOP:
                break
            engine, key = _switch(tp, engine, key, cmd["config"])
            got = decode_logits(engine, cmd["prompts"], cmd["max_tokens"], agree=ep.any)
            results.put({rid: torch.stack(rows).numpy() for rid, rows in got.items()})
        if engine is not None:
            engine.close()
        tp.send_plan(PLAN_STOP)
    finally:
        leave_world()


class World:
    """Engine rank 0's scheduler: runs prompts on both engine ranks at once."""

    def __init__(self, tp: TensorGroup, ep: ExpertGroup, results: Any) -> None:
        self.tp, self.ep, self.results = tp, ep, results
        self.peer = _peer_channel(ep, 0)
        self.engine: LLMEngine | None = None
        self.key: Any = None

    def run(
        self, folder: Path, mine: list[list[int]], theirs: list[list[int]], max_tokens: int, their_max_tokens: int,
        **kw: Any,
    ) -> tuple[Logits, Logits]:  # fmt: skip
        """Greedy logits of this rank's prompts and of the other rank's, generated side by side."""
        config = {**BASE, "model": str(folder), **kw}
        self.peer.send_plan(PLAN_STEP, {"config": config, "prompts": theirs, "max_tokens": their_max_tokens})
        self.engine, self.key = _switch(self.tp, self.engine, self.key, config)
        got = decode_logits(self.engine, mine, max_tokens, agree=self.ep.any)
        other = self.results.get(timeout=TIMEOUT_S)
        return got, {rid: list(torch.from_numpy(a)) for rid, a in other.items()}

    def close(self) -> None:
        self.peer.send_plan(PLAN_STOP)
        if self.engine is not None:
            self.engine.close()
        self.tp.send_plan(PLAN_STOP)


# references made before this process joins the world (a process's engines build in its groups)
CASES = {  # family -> (this rank's prompts, the other rank's, their tokens)
    "qwen3_moe": (random_prompts([37, 5, 70], seed=11), random_prompts([20, 50], seed=12), (64, 40)),
    "deepseek_v3": (random_prompts([33, 61], seed=13), random_prompts([8], seed=14), (32, 20)),
    "gpt_oss": (random_prompts([33, 8], seed=15), random_prompts([61], seed=16), (32, 20)),
}


@pytest.fixture(scope="module")
def references(tiny_model_dir) -> dict[str, Logits]:
    """Each case's prompts, all of them, in one `--tp 1 --ep 1` engine: r0, r1, ... this rank's, then the
    other rank's."""
    out = {}
    for family, (mine, theirs, (n, _)) in CASES.items():
        eng = LLMEngine(EngineConfig(**{**BASE, "model": str(tiny_model_dir(family))}))
        out[family] = decode_logits(eng, mine + theirs, n)
    return out


@pytest.fixture(scope="module")
def world(references: dict[str, Logits]) -> Iterator[World]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_follower, args=(0, address), daemon=True),
        ctx.Process(target=_scheduler, args=(address, results), daemon=True),
        ctx.Process(target=_follower, args=(1, address), daemon=True),
    ]
    for p in procs:
        p.start()
    tp, ep = join_world(0, DP, 0, TP, address, torch.device("cpu"))
    w = World(tp, ep, results)
    try:
        yield w
        w.close()
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        leave_world()
        for p in procs:
            if p.is_alive():
                p.kill()


def _assert_matches(ref: list[torch.Tensor], got: list[torch.Tensor], steps: int, rtol: float) -> None:
    assert len(got) == steps
    assert [int(r.argmax()) for r in got] == [int(r.argmax()) for r in ref[:steps]]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_dp2_tp2_ep4_matches_single_engine(world: World, references: dict[str, Logits], tiny_model_dir, family: str) -> None:
    """Both engine ranks' greedy tokens identical to one `--tp 1 --ep 1` engine's, every step's logits
    within 1e-4; the other rank stops early and runs empty exchanges for the rest. Each process holds two
    whole experts (not a tensor-parallel split of each); the rank's stats count each of its tokens once. qwen3_moe: a dense layer between sparse ones;
    deepseek_v3: latent attention split by heads, shared experts split like an MLP beside the routed ones,
    grouped routing; gpt-oss: expert biases (each process adds its experts' whole down bias), attention
    sinks, sliding layers, within 1e-4 + 1e-4 |logit| as at --tp 2 (its own float noise)."""
    mine, theirs, (n, their_n) = CASES[family]
    rtol = 1e-4 if family == "gpt_oss" else 0.0
    folder = tiny_model_dir(family)
    got, other = world.run(folder, mine, theirs, n, their_n)
    ref = references[family]
    for i in range(len(mine)):
        _assert_matches(ref[f"r{i}"], got[f"r{i}"], n, rtol)
    for i in range(len(theirs)):
        _assert_matches(ref[f"r{len(mine) + i}"], other[f"r{i}"], their_n, rtol)
    eng = world.engine
    assert eng is not None and eng.ep is not None and (eng.ep.rank, eng.ep.size) == (0, 4)
    moe = eng.model.sparse_layers()[0]
    assert moe.experts.gate_up_proj.shape[0] == 2  # 8 experts over 4 processes
    assert moe.experts.down_proj.shape[2] == eng.arch.moe.moe_intermediate_size  # each held whole
    assert moe.rows_computed > 0
    # the rank's expert load counts each of its tokens once (k slots), whichever process routed it
    num_tokens = sum(len(p) for p in mine) + len(mine) * (n - 1)
    stats = eng.stats()
    assert [sum(c) for c in stats.moe_tokens_per_expert] == [num_tokens * eng.arch.moe.num_experts_per_tok] * len(
        eng.arch.sparse_layers
    )


def test_deterministic_bit_identical_across_batches_and_rebalancing(world: World, tiny_model_dir) -> None:
    """Deterministic mode: a request's logits at every step are bit-identical alone (the other rank busy),
    among others (the other rank idle), and without expert rebalancing; with it, experts moved."""
    folder = tiny_model_dir("qwen3_moe")
    target, *others = random_prompts([45, 9, 70, 30], seed=5)
    det = dict(is_deterministic=True)
    alone, _ = world.run(folder, [target], others, 16, 24, eplb_interval=2, **det)
    assert world.engine is not None and world.engine.numerics.is_deterministic
    batched, _ = world.run(folder, [others[0], others[1], target], [], 16, 0, eplb_interval=2, **det)
    assert world.engine.eplb.num_rebalances > 0 and world.engine.eplb.num_experts_moved > 0
    plain, _ = world.run(folder, [others[2], target], others[:1], 16, 4, **det)
    assert world.engine.eplb.num_rebalances == 0
    for rows in (batched["r2"], plain["r1"]):
        assert len(rows) == len(alone["r0"]) == 16
        for a, b in zip(alone["r0"], rows):
            assert torch.equal(a, b), (a - b).abs().max()
