"""The process world of `--dp D --tp N --ep D*N`: D engine ranks, each a tensor-parallel group of N
processes (engine/parallel/tensor_parallel.py), and one expert-parallel group of all D*N processes
(engine/parallel/expert_parallel.py), in one torch.distributed world.

    process g*N + t: engine rank g's tensor-parallel process t (t = 0 schedules and samples)

    --dp 2 --tp 2 --ep 4     tensor-parallel groups  {0, 1} {2, 3}   attention heads, dense MLPs, shared
                                                                     experts, the LM head; the plans
                             expert-parallel group   {0, 1, 2, 3}    each process holds E / 4 whole experts
                                                                     of every MoE layer
                             schedulers              {0, 2}          agree each loop whether to step

Attention is data-parallel across the D groups and tensor-parallel inside each; the routed experts are
expert-parallel over every process, each expert held whole by one of them (as vLLM's expert parallelism,
whose EP size is DP x TP, and SGLang's DP attention with its EP size the world's). Inside a tensor-parallel
group every process holds the same hidden state, so process t routes and dispatches only its share of
the group's tokens (engine/layers/moe.py forward_share): each (token, expert) assignment is computed once in
the world, and the group's all-reduce after the block (where `--tp` alone sums the experts' row splits)
adds the shares, one value and zeros, exactly. A token's routed result is therefore the arithmetic of
`--ep`, bit for bit (deterministic mode: batch-invariant).

Lockstep: the schedulers agree whether any has work (ExpertGroup.any over their own group) and then each
runs one engine step; a scheduler with nothing to run has its group run an empty exchange, and every
`--eplb-interval` steps its group rebalances (both announced to the others by plan, LLMEngine.follow), so
every process of the world enters the same MoE exchanges in the same order.

`--ep` here spans every process: other sizes (EP inside a tensor-parallel group, or over some of the
groups) are refused (pd/config.py).
"""

from __future__ import annotations

import torch

from engine.parallel import expert_parallel, tensor_parallel
from engine.parallel.expert_parallel import ExpertGroup
from engine.parallel.rank_group import join_group
from engine.parallel.tensor_parallel import TensorGroup


def join_world(
    dp_rank: int, dp: int, tp_rank: int, tp: int, address: str, device: torch.device, timeout_s: float = 120.0
) -> tuple[TensorGroup, ExpertGroup]:
    """Joins the world at address (host:port; process 0 hosts the store) as engine rank dp_rank's
    tensor-parallel process tp_rank; makes and adopts this process's tensor- and expert-parallel groups."""
    import torch.distributed as dist

    if not (0 <= dp_rank < dp and 0 <= tp_rank < tp):
        raise ValueError(f"process ({dp_rank}, {tp_rank}) is not in a world of --dp {dp} --tp {tp}")
    rank, size = dp_rank * tp + tp_rank, dp * tp
    join_group(rank, size, address, device, timeout_s)
    # NOTE: every process makes every group, in the same order (torch.distributed requires it)
    mine: tuple[object, object] | None = None
    for g in range(dp):
        members = list(range(g * tp, (g + 1) * tp))
        group = dist.new_group(members)
        control = dist.new_group(members, backend="gloo") if device.type == "cuda" else group  # plans: host data
        if g == dp_rank:
            mine = (group, control)
    schedulers = dist.new_group([g * tp for g in range(dp)])
    assert mine is not None
    tp_group = tensor_parallel.adopt(TensorGroup(tp_rank, tp, device, group=mine[0], control=mine[1]))
    ep_group = expert_parallel.adopt(ExpertGroup(rank, size, device, schedulers=schedulers))
    return tp_group, ep_group


def leave_world() -> None:
    tensor_parallel.close_group()
    expert_parallel.close_group()
