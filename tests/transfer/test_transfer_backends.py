"""NCCL and CUDA IPC transports on the CPU: their bootstrap, framing and ordering, with the NCCL and
CUDA calls replaced by in-process fakes behind the transports' backend seams. Also: the same export
gives the same bytes through every transport."""

from __future__ import annotations

import os
import queue
import threading
import uuid
from collections import defaultdict
from typing import Any

import pytest
import torch

from tests.transfer.support import LAYOUT_SWA, TOKEN, Sink, make_export, receiver
from transfer.config import TransferConfig
from transfer.errors import TRANSPORT, HandoffError
from transfer.ipc import IpcTransport
from transfer.nccl import NcclTransport
from transfer.sender import KVSender
from transfer.tcp import TcpTransport


class _Flag:
    def __init__(self, done: bool = False, sums: list[int] | None = None) -> None:
        self.event = threading.Event()
        self.sums = sums
        if done:
            self.event.set()

    def done(self) -> bool:
        return self.event.is_set()

    def segment_sums(self) -> list[int] | None:
        return self.sums


class LoopbackNccl:
    """Both ranks in one process: init meets at a barrier per unique id; send/recv pair up through a
    FIFO per (communicator, destination rank), as NCCL's in-order point-to-point does."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.barriers: dict[bytes, threading.Barrier] = {}
        self.queues: defaultdict[tuple[bytes, int], queue.Queue] = defaultdict(queue.Queue)
        self.inits: list[tuple[bytes, int]] = []
        self.aborted: list[Any] = []

    def version(self) -> str:
        return "loopback"

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def can_carry(self, t: torch.Tensor) -> bool:
        return True

    def init(self, uid: bytes, rank: int, device: torch.device) -> Any:
        with self.lock:
            barrier = self.barriers.setdefault(uid, threading.Barrier(2))
        barrier.wait(timeout=10)
        with self.lock:
            self.inits.append((uid, rank))
        return (uid, rank)

    def _queue(self, uid: bytes, rank: int) -> queue.Queue:
        with self.lock:
            return self.queues[(uid, rank)]

    def send(self, comm: Any, tensors: list[torch.Tensor], peer: int) -> _Flag:
        self._queue(comm[0], peer).put([t.clone() for t in tensors])
        return _Flag(done=True)

    def recv(self, comm: Any, tensors: list[torch.Tensor], peer: int) -> _Flag:
        flag, q = _Flag(), self._queue(comm[0], comm[1])

        def run() -> None:
            for dst, src in zip(tensors, q.get(timeout=10)):
                dst.copy_(src)
            flag.event.set()

        threading.Thread(target=run, daemon=True).start()
        return flag

    def abort(self, comm: Any) -> None:
        self.aborted.append(comm)


class SameProcessIpc:
    """'Handles' are keys into a dict of this process."""

    def __init__(self) -> None:
        self.shared: dict[str, torch.Tensor] = {}

    def can_carry(self, t: torch.Tensor) -> bool:
        return True

    def export(self, t: torch.Tensor) -> dict[str, Any]:
        key = uuid.uuid4().hex
        self.shared[key] = t
        return {"key": key}

    def open(self, handle: dict[str, Any]) -> torch.Tensor:
        return self.shared.pop(handle["key"])

    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor], after: Any = None) -> _Flag:
        for d, s in zip(dst, src):
            d.copy_(s)
        return _Flag(done=True)  # not hashed on the way: the receiver verifies

    def produced(self, device: torch.device) -> _Flag:
        return _Flag(done=True)


def nccl_config() -> TransferConfig:
    return TransferConfig(
        transport="nccl", idle_timeout_s=10.0, handshake_timeout_s=10.0, send_timeout_s=30.0
    )


async def test_nccl_bootstraps_once_then_reuses_the_communicator() -> None:
    fake = LoopbackNccl()
    sink = Sink("a", "b", "c")
    sender_tr = NcclTransport(nccl_config(), backend=fake)
    sender = KVSender(TOKEN, LAYOUT_SWA, config=nccl_config(), transport=sender_tr)
    exps = [make_export(num_prompt=30 + i, seed=i) for i in range(3)]
    for rid, e in zip("abc", exps):
        e.request_id = rid
    async with receiver(sink, transports={"nccl": NcclTransport(nccl_config(), backend=fake)}) as r:
        for e in exps:
            ack = await sender.send(r.address, e)
            assert ack.transport == "nccl"
    for e in exps:
        got = sink.delivered[e.request_id]
        assert torch.equal(got.pages, e.pages) and got.state is not None and torch.equal(got.state, e.state)
    assert sorted(rank for _, rank in fake.inits) == [0, 1] and len({uid for uid, _ in fake.inits}) == 1
    assert sender_tr.num_inits == 1


async def test_nccl_receiver_restart_is_bootstrapped_again() -> None:
    fake = LoopbackNccl()
    sink = Sink("a", "b")
    sender_tr = NcclTransport(nccl_config(), backend=fake)
    sender = KVSender(TOKEN, LAYOUT_SWA, config=nccl_config(), transport=sender_tr)
    a, b = make_export(seed=1), make_export(seed=2)
    a.request_id, b.request_id = "a", "b"
    async with receiver(sink, transports={"nccl": NcclTransport(nccl_config(), backend=fake)}) as r1:
        await sender.send(r1.address, a)
        port = r1.port
    # a new receiver process on the same address knows nothing of the old communicator
    async with receiver(
        sink, port=port, transports={"nccl": NcclTransport(nccl_config(), backend=fake)}
    ) as r2:
        await sender.send(r2.address, b)
    assert torch.equal(sink.delivered["b"].pages, b.pages)
    assert sender_tr.num_inits == 2 and len({uid for uid, _ in fake.inits}) == 2
    assert len(fake.aborted) >= 1  # the sender dropped the stale communicator


async def test_nccl_without_cupy_fails_clearly() -> None:
    sink = Sink("req-1")
    async with receiver(sink) as r:
        with pytest.raises(HandoffError) as e:
            await KVSender(TOKEN, LAYOUT_SWA, config=nccl_config()).send(r.address, make_export())
    assert e.value.code == TRANSPORT
    assert sink.offered == []


async def test_ipc_round_trip_and_other_host_refused() -> None:
    fake = SameProcessIpc()
    cfg = TransferConfig(transport="ipc", idle_timeout_s=10.0)
    sink = Sink("req-1", "req-2")
    async with receiver(sink, transports={"ipc": IpcTransport(cfg, backend=fake)}) as r:
        exp = make_export()
        ack = await KVSender(TOKEN, LAYOUT_SWA, config=cfg, transport=IpcTransport(cfg, backend=fake)).send(
            r.address, exp
        )
        assert ack.transport == "ipc" and torch.equal(sink.delivered["req-1"].pages, exp.pages)
        elsewhere = IpcTransport(cfg, backend=fake)
        elsewhere._host = "another-machine"
        other = make_export()
        other.request_id = "req-2"
        with pytest.raises(HandoffError) as e:
            await KVSender(TOKEN, LAYOUT_SWA, config=cfg, transport=elsewhere).send(r.address, other)
        assert e.value.code == TRANSPORT and "one host" in e.value.message
    assert "req-2" not in sink.delivered


async def test_receiver_refuses_a_transport_it_does_not_enable() -> None:
    sink = Sink("req-1")
    cfg = TransferConfig(accept_transports=("tcp",))
    async with receiver(sink, config=cfg) as r:
        with pytest.raises(HandoffError) as e:
            sender_cfg = TransferConfig(transport="ipc")
            await KVSender(
                TOKEN,
                LAYOUT_SWA,
                config=sender_cfg,
                transport=IpcTransport(sender_cfg, backend=SameProcessIpc()),
            ).send(r.address, make_export())
    assert e.value.code == TRANSPORT and "not enabled" in e.value.message


async def test_same_bytes_whichever_transport() -> None:
    exp = make_export(num_prompt=77)
    nccl, ipc = LoopbackNccl(), SameProcessIpc()
    made = {
        "tcp": lambda c: TcpTransport(c),
        "nccl": lambda c: NcclTransport(c, backend=nccl),
        "ipc": lambda c: IpcTransport(c, backend=ipc),
    }
    got = {}
    for name, make in made.items():
        cfg = TransferConfig(transport=name, idle_timeout_s=10.0)
        sink = Sink("req-1")
        async with receiver(sink, transports={name: make(cfg)}) as r:
            await KVSender(TOKEN, LAYOUT_SWA, config=cfg, transport=make(cfg)).send(r.address, exp)
        got[name] = sink.delivered["req-1"]
    for name, e in got.items():
        assert torch.equal(e.pages, exp.pages) and e.state is not None and torch.equal(e.state, exp.state), (
            name
        )
