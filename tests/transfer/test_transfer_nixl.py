"""The handoff over NIXL (--transport nixl): NIXL's UCX backend writes host tensors one-sided between
two real processes on this machine (UCX's shared-memory and TCP transports), the control connection on
127.0.0.1 as for tcp; and the ways it must fail without delivering anything (bad token, wrong checksum,
a sender killed mid-write). Skipped where the nixl extra is not installed, except the tests of what
happens without it."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.handoff import KVLayout, PoolPages, SequenceExport
from tests.transfer.support import (
    FAST,
    LAYOUT_LATENT,
    LAYOUT_SWA,
    TOKEN,
    PoolSink,
    Sink,
    make_export,
    receiver,
)
from transfer import nixl
from transfer.arena import Arena
from transfer.auth import client_handshake
from transfer.config import NIXL_MODULES, TransferConfig
from transfer.errors import AUTH, CHECKSUM, INCOMPLETE, TIMEOUT, TRANSPORT, HandoffError
from transfer.header import HandoffHeader, allocate_payload, payload_segments
from transfer.messages import ControlMessage, Nack, Offer
from transfer.nixl import EXPORT, LANDING, NixlTransport
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.transport import make_transport
from transfer.wire import Channel

ROOT = Path(__file__).resolve().parents[2]
HAS_NIXL = any(importlib.util.find_spec(m) is not None for m in NIXL_MODULES)
NIXL = dataclasses.replace(FAST, transport="nixl") if HAS_NIXL else None
needs_nixl = pytest.mark.skipif(NIXL is None, reason="the nixl extra (pip install 'pdserve[nixl]') is not installed")


def _run(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
        # PYTHONPATH kept after the repo's: NIXL may be installed there (a --target dir) rather than in site-packages
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip


# ---- without the extra ------------------------------------------------------------------------------


def _hide_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if no NIXL wheel were installed: a None entry in sys.modules is Python's own "not importable"."""
    for m in NIXL_MODULES:  # and what an earlier test imported of it (nixl_cu12._api, ...)
        for name in [m, *(k for k in sys.modules if k.startswith(m + "."))]:
            monkeypatch.setitem(sys.modules, name, None)


def test_transport_nixl_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_nixl(monkeypatch)
    with pytest.raises(ValueError, match=r"pip install 'pdserve\[nixl\]'"):
        TransferConfig(transport="nixl")
    with pytest.raises(HandoffError) as e:
        make_transport("nixl", FAST)
    assert e.value.code == TRANSPORT and "pdserve[nixl]" in e.value.message


async def test_receiver_without_the_extra_refuses_a_nixl_offer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CE that accepts nixl (the default) but lacks the package nacks the offer, naming the extra."""
    from transfer.header import make_header

    _hide_nixl(monkeypatch)
    sink = Sink("req-1")
    async with receiver(sink) as r:
        host, port = r.address.rsplit(":", 1)
        reply = await _raw_nixl_offer(host, int(port), make_header(make_export(), LAYOUT_SWA).encode())
    assert isinstance(reply, Nack) and reply.code == TRANSPORT and "pdserve[nixl]" in reply.reason
    assert sink.offered == [] and sink.delivered == {}  # refused before anything was reserved


async def _raw_nixl_offer(host: str, port: int, header: bytes) -> ControlMessage:
    ch = Channel(socket.create_connection((host, port)), f"{host}:{port}")
    try:
        await client_handshake(ch, TOKEN, "raw-nixl-sender")
        await ch.send(Offer("nixl", header))
        return await ch.recv()
    finally:
        ch.close()


# ---- over NIXL --------------------------------------------------------------------------------------

SENDER = r"""
import asyncio, dataclasses, json, sys
from tests.transfer.support import FAST, LAYOUT_SWA, TOKEN, make_export
from transfer.sender import KVSender

async def main(addr):
    sender = KVSender(TOKEN, LAYOUT_SWA, model="m", config=dataclasses.replace(FAST, transport="nixl"))
    acks = []
    for i, n in enumerate((100, 37, 5)):  # the first connects; the others reuse the connection
        exp = dataclasses.replace(make_export(num_prompt=n, seed=i), request_id=f"r{i}")
        ack = await sender.send(addr, exp)
        acks.append({"id": ack.request_id, "transport": ack.transport, "bytes": ack.payload_bytes, "reused": ack.reused})
    sender.close()
    print(json.dumps(acks), flush=True)

