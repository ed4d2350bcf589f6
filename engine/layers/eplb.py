"""Expert rebalancing (EPLB-style) for an expert-parallel group: move experts between ranks so that each
rank's experts see about the same number of tokens.

Off by default (`--eplb-interval 0`). When on, every `eplb_interval` engine steps (the ranks step in
lockstep, so they count alike) every rank of the group, for every MoE layer:

    1. sums the group's per-expert token counts since the last rebalancing (all_reduce of each rank's SparseMoE.take_window);
    2. computes the same new placement as every other rank (balanced_placement: the heaviest expert
       first, each to the least-loaded rank with a free slot; a rank's slots in expert order);
    3. sends the weights (and biases) of its experts that change rank to their new rank and takes the
       ones it gets (one all_to_all per layer), then installs them with the new placement.

Routing never changes (it picks logical experts), only where an expert is computed; with the
batch-invariant expert matmuls of deterministic mode the outputs stay bit-identical. Every rank waits
for the move: the reference found that rebalancing after every prefill stalled all ranks for about
0.3 s under multi-turn traffic, which is why this is never on unless asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.layers.moe import SparseMoE
from engine.parallel.expert_parallel import ExpertGroup


@dataclass
class RebalanceStats:
    num_rebalances: int = 0
    num_experts_moved: int = 0  # expert copies that changed rank, all layers
    seconds: float = 0.0  # wall time this rank spent in rebalancing


def balanced_placement(load: list[int], num_ranks: int, per_rank: int) -> list[int]:
    """Logical expert -> physical slot (slot s on rank s // per_rank), balancing the ranks' summed load:
    experts by load, heaviest first (ties: lower id), each to the least-loaded rank that has a free
    slot (ties: lower rank); within a rank, slots in expert id order. Deterministic."""
    if len(load) != num_ranks * per_rank:
        raise ValueError(f"{len(load)} experts do not fill {num_ranks} ranks of {per_rank}")
    rank_load = [0] * num_ranks
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    for e in sorted(range(len(load)), key=lambda e: (-load[e], e)):
        r = min((r for r in range(num_ranks) if len(held[r]) < per_rank), key=lambda r: (rank_load[r], r))
        held[r].append(e)
        rank_load[r] += load[e]
    placement = [0] * len(load)
    for r, experts in enumerate(held):
        for j, e in enumerate(sorted(experts)):
            placement[e] = r * per_rank + j
    return placement


def rebalance_layer(moe: SparseMoE, ep: ExpertGroup) -> int:
    """One layer: the group's new placement from its loads since the last call, and the weights moved
    to match. Returns how many experts changed rank. Every rank of the group must call it."""
    device = moe.experts.gate_up_proj.device
    placement, _ = moe.counters(device)
    load = ep.sum_(moe.take_window(device).to(ep.comm_device)).tolist()
    per = moe.num_local
    old = placement.tolist()
    new = balanced_placement(load, ep.size, per)
    if new == old:
        return 0
    at_new = {slot: e for e, slot in enumerate(new)}  # physical slot -> logical expert
    mine = range(ep.rank * per, (ep.rank + 1) * per)
    # every stacked expert tensor (weights, gpt-oss's biases, FP8 weights' scales), side by side as bytes (their
    # dtypes differ): [per, expert's bytes]
    parts = [p.data for p in moe.experts.parameters()]
    flat = torch.cat([t.flatten(1).view(torch.uint8) for t in parts], dim=1)
    # what this rank sends: its experts, by destination rank then destination slot
    sends, send_rows = [0] * ep.size, []
    for slot in range(ep.size * per):
        e = at_new[slot]
        if old[e] in mine:
            sends[slot // per] += 1
            send_rows.append(old[e] - ep.rank * per)
    # what it receives: its new slots' experts, by source rank then slot (the senders' order)
    incoming = sorted(mine, key=lambda s: (old[at_new[s]] // per, s))
    recvs = [0] * ep.size
    for s in incoming:
        recvs[old[at_new[s]] // per] += 1
    got = ep.all_to_all(flat[send_rows], sends, recvs)
    moved = torch.empty_like(flat)
    moved[torch.tensor([s - ep.rank * per for s in incoming], device=device)] = got
    for t, cols in zip(parts, moved.split([t[0].numel() * t.element_size() for t in parts], dim=1)):
        t.copy_(cols.contiguous().view(t.dtype).view_as(t))
    placement.copy_(torch.tensor(new, device=placement.device))
    return sum(old[e] // per != new[e] // per for e in range(len(old)))


@torch.inference_mode()  # the counters and weights it updates are inference tensors
def rebalance_model(layers: list[SparseMoE], ep: ExpertGroup, stats: RebalanceStats) -> None:
    """Every MoE layer of a model rebalanced (rebalance_layer), counted in stats."""
    t0 = time.monotonic()
    moved = sum(rebalance_layer(moe, ep) for moe in layers)
    stats.num_rebalances += 1
    stats.num_experts_moved += moved
    stats.seconds += time.monotonic() - t0
