"""The torch.distributed process group of a rank group (expert-parallel, tensor-parallel): made once per
process, before the engine, from a rendezvous address the server gives every rank of the group (a
TCPStore hosted by rank 0). gloo on the CPU, NCCL on CUDA (one GPU per rank: NCCL cannot join two ranks
on one device)."""

from __future__ import annotations

import datetime

import torch

TIMEOUT_S = 600.0  # a collective that waits longer than this fails (a peer hung; a dead one fails at once)


def join_group(rank: int, size: int, address: str, device: torch.device, timeout_s: float = 120.0) -> None:
    """Joins the default process group at address (host:port); rank 0 hosts the store."""
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    store = dist.TCPStore(
        host, int(port), size, is_master=rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=TIMEOUT_S),
        device_id=device if device.type == "cuda" else None,
    )  # fmt: skip


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