asyncio.run(main(sys.argv[1]))
"""


@needs_nixl
async def test_round_trip_between_two_processes() -> None:
    assert NIXL is not None
    sink = Sink("r0", "r1", "r2")
    async with receiver(sink, model="m", config=NIXL) as r:
        proc = _run(SENDER, r.address)
        out, _ = await asyncio.get_running_loop().run_in_executor(None, proc.communicate, None, 120)
        assert proc.returncode == 0
        assert r._transports["nixl"]._agent._held == {}  # type: ignore[attr-defined]
    acks = json.loads(out.splitlines()[-1])
    assert [a["transport"] for a in acks] == ["nixl"] * 3 and [a["reused"] for a in acks] == [False, True, True]
    for i, n in enumerate((100, 37, 5)):
        exp = make_export(num_prompt=n, seed=i)
        got = sink.delivered[f"r{i}"]
        assert got.state is not None and exp.state is not None
        assert torch.equal(got.pages, exp.pages) and torch.equal(got.state, exp.state)
        assert acks[i]["bytes"] == got.pages.numel() * 4 + got.state.numel() * 4
    assert r.counters["handoffs"] == 3 and sink.errors == []


@needs_nixl
async def test_concurrent_handoffs_bf16() -> None:
    """Writes in flight at once to one receiver agent: each loads its buffers' metadata, the last one
    done drops the remote agent."""
    assert NIXL is not None
    layout = dataclasses.replace(LAYOUT_SWA, dtype=torch.bfloat16)
    exps = [
        dataclasses.replace(make_export(layout, num_prompt=20 + 7 * i, seed=i), request_id=f"r{i}")
        for i in range(4)
    ]
    sink = Sink(*[e.request_id for e in exps])
    async with receiver(sink, layout, config=NIXL) as r:
        sender = KVSender(TOKEN, layout, config=NIXL)
        acks = await asyncio.gather(*[sender.send(r.address, e) for e in exps])
        agent = sender.transport._agent  # type: ignore[attr-defined]
        assert agent._peers == {} and agent._held == {}
        sender.close()
    assert all(a.transport == "nixl" for a in acks)
    for e in exps:
        assert torch.equal(sink.delivered[e.request_id].pages, e.pages)


@needs_nixl
async def test_wrong_or_missing_token_refused() -> None:
    assert NIXL is not None
    sink = Sink("req-1")
    async with receiver(sink, config=NIXL) as r:
        with pytest.raises(HandoffError) as e:
            await KVSender(b"not-the-cluster-token-xyz", LAYOUT_SWA, config=NIXL).send(r.address, make_export())
    assert e.value.code == AUTH and sink.offered == [] and sink.delivered == {}


@needs_nixl
async def test_wrong_checksum_refused() -> None:
    """A header whose checksum does not match what the write delivered: nacked, nothing delivered."""
    assert NIXL is not None
    exp = make_export(LAYOUT_LATENT, num_prompt=40)
    wrong = dataclasses.replace(exp, pages_sum=torch.tensor(12345))  # the header takes the export's sum
    sink = Sink("req-1")
    async with receiver(sink, LAYOUT_LATENT, config=NIXL) as r:
        sender = KVSender(TOKEN, LAYOUT_LATENT, config=NIXL)
        with pytest.raises(HandoffError) as e:
            await sender.send(r.address, wrong)
        assert e.value.code == CHECKSUM
        ack = await sender.send(r.address, exp)  # the same pair still hands off
        sender.close()
    assert [x.code for x in sink.errors] == [CHECKSUM] and ack.transport == "nixl"
    assert torch.equal(sink.delivered["req-1"].pages, exp.pages)


KILLED_SENDER = r"""
import asyncio, socket, sys
from tests.transfer.support import FAST, LAYOUT_SWA, TOKEN, make_export
from transfer.auth import client_handshake
from transfer.header import make_header, payload_segments
from transfer.messages import Offer, Ready
from transfer.nixl import NixlTransport
from transfer.wire import Channel

