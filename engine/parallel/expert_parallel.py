"""Expert parallelism: the ranks of a `--dp N --ep N` server split every MoE layer's experts, each rank
keeping all of attention and its own requests (attention data-parallel, experts expert-parallel).

A rank holds the experts of its slots, `num_experts / N` consecutive physical slots; `placement` maps
each logical expert (what the router picks) to its slot, the identity until expert rebalancing moves
experts (engine/layers/eplb.py). In every MoE layer of every forward each rank:

    route      its tokens: top-k logical experts and their weights (the router is replicated)
    dispatch   sorts its (token, slot) assignments by the rank that holds the expert, sends the counts
               (all_to_all), then the rows and their local expert ids (all_to_all, uneven splits)
    experts    computes what it received, grouped by local expert, unweighted
    return     sends the results back the way they came (all_to_all)
    combine    weights them and adds each token's k slots in slot order, as a rank of `--ep 1` does

so a token's result is computed by the same arithmetic wherever its experts live: in deterministic
mode (batch-invariant expert matmuls) tokens and logits are bit-identical to `--ep 1`.

Every collective must be entered by every rank in the same order, so the ranks step in lockstep
(pd/rank/worker.py): each loop agrees whether any rank has work (`any`), and if so every rank runs exactly one
forward, a rank with nothing scheduled running an empty one (`LLMEngine.step`: the MoE layers exchange
zero rows). A rank that dies breaks its peers' collectives (gloo sees the closed connection; NCCL
would wait, so the server kills the whole group at once, pd/rank/client.py) and the group is
restarted as one.

torch.distributed carries it (engine/parallel/rank_group.py): gloo on the CPU, NCCL on CUDA. With `--tp N` the
group is every process of every engine rank (`--ep` = `--dp` x N, engine/parallel/world.py): `rank` and `size` are
then the world's, and only each tensor-parallel group's first process takes part in `any`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.parallel.rank_group import join_group, leave_group


@dataclass
class ExpertGroup:
    """This process's place in its expert-parallel group."""

    rank: int
    size: int
    device: torch.device
    group: Any = None  # the torch.distributed process group (None: the default group)
    # the processes that schedule, one per engine rank, which agree in any() whether to step (None: the
    # whole group; under --tp, engine/parallel/world.py: each tensor-parallel group's first process)
    schedulers: Any = None

    def local_experts(self, num_experts: int) -> tuple[int, int]:
        """(first slot, number of slots) of this rank's experts."""
        if num_experts % self.size:
            raise ValueError(f"--ep {self.size} must divide the model's {num_experts} experts")
        per = num_experts // self.size
        return self.rank * per, per

    def any(self, flag: bool) -> bool:
        """Whether any scheduling process's flag is set (a collective: every one of them calls it)."""
        import torch.distributed as dist

        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group if self.schedulers is None else self.schedulers)
        return bool(t.item())

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sums t over the ranks, in place (a collective)."""
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)
        return t

    def exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        """Each rank's number of rows for each other rank -> the numbers this rank receives."""
        import torch.distributed as dist

        send = send_counts.to(torch.int64).to(self.comm_device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return [int(n) for n in recv.tolist()]

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows x[sum(send_counts[:j]):...] go to rank j; returns the rows received, rank by rank."""
        import torch.distributed as dist

        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(
            out,
            x.contiguous(),
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=self.group,
        )
        return out

    @property
    def comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


_current: ExpertGroup | None = None


def current() -> ExpertGroup | None:
    """The process's expert-parallel group, or None (`--ep 1`)."""
    return _current


def init_group(
    rank: int, size: int, address: str, device: torch.device, timeout_s: float = 120.0
) -> ExpertGroup:
    """Joins the group at address (host:port; rank 0 hosts the store), once per process."""
    join_group(rank, size, address, device, timeout_s)
    return adopt(ExpertGroup(rank, size, device))


def adopt(group: ExpertGroup) -> ExpertGroup:
    """Makes group the process's expert-parallel group (its process groups made already: engine/parallel/world.py)."""
    global _current
    if _current is not None:
        raise RuntimeError("this process is in an expert-parallel group already")
    _current = group
    return group


def close_group() -> None:
    global _current
    if _current is not None:
        leave_group()
    _current = None