async def main(port):
    exp = make_export(num_prompt=200)
    transport = NixlTransport(FAST)
    transport.agent()  # started before connecting: the receiver's timeouts run from the offer
    ch = Channel(socket.create_connection(("127.0.0.1", port)), "r")
    await client_handshake(ch, TOKEN, "doomed")
    await ch.send(Offer("nixl", make_header(exp, LAYOUT_SWA).encode()))
    ready = await ch.expect(Ready)
    pages = payload_segments(exp, LAYOUT_SWA)[0]
    first = ready.fields["descs"][0]
    # the pages only (the state never goes), then no `written`: the process dies mid-payload
    transport._write([pages], ("DRAM", 0), ready.fields["agent"], ("DRAM", [tuple(first)]), None)
    print("sent", flush=True)
    await asyncio.sleep(60)

asyncio.run(main(int(sys.argv[1])))
"""


async def _sender_killed_mid_payload(r: KVReceiver, sink: Sink) -> None:
    """KILLED_SENDER against r, killed once it has started its write; returns when sink saw the failure."""
    proc = _run(KILLED_SENDER, str(r.port))
    assert proc.stdout is not None
    line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
    assert line.strip() == b"sent"
    proc.kill()
    proc.wait()
    await asyncio.wait_for(sink.failed.wait(), 10)


@needs_nixl
async def test_sender_process_killed_mid_payload() -> None:
    """The receiver fails the handoff (nothing delivered, on_error told) and holds its registered buffers
    for idle_timeout_s (a write may still land), then releases them."""
    assert NIXL is not None
    config = dataclasses.replace(NIXL, idle_timeout_s=2.0)
    sink = Sink("req-1")
    async with KVReceiver(
        TOKEN, LAYOUT_SWA, sink.on_handoff, sink.on_complete, on_error=sink.on_error, config=config
    ) as r:
        await _sender_killed_mid_payload(r, sink)
        agent = r._transports["nixl"]._agent  # type: ignore[attr-defined]
        assert len(agent._held) == 1
        t0 = time.monotonic()
        while agent._held and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.05)
        assert agent._held == {}
    assert sink.delivered == {} and [e.code for e in sink.errors] == [INCOMPLETE]


DYING_RECEIVER = r"""
import asyncio, dataclasses, os
from tests.transfer.support import FAST, LAYOUT_SWA, TOKEN, Sink, receiver
from transfer.nixl import NixlTransport

class Dying(NixlTransport):
    async def pull(self, ch, header, extra, segments, *, phases=None):
        os._exit(0)  # ready (with the buffers' descriptors) is out; the process dies before the write

async def main():
    config = dataclasses.replace(FAST, transport="nixl")
    async with receiver(Sink("req-1"), config=config, transports={"nixl": Dying(config)}) as r:
        print(r.port, flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


@needs_nixl
async def test_receiver_process_killed_before_the_write() -> None:
    """The sender's write to a receiver that died after ready fails the send (an error, never a hang)
    and the sender keeps no remote agent; its next handoff to a live receiver goes through."""
    assert NIXL is not None
    config = dataclasses.replace(NIXL, idle_timeout_s=5.0)
    proc = _run(DYING_RECEIVER)
    assert proc.stdout is not None
    port = int(await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline))
    sender = KVSender(TOKEN, LAYOUT_SWA, config=config)
    try:
        t0 = time.monotonic()
        with pytest.raises(HandoffError) as e:
            await sender.send(f"127.0.0.1:{port}", make_export(num_prompt=200))
        assert e.value.code in (TRANSPORT, TIMEOUT, INCOMPLETE) and time.monotonic() - t0 < 15, e.value
        agent = sender.transport._agent  # type: ignore[attr-defined]
        assert agent is None or agent._peers == {}
        sink = Sink("req-1")
        async with receiver(sink, config=config) as r:
            await sender.send(r.address, make_export())
        assert "req-1" in sink.delivered
    finally:
        sender.close()
        proc.kill()
        proc.wait()


@needs_nixl
async def test_a_ready_naming_unregistered_memory_is_not_written() -> None:
    """A receiver whose ready names memory outside what it registered: NIXL finds no registration for
    it, the send fails with transport and nothing is written or delivered; the pair still hands off."""
    assert NIXL is not None
    from transfer.nixl import NixlTransport

    class Shifted(NixlTransport):
        shift = True

        async def accept(self, ch, header, extra, segments):  # type: ignore[no-untyped-def]
            reply = await super().accept(ch, header, extra, segments)
            if self.shift:
                addr, nbytes, dev = reply["descs"][0]
                reply["descs"][0] = [addr + nbytes, nbytes, dev]  # just past the pages' buffer
            return reply

    transport = Shifted(NIXL)
    sink = Sink("req-1")
    async with receiver(sink, config=NIXL, transports={"nixl": transport}) as r:
        sender = KVSender(TOKEN, LAYOUT_SWA, config=NIXL)
        with pytest.raises(HandoffError) as e:
            await sender.send(r.address, make_export())
        assert e.value.code == TRANSPORT and "nixl" in e.value.message
        await asyncio.wait_for(sink.failed.wait(), 10)
        transport.shift = False
        await sender.send(r.address, make_export())
        sender.close()
    assert list(sink.delivered) == ["req-1"] and [x.code for x in sink.errors] == [INCOMPLETE]


IDLE_AGENT = r"""
import dataclasses, resource, time
from tests.transfer.support import FAST
from transfer.nixl import NixlTransport

t = NixlTransport(dataclasses.replace(FAST, transport="nixl"))
t.agent()
r0 = resource.getrusage(resource.RUSAGE_SELF)
time.sleep(2.0)
r1 = resource.getrusage(resource.RUSAGE_SELF)
print((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), flush=True)
t.close()
"""


@needs_nixl
def test_an_idle_agent_leaves_the_cpu_alone() -> None:
    """NIXL's progress thread spins a whole core for as long as the agent lives (each rank's, PE and CE):
    the transport runs none, and drives the worker only while a write is expected (the round trips above
    pass without it). A spinning thread shows about 2 s of CPU time over these 2 s, even on busy cores."""
    proc = _run(IDLE_AGENT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert float(out.splitlines()[-1]) < 0.5, out
# ---- memory registered once (the arenas) -------------------------------------------------------------

ARENA_MB = 1  # each end's arena in these tests: LAYOUT_SWA's pages are 4 KiB, so 256 pages fill it
ARENA = dataclasses.replace(NIXL, nixl_arena_mb=ARENA_MB) if NIXL is not None else None


class LandingSink(Sink):
    """A CE stand-in that takes its receive buffers as a decode rank does (the transport's landing
    arena through KVReceiver.receive_buffers, else new ones) and copies what it gets out of them, as an
    import into the KV pool does, so the slices free once the handoff is done."""

    receiver: KVReceiver | None = None

    def on_handoff(self, header: HandoffHeader) -> list[torch.Tensor] | None:
        self.offered.append(header.request_id)
        if header.request_id not in self.expected:
            return None
        assert self.receiver is not None
        got = self.receiver.receive_buffers(header, "cpu")
        return got if got is not None else allocate_payload(header)

    def on_complete(self, header: HandoffHeader, export: SequenceExport) -> None:
        state = None if export.state is None else export.state.clone()
        self.delivered[header.request_id] = dataclasses.replace(export, pages=export.pages.clone(), state=state)

    def on_error(self, header: HandoffHeader, err: HandoffError) -> None:
        # the error without its traceback, whose frames would hold the handoff's buffers (a CE keeps none)
        super().on_error(header, HandoffError(err.code, err.message))


def landing_receiver(sink: LandingSink, config: TransferConfig, layout: KVLayout = LAYOUT_SWA) -> KVReceiver:
    sink.receiver = receiver(sink, layout, config=config)
    return sink.receiver


def in_arena(sender: KVSender, exp: SequenceExport) -> SequenceExport:
    """exp gathered into the sender's export arena, as the engine's export does with its alloc (a
    payload that does not fit keeps its own tensors)."""
    alloc = sender.export_allocator
    assert alloc is not None

    def moved(t: torch.Tensor) -> torch.Tensor:
        slot = alloc(tuple(t.shape), t.dtype, t.device)
        return t if slot is None else slot.copy_(t)

    return dataclasses.replace(exp, pages=moved(exp.pages), state=None if exp.state is None else moved(exp.state))


async def _drained(arena: Arena, timeout_s: float = 5.0) -> bool:
    """Whether arena's slices are all free within timeout_s, without a gc pass (the receiver drops its
    buffers as its handoff's coroutine ends, the sender's write thread its segments as its work item
    ends: either may be just after the sender has the ack)."""
    t0 = time.monotonic()
    while arena.num_used_bytes and time.monotonic() - t0 < timeout_s:
        await asyncio.sleep(0.01)
    return arena.num_used_bytes == 0


def _nixl_of(r: KVReceiver) -> NixlTransport:
    tr = r.transports["nixl"]
    assert isinstance(tr, NixlTransport)
    return tr


@needs_nixl
async def test_handoffs_in_a_row_register_memory_once_per_end() -> None:
    """Each end registers its arena on its first handoff and nothing after; the sender loads the
    receiver's metadata once; every payload arrives byte for byte and the slices free after each."""
    assert ARENA is not None
    exps = [dataclasses.replace(make_export(num_prompt=n, seed=n), request_id=f"r{n}") for n in (100, 37, 5, 400)]
    sink = LandingSink(*[e.request_id for e in exps])
    async with landing_receiver(sink, ARENA) as r:
        sender = KVSender(TOKEN, LAYOUT_SWA, config=ARENA)
        try:
            for e in exps:
                ex = in_arena(sender, e)
                arena = sender.transport.arena(EXPORT)  # type: ignore[attr-defined]
                assert arena is not None and arena.holds(payload_segments(ex, LAYOUT_SWA))
                ack = await sender.send(r.address, ex)
                del ex
                assert ack.transport == "nixl"
            sent = dict(sender.transport.counters)  # type: ignore[attr-defined]
            agent = sender.transport._agent  # type: ignore[attr-defined]
            assert agent._peers == {} and agent.num_remote_agents == 1  # kept, none in flight
        finally:
            sender.close()
        got = dict(_nixl_of(r).counters)
        landing = _nixl_of(r).arena(LANDING)
        assert landing is not None and await _drained(landing)  # the last handoff's slices are free again
        # NOTE: the write's worker thread lets go of its segments just after it sets the result the
        # ack waits for, so the sender's slice may still be held for a moment after send returns
        assert await _drained(arena)
    assert sent["registrations"] == 1 and sent["arena_writes"] == 4 and sent["registered_writes"] == 0
    assert sent["metadata_loads"] == 1 and sent["metadata_reuses"] == 3
    assert got["registrations"] == 1 and got["arena_receives"] == 4 and got["registered_receives"] == 0
    for e in exps:
        d = sink.delivered[e.request_id]
        assert d.state is not None and e.state is not None
        assert torch.equal(d.pages, e.pages) and torch.equal(d.state, e.state)


@needs_nixl
async def test_a_payload_larger_than_the_arena_registers_its_own_memory() -> None:
    """Over the arena's size: both ends register the payload for its handoff (and the sender drops
    what it loaded of that registration), the bytes arrive identical; the next small one goes through
    the arenas again."""
    assert ARENA is not None
    big = dataclasses.replace(make_export(num_prompt=300 * 16, seed=3), request_id="big")  # 300 pages, 1.2 MiB
    small = dataclasses.replace(make_export(num_prompt=40, seed=4), request_id="small")
    assert big.pages.numel() * 4 > ARENA_MB << 20
    sink = LandingSink("big", "small")
    async with landing_receiver(sink, ARENA) as r:
        sender = KVSender(TOKEN, LAYOUT_SWA, config=ARENA)
        try:
            ex = in_arena(sender, big)
            assert ex.pages is big.pages  # did not fit: its own tensor
            await sender.send(r.address, ex)
            agent = sender.transport._agent  # type: ignore[attr-defined]
            assert agent.num_remote_agents == 0  # a registration of one handoff is not kept loaded
            await sender.send(r.address, in_arena(sender, small))
            sent = dict(sender.transport.counters)  # type: ignore[attr-defined]
        finally:
            sender.close()
        got = dict(_nixl_of(r).counters)
    assert (sent["registered_writes"], sent["arena_writes"], sent["registrations"]) == (1, 1, 2)
    assert (sent["metadata_loads"], sent["metadata_reuses"]) == (2, 0)
    assert (got["registered_receives"], got["arena_receives"], got["registrations"]) == (1, 1, 2)
    for e in (big, small):
        d = sink.delivered[e.request_id]
        assert d.state is not None and e.state is not None
        assert torch.equal(d.pages, e.pages) and torch.equal(d.state, e.state)


@needs_nixl
async def test_a_failed_write_keeps_the_landing_slices_until_the_hold_expires() -> None:
    """A sender that dies after writing part of the payload: the receiver fails the handoff, and the
    arena slices it gave stay out of the free list for idle_timeout_s (a late write may still land
    there), then are free again."""
    assert ARENA is not None
    config = dataclasses.replace(ARENA, idle_timeout_s=3.0)
    sink = LandingSink("req-1")
    async with landing_receiver(sink, config) as r:
        await _sender_killed_mid_payload(r, sink)
        t_failed = time.monotonic()  # the hold began just before
        tr = _nixl_of(r)
        landing = tr.arena(LANDING)
        assert landing is not None and tr.counters["arena_receives"] == 1
        gc.collect()
        assert landing.num_used_bytes > 0
        while landing.num_used_bytes and time.monotonic() - t_failed < 15:
            await asyncio.sleep(0.2)
            gc.collect()  # the failed handoff's frames and its error's traceback form cycles
        held_s = time.monotonic() - t_failed
        assert landing.num_used_bytes == 0 and held_s >= 2.0, held_s  # about idle_timeout_s
        assert tr._agent is not None and tr._agent._held == {}
    assert sink.delivered == {} and [e.code for e in sink.errors] == [INCOMPLETE]


@needs_nixl
async def test_a_receiver_restarted_with_a_new_agent_still_receives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver that restarts on the same port has a new agent (and metadata): the sender loads it,
    the handoff arrives, and the old agent is dropped past the bound on remote agents kept."""
    assert ARENA is not None
    monkeypatch.setattr(nixl, "MAX_REMOTE_AGENTS", 1)
    sender = KVSender(TOKEN, LAYOUT_SWA, config=ARENA)
    names = []
    try:
        port = 0
        for i in range(2):
            exp = dataclasses.replace(make_export(num_prompt=60 + i, seed=i), request_id=f"r{i}")
            sink = LandingSink(exp.request_id)
            r = landing_receiver(sink, ARENA)
            r.port = port
            async with r:
                port = r.port
                await sender.send(r.address, in_arena(sender, exp))
                agent = _nixl_of(r)._agent
                assert agent is not None
                names.append(agent.name)
            got = sink.delivered[exp.request_id]
            assert got.state is not None and exp.state is not None
            assert torch.equal(got.pages, exp.pages) and torch.equal(got.state, exp.state)
        counters = dict(sender.transport.counters)  # type: ignore[attr-defined]
        agent = sender.transport._agent  # type: ignore[attr-defined]
        assert list(agent._remotes.values()) == [names[1]] and agent.num_remote_agents == 1
    finally:
        sender.close()
    assert names[0] != names[1] and counters["metadata_loads"] == 2 and counters["arena_writes"] == 2


@needs_nixl
async def test_engine_export_gathers_into_the_nixl_arena(tiny_model_dir: Callable[[str], Path]) -> None:
    """The engine's export with the sender's allocator (as the prefill role passes it) lands in the
    registered arena and goes from its registration, bit for bit what a plain export holds."""
    from engine.request import SamplingParams
    from tests.engine_utils import small_engine

    assert ARENA is not None
    eng = small_engine(tiny_model_dir("qwen3_hybrid"), hicache_gb=0)
    eng.add_request("r", list(range(3, 44)), SamplingParams(max_tokens=4, ignore_eos=True), use_prefix_cache=False)
    seq = eng.scheduler.find("r")
    assert seq is not None
    while not seq.output_token_ids:
        eng.step()
    layout = eng.handoff_layout
    plain = eng.export_sequence("r", device=None)
    sender = KVSender(TOKEN, layout, config=ARENA)
    sink = LandingSink("r")
    try:
        ex = eng.export_sequence("r", device=None, alloc=sender.export_allocator)
        arena = sender.transport.arena(EXPORT)  # type: ignore[attr-defined]
        assert arena is not None and arena.holds(payload_segments(ex, layout))
        async with landing_receiver(sink, ARENA, layout=layout) as r:
            await sender.send(r.address, ex)
            assert _nixl_of(r).counters["arena_receives"] == 1
        del ex
        assert await _drained(arena)  # freed once the sender's last reference goes, maybe just after the ack
        assert sender.transport.counters["arena_writes"] == 1  # type: ignore[attr-defined]
    finally:
        sender.close()
    got = sink.delivered["r"]
    assert got.state is not None and plain.state is not None
    # page slots past the last token hold whatever the pool had there: bits, not values
    assert torch.equal(got.pages.view(torch.uint8), plain.pages.view(torch.uint8))
    assert torch.equal(got.state.view(torch.uint8), plain.state.view(torch.uint8))


# ---- in place: the payload written straight into scattered pages of the receiver's KV pool -------------


@needs_nixl
@pytest.mark.parametrize("streamed", [False, True])
async def test_a_handoff_lands_in_place_in_scattered_pages_of_the_pool(streamed: bool) -> None:
    """Every page at its block, out of order and in runs of one and more, the state in its slot: the
    delivered export names those pages (PoolPages) and the receiver verified them where they lie."""
    from tests.transfer.test_transfer_stream import NUM_PROMPT, stream_in_parts

    assert NIXL is not None
    exp = make_export(num_prompt=NUM_PROMPT)  # 8 pages
    blocks = [9, 3, 4, 5, 14, 0, 1, 7]
    sink = PoolSink(LAYOUT_SWA, blocks, "req-1")
    async with receiver(sink, config=NIXL) as r:
        sink.receiver = r
        sender = KVSender(TOKEN, LAYOUT_SWA, config=NIXL)
        try:
            ack = await (stream_in_parts(sender, r.address, exp, [2, 5]) if streamed else sender.send(r.address, exp))
        finally:
            sender.close()
        nixl_tr = _nixl_of(r)
    got = sink.delivered["req-1"]
    assert isinstance(got.pages, PoolPages) and got.pages.block_ids == tuple(blocks)
    assert torch.equal(sink.pages[blocks], exp.pages) and torch.equal(sink.swa[1], exp.state)
    assert got.state is not None and got.state.data_ptr() == sink.swa[1].data_ptr()
    untouched = [b for b in range(16) if b not in blocks]
    assert not sink.pages[untouched].any() and not sink.swa[[0, 2]].any()
    assert ack.num_streamed_pages == (5 if streamed else 0) and not sink.errors
    assert nixl_tr.counters["in_place_receives"] == 1 and nixl_tr.counters["arena_receives"] == 0
    assert nixl_tr.counters["registrations"] == 1  # the pool, once


@needs_nixl
async def test_a_corrupt_payload_in_place_is_refused() -> None:
    """The checksum read from the pool's pages catches a payload that does not match its header's (the
    sender's sum is the wrong one here); nothing is delivered, and the same pair hands off after."""
    assert NIXL is not None
    exp = make_export()
    wrong = dataclasses.replace(exp, pages_sum=torch.tensor(12345))  # the header takes the export's sum
    sink = PoolSink(LAYOUT_SWA, [6, 2, 3], "req-1")
    async with receiver(sink, config=NIXL) as r:
        sink.receiver = r
        sender = KVSender(TOKEN, LAYOUT_SWA, config=NIXL)
        try:
            with pytest.raises(HandoffError) as e:
                await sender.send(r.address, wrong)
            ack = await sender.send(r.address, exp)
        finally:
            sender.close()
    assert e.value.code == CHECKSUM and [x.code for x in sink.errors] == [CHECKSUM]
    assert ack.transport == "nixl" and torch.equal(sink.pages[[6, 2, 3]], exp.pages)


@needs_nixl
async def test_copy_in_lands_in_the_arena_instead() -> None:
    """--nixl-copy-in: the pool is never registered; the payload lands in the landing arena, the pool
    untouched (the import copies it there)."""
    assert NIXL is not None
    exp = make_export()
    sink = PoolSink(LAYOUT_SWA, [6, 2, 3], "req-1")
    config = dataclasses.replace(NIXL, nixl_copy_in=True)
    async with receiver(sink, config=config) as r:
        sink.receiver = r
        sender = KVSender(TOKEN, LAYOUT_SWA, config=config)
        try:
            await sender.send(r.address, exp)
        finally:
            sender.close()
        tr = _nixl_of(r)
    got = sink.delivered["req-1"]
    assert isinstance(got.pages, torch.Tensor) and torch.equal(got.pages, exp.pages)
    assert not sink.pages.any() and tr._pool is None
    assert tr.counters["in_place_receives"] == 0 and tr.counters["arena_receives"] == 1
