"""The ipc transport's export arena on the CPU, with an in-process fake of CUDA IPC: the allocator, the
offer's format, the receiver's cache of opened arenas (hits, eviction), the fallback to per-tensor
handles, slices freed after an ack and after a failure, the checksum from the copy (and a corrupt
copy refused); also the export's recorded pages sum in the header, and the sender's phase timings.
Pages in place: an export naming its pages in the sender's pool (exported once) copied straight into
the receiver's reservation pages, malformed page lists refused, and the other transports gathering them."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.handoff import KVLayout, PoolPages, SequenceExport
from pdkernels.checksum_gpu import Paged, Segment, torch_copy
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
from transfer import ipc
from transfer.arena import ALIGN
from transfer.checksum import as_words, segment_sum
from transfer.config import TransferConfig
from transfer.errors import CHECKSUM, PROTOCOL, TIMEOUT, TRANSPORT, UNEXPECTED, HandoffError
from transfer.header import IDS_INLINE_MAX, make_header, payload_segments
from transfer.ipc import ExportArena, IpcTransport
from transfer.sender import KVSender

CPU = torch.device("cpu")
ARENA_BYTES = 1 << 20  # a few exports of make_export's size (~10 KiB each)


class _Copy:
    def __init__(self, sums: list[int] | None) -> None:
        self.sums = sums

    def done(self) -> bool:
        return True

    def segment_sums(self) -> list[int] | None:
        return self.sums


def _flat(t: Segment) -> torch.Tensor:
    return t.pages()[t.ids].reshape(-1) if isinstance(t, Paged) else t


class FakeEvent:
    def __init__(self) -> None:
        self.records = 0


class _Pending:
    """produced() of an export that is never written: a sender that waits for it times out."""

    def done(self) -> bool:
        return False

    def segment_sums(self) -> list[int] | None:
        return None


class FakeIpc:
    """'Handles' are keys into a dict shared by both ends (one process). Counts opens; copies hash
    their destination (as the fused kernel does) unless hash is False; corrupt flips a copied byte.
    events: the arena's interprocess event (recorded per offer, opened by the receiver, waited for
    by its copy: copies keep the event they were given); without it, produced() is done only if
    written is True."""

    def __init__(self, hash: bool = True, events: bool = True, written: bool = True) -> None:
        self.shared: dict[str, Any] = {}
        self.opens: list[str] = []
        self.event_opens: list[str] = []
        self.waited: list[Any] = []  # each copy's event
        self.offers: list[dict[str, Any]] = []
        self.hash = hash
        self.events = events
        self.written = written
        self.corrupt = False
        self.lock = threading.Lock()

    def can_carry(self, t: torch.Tensor) -> bool:
        return True

    def export(self, t: torch.Tensor) -> dict[str, Any]:
        key = uuid.uuid4().hex
        self.shared[key] = t
        return {"key": key}

    def open(self, handle: dict[str, Any]) -> torch.Tensor:
        with self.lock:
            self.opens.append(handle["key"])
        return self.shared[handle["key"]]

    def copy(self, dst: list[Segment], src: list[Segment], after: Any = None) -> _Copy:
        self.waited.append(after)
        for d, s in zip(dst, src):
            torch_copy(d, s)
        first = dst[0]
        if self.corrupt:
            if isinstance(first, Paged):
                first.pages()[first.ids[0], 3] ^= 0x10
            else:
                first[3] ^= 0x10
        return _Copy([segment_sum(as_words(_flat(d))) for d in dst] if self.hash else None)

    def produced(self, device: torch.device) -> _Copy | _Pending:
        return _Copy(None) if self.written else _Pending()

    def export_event(self, device: torch.device) -> tuple[FakeEvent, dict[str, Any]]:
        if not self.events:
            raise RuntimeError("no interprocess events here")
        event = FakeEvent()
        return event, self.export(event)  # type: ignore[arg-type]

    def record(self, event: FakeEvent, device: torch.device) -> None:
        event.records += 1

    def open_event(self, handle: dict[str, Any]) -> FakeEvent:
        with self.lock:
            self.event_opens.append(handle["key"])
        return self.shared[handle["key"]]  # type: ignore[no-any-return]


class RecordingIpc(IpcTransport):
    """Keeps the offers it makes (the sender's extra fields)."""

    async def offer(self, ch: Any, segments: list[torch.Tensor]) -> dict[str, Any]:
        extra = await super().offer(ch, segments)
        self.offers = [*getattr(self, "offers", []), extra]
        return extra


def config(arena_bytes: int = ARENA_BYTES) -> TransferConfig:
    return TransferConfig(
        transport="ipc",
        idle_timeout_s=10.0,
        handshake_timeout_s=10.0,
        send_timeout_s=20.0,
        ipc_arena_gb=arena_bytes / 2**30,
    )


async def freed(arena: ExportArena, timeout_s: float = 5.0) -> bool:
    """Whether arena's slices are all free within timeout_s, collecting as it waits: a worker thread
    (the checksum read, a copy) lets go of its arguments just after it sets the result a send waits
    for, so the last slice may still be held for a moment after the send returns or fails."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        gc.collect()
        if arena.num_used_bytes == 0 or loop.time() > deadline:
            return arena.num_used_bytes == 0
        await asyncio.sleep(0.01)


def in_arena(tr: IpcTransport, exp: SequenceExport, rid: str) -> SequenceExport:
    """The export as the PE makes it for ipc: its tensors gathered into arena slices."""
    pages = tr.allocate(tuple(exp.pages.shape), exp.pages.dtype, CPU)
    assert pages is not None
    pages.copy_(exp.pages)
    state = None
    if exp.state is not None:
        state = tr.allocate(tuple(exp.state.shape), exp.state.dtype, CPU)
        assert state is not None
        state.copy_(exp.state)
    return dataclasses.replace(exp, request_id=rid, pages=pages, state=state)


async def refused(
    fake: FakeIpc,
    sender_tr: IpcTransport | None = None,
    cfg: TransferConfig | None = None,
    change: Callable[[SequenceExport], None] | None = None,
) -> tuple[HandoffError, Sink]:
    """A handoff of "req-1", gathered into the sender's arena (change: then altered), that must fail:
    the sender's error, and the receiver's sink."""
    cfg = cfg or config()
    sender_tr = sender_tr or IpcTransport(cfg, fake)
    sink = Sink("req-1")
    ex = in_arena(sender_tr, make_export(), "req-1")
    if change is not None:
        change(ex)
    async with receiver(sink, transports={"ipc": IpcTransport(cfg, fake)}) as r:
        with pytest.raises(HandoffError) as e:
            await KVSender(TOKEN, LAYOUT_SWA, config=cfg, transport=sender_tr).send(r.address, ex)
    return e.value, sink


# ---- the allocator ----------------------------------------------------------------------------


def test_arena_first_fit_alignment_coalescing_and_offsets() -> None:
    arena = ExportArena(torch.zeros(8 * ALIGN, dtype=torch.uint8), {"key": "k"})
    a = arena.alloc((ALIGN // 4,), torch.float32)  # exactly one slot
    b = arena.alloc((3, 5), torch.bfloat16)  # 30 bytes: rounded up to one slot
    c = arena.alloc((2 * ALIGN,), torch.uint8)
    assert a is not None and b is not None and c is not None
    assert [arena.offset_of(t) for t in (a, b, c)] == [0, ALIGN, 2 * ALIGN]
    assert arena.num_used_bytes == 4 * ALIGN
    assert arena.alloc((5 * ALIGN,), torch.uint8) is None  # 4 slots left
    assert arena.offset_of(torch.zeros(4)) is None  # not in the arena
    assert arena.offset_of(a[1:]) == 4  # a contiguous part of a live slice
    del a
    gc.collect()
    assert arena.num_used_bytes == 3 * ALIGN
    assert arena.offset_of(arena.buf[:16]) is None  # in the arena, but freed
    d = arena.alloc((ALIGN,), torch.uint8)  # first fit: the hole a left
    assert d is not None and arena.offset_of(d) == 0
    del b, c, d
    gc.collect()
    assert arena.num_used_bytes == 0
    whole = arena.alloc((8 * ALIGN,), torch.uint8)  # the holes coalesced again
    assert whole is not None and arena.alloc((1,), torch.uint8) is None
    assert arena.alloc((0, 4), torch.float32) is None  # nothing to place


def test_export_allocator_only_for_ipc_with_an_arena() -> None:
    ipc_sender = KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=IpcTransport(config(), FakeIpc()))
    assert ipc_sender.export_allocator is not None
    no_arena = config(0)
    assert (
        KVSender(
            TOKEN, LAYOUT_SWA, config=no_arena, transport=IpcTransport(no_arena, FakeIpc())
        ).export_allocator
        is None
    )
    assert KVSender(TOKEN, LAYOUT_SWA, config=TransferConfig()).export_allocator is None
    with pytest.raises(ValueError):
        TransferConfig(ipc_arena_gb=-1)


# ---- handoffs through the arena -----------------------------------------------------------------


async def test_arena_offer_cache_hit_and_slices_freed_after_ack() -> None:
    fake = FakeIpc()
    sender_tr = RecordingIpc(config(), fake)
    recv_tr = IpcTransport(config(), fake)
    sink = Sink("a", "b")
    sender = KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=sender_tr)
    a, b = make_export(seed=1), make_export(num_prompt=IDS_INLINE_MAX + 20, seed=2)  # b: its ids follow the offer
    async with receiver(sink, transports={"ipc": recv_tr}) as r:
        for rid, exp in (("a", a), ("b", b)):
            ex = in_arena(sender_tr, exp, rid)
            ack = await sender.send(r.address, ex)
            assert ack.verify_s < 0.05  # hashed on the way: no verify pass to speak of
            del ex
    arena = sender_tr.arena
    assert arena is not None
    for extra in sender_tr.offers:  # (arena id, handle, offsets), no per-tensor handles
        assert set(extra) == {"host", "arena", "offsets"} and extra["arena"]["id"] == arena.id
        assert extra["arena"]["event"] == arena.event_handle and arena.event_handle is not None
        assert extra["arena"]["nbytes"] == ARENA_BYTES and all(o % ALIGN == 0 for o in extra["offsets"])
    assert fake.opens == [arena.handle["key"]]  # opened once, then a cache hit
    assert recv_tr.counters["arena_opens"] == 1 and recv_tr.counters["arena_hits"] == 1
    for rid, exp in (("a", a), ("b", b)):
        got = sink.delivered[rid]
        assert (
            torch.equal(got.pages, exp.pages) and got.state is not None and torch.equal(got.state, exp.state)
        )
    assert await freed(arena)  # the exports are gone: their slices are free


async def test_receiver_keeps_a_few_arenas_and_drops_the_oldest() -> None:
    fake = FakeIpc()
    recv_tr = IpcTransport(config(), fake)
    n = ipc.MAX_OPEN_ARENAS + 1
    senders = [IpcTransport(config(), fake) for _ in range(n)]
    rids = [f"r{i}" for i in range(n + 1)]
    sink = Sink(*rids)
    exp = make_export()
    kv_senders = [KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=tr) for tr in senders]  # alive: connected
    async with receiver(sink, transports={"ipc": recv_tr}) as r:
        for rid, i in zip(rids, [*range(n), 0]):  # the first sender again, after eviction
            await kv_senders[i].send(r.address, in_arena(senders[i], exp, rid))
        kept = {arena_id for _, arena_id in recv_tr._opened}
    assert len(kept) == ipc.MAX_OPEN_ARENAS and not recv_tr._opened  # closing drops them all
    assert recv_tr.counters["arena_opens"] == n + 1 and recv_tr.counters["arena_hits"] == 0
    assert senders[1].arena is not None and senders[1].arena.id not in kept  # the least recently used
    assert senders[0].arena is not None and senders[0].arena.id in kept
    assert all(torch.equal(sink.delivered[rid].pages, exp.pages) for rid in rids)


async def test_a_senders_mappings_go_when_its_connections_close() -> None:
    """The receiver keeps a sender's pool (and arena) mapped while a connection that used it is open: when
    the sender's connections close (it died, or they idled out) the mappings go (an imported mapping
    holds the exporter's GPU memory even after the exporter exits), and its next handoff opens them again."""
    fake = FakeIpc()
    sender_tr, recv_tr = IpcTransport(config(), fake), IpcTransport(config(), fake)
    sink = PoolSink(LAYOUT_SWA, [1, 2, 3, 4], *(f"r{i}" for i in range(4)))
    pool = a_pool(LAYOUT_SWA)
    exp = make_export(num_prompt=60)

    async def released(count: int) -> None:
        for _ in range(200):  # the receiver sees the connection end on its own loop turn (bounded wait)
            if recv_tr.counters["released"] >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"released {recv_tr.counters['released']}, want {count}")

    async with receiver(sink, config=config(), transports={"ipc": recv_tr}) as r:
        sink.receiver = r
        first = KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=sender_tr)
        for rid in ("r0", "r1"):  # one kept connection: the pool and the arena opened once
            await first.send(r.address, dataclasses.replace(in_pool(exp, LAYOUT_SWA, [7, 0, 3, 12], sender_tr, pool), request_id=rid))
        assert recv_tr.counters["pool_opens"] == 1 and recv_tr.counters["arena_opens"] == 1 and len(recv_tr._opened) == 2
        first.close()  # its connections end (as a PE's do when it dies)
        await released(2)
        assert not recv_tr._opened and not recv_tr._users
        second = KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=sender_tr)
        for rid in ("r2", "r3"):
            await second.send(r.address, dataclasses.replace(in_pool(exp, LAYOUT_SWA, [7, 0, 3, 12], sender_tr, pool), request_id=rid))
        assert recv_tr.counters["pool_opens"] == 2 and recv_tr.counters["pool_hits"] == 2 and len(recv_tr._opened) == 2
        second.close()
        await released(4)
    assert all(torch.equal(sink.delivered[f"r{i}"].pages.gather(), exp.pages) for i in range(4))


async def test_payload_larger_than_the_arena_goes_with_per_tensor_handles() -> None:
    fake = FakeIpc(hash=False)  # and the receiver verifies the copy itself
    small = config(ALIGN)
    sender_tr = RecordingIpc(small, fake)
    exp = make_export(num_prompt=60)
    assert sender_tr.allocate(tuple(exp.pages.shape), exp.pages.dtype, CPU) is None  # does not fit
    sink = Sink("req-1")
    async with receiver(sink, transports={"ipc": IpcTransport(small, fake)}) as r:
        await KVSender(TOKEN, LAYOUT_SWA, config=small, transport=sender_tr).send(r.address, exp)
    (extra,) = sender_tr.offers
    assert set(extra) == {"host", "handles"} and len(extra["handles"]) == 2
    assert torch.equal(sink.delivered["req-1"].pages, exp.pages)


async def test_slices_freed_after_a_failed_handoff() -> None:
    fake = FakeIpc()
    sender_tr = IpcTransport(config(), fake)
    sink = Sink()  # expects nothing: the offer is refused
    async with receiver(sink, transports={"ipc": IpcTransport(config(), fake)}) as r:
        ex = in_arena(sender_tr, make_export(), "nobody")
        with pytest.raises(HandoffError) as e:
            await KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=sender_tr).send(r.address, ex)
        assert e.value.code == UNEXPECTED
        assert sender_tr.arena is not None and sender_tr.arena.num_used_bytes > 0
        del ex, e  # the error's traceback holds the send's frames, and so the export
        assert await freed(sender_tr.arena)


@pytest.mark.parametrize("hash", [True, False])
async def test_a_corrupt_copy_is_refused(hash: bool) -> None:
    fake = FakeIpc(hash=hash)
    fake.corrupt = True
    err, sink = await refused(fake)
    assert err.code == CHECKSUM and "req-1" not in sink.delivered and sink.errors


async def test_offsets_outside_the_arena_are_refused() -> None:
    fake = FakeIpc()

    class Lying(IpcTransport):
        async def offer(self, ch: Any, segments: list[torch.Tensor]) -> dict[str, Any]:
            extra = await super().offer(ch, segments)
            extra["offsets"][-1] = extra["arena"]["nbytes"] - 8
            return extra

    err, _ = await refused(fake, Lying(config(), fake))
    assert err.code == TRANSPORT and "malformed" in err.message
    assert fake.opens == []


def test_engine_export_gathers_into_the_arena(tiny_model_dir) -> None:
    from engine.request import SamplingParams
    from tests.engine_utils import small_engine

    eng = small_engine(tiny_model_dir("qwen3_hybrid"), hicache_gb=0)
    tr = IpcTransport(config(), FakeIpc())
    eng.add_request(
        "r", list(range(3, 44)), SamplingParams(max_tokens=4, ignore_eos=True), use_prefix_cache=False
    )
    seq = eng.scheduler.find("r")
    assert seq is not None
    while not seq.output_token_ids:
        eng.step()
    plain = eng.export_sequence("r", device=None)
    ex = eng.export_sequence("r", device=None, alloc=tr.allocate)
    arena = tr.arena
    assert arena is not None and arena.offset_of(ex.pages) is not None
    assert ex.state is not None and arena.offset_of(ex.state) is not None
    # Page slots past the sequence's last token hold whatever the pool had there (possibly NaN bit
    # patterns), so compare bits, not values.
    assert plain.state is not None
    assert torch.equal(ex.pages.view(torch.uint8), plain.pages.view(torch.uint8))
    assert torch.equal(ex.state.view(torch.uint8), plain.state.view(torch.uint8))
    assert ex.pages_sum is None  # CPU: hashed by the sender, as before
    del ex
    gc.collect()
    assert arena.num_used_bytes == 0


# ---- header and timings ---------------------------------------------------------------------------


def test_make_header_takes_the_recorded_pages_sum() -> None:
    exp = make_export()
    want = make_header(exp, LAYOUT_SWA).checksum
    pages = payload_segments(exp, LAYOUT_SWA)[0]
    exp.pages_sum = torch.tensor(segment_sum(as_words(pages)) - (1 << 64))  # as the kernel leaves it
    assert make_header(exp, LAYOUT_SWA).checksum == want
    exp.pages_sum = torch.tensor(12345)  # used as given, not recomputed
    assert make_header(exp, LAYOUT_SWA).checksum != want


async def test_ack_carries_the_senders_phases() -> None:
    fake = FakeIpc()
    tr = IpcTransport(config(), fake)
    sink = Sink("req-1")
    async with receiver(sink, transports={"ipc": IpcTransport(config(), fake)}) as r:
        ack = await KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=tr).send(
            r.address, in_arena(tr, make_export(), "req-1")
        )
    phases = ack.phases
    assert list(phases) == ["checksum", "connect", "offer", "ready_wait", "push", "ack_wait"]
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= ack.elapsed_s + 1e-6
    assert phases["connect"] > 0 and phases["ack_wait"] > 0


# ---- the offer before the export is written; the checksum after it ---------------------------------


class SlowSum:
    """An export's pages sum whose gather has not finished: reading it (int()) blocks until released,
    as reading a device tensor waits for the kernel that writes it."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.released = threading.Event()
        self.reads = 0

    def __int__(self) -> int:
        self.reads += 1
        assert self.released.wait(10.0), "the sum was never released"
        return self.value


class HeaderSink(Sink):
    def __init__(self, *expected: str) -> None:
        super().__init__(*expected)
        self.headers: dict[str, Any] = {}

    def on_handoff(self, header: Any) -> list[torch.Tensor] | None:
        self.headers[header.request_id] = header
        return super().on_handoff(header)


async def test_the_offer_goes_before_the_export_is_written_and_the_checksum_follows() -> None:
    # written=False: a sender that waited for the export's writes would never offer (1 s timeout)
    fake = FakeIpc(written=False)
    cfg = dataclasses.replace(config(), idle_timeout_s=1.0)
    sender_tr = RecordingIpc(cfg, fake)
    sink = HeaderSink("a", "b")
    sender = KVSender(TOKEN, LAYOUT_SWA, config=cfg, transport=sender_tr)
    async with receiver(sink, transports={"ipc": IpcTransport(cfg, fake)}) as r:
        for rid, n in (("a", 37), ("b", IDS_INLINE_MAX + 9)):  # b: the ids, then the sum, follow
            ex = in_arena(sender_tr, make_export(num_prompt=n, seed=n), rid)
            pages = payload_segments(ex, LAYOUT_SWA)[0]
            slow = SlowSum(segment_sum(as_words(pages)))
            ex.pages_sum = slow  # type: ignore[assignment]
            send = asyncio.create_task(sender.send(r.address, ex))
            for _ in range(500):  # the receiver has the offer (and has launched its copy) ...
                if len(fake.waited) == len(sink.headers) == (1 if rid == "a" else 2):
                    break
                await asyncio.sleep(0.01)
            assert rid in sink.headers and not send.done() and rid not in sink.delivered
            assert sink.headers[rid].checksum_follows and sink.headers[rid].checksum == 0
            slow.released.set()  # ... before the gather's sum could be read
            ack = await send
            assert ack.request_id == rid and slow.reads == 1
            assert torch.equal(sink.delivered[rid].pages, ex.pages)
            del ex, pages
    arena = sender_tr.arena
    assert arena is not None and arena.event is not None and arena.event.records == 2  # once per offer
    assert fake.event_opens == [arena.event_handle["key"]]  # opened with the arena, once
    assert fake.waited == [arena.event, arena.event]  # each copy waited for it
    assert sender_tr.counters["event_offers"] == 2


async def test_a_wrong_checksum_that_follows_is_refused() -> None:
    def wrong_sum(ex: SequenceExport) -> None:
        ex.pages_sum = torch.tensor(12345)  # not the pages' sum

    err, sink = await refused(FakeIpc(), change=wrong_sum)
    assert err.code == CHECKSUM and "the sender's" in err.message
    assert "req-1" not in sink.delivered and sink.errors


async def test_without_an_event_the_offer_waits_and_the_checksum_is_in_the_header() -> None:
    fake = FakeIpc(events=False)
    sender_tr = RecordingIpc(config(), fake)
    sink = HeaderSink("req-1")
    async with receiver(sink, transports={"ipc": IpcTransport(config(), fake)}) as r:
        ex = in_arena(sender_tr, make_export(), "req-1")
        await KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=sender_tr).send(r.address, ex)
    header = sink.headers["req-1"]
    assert not header.checksum_follows and header.checksum == make_header(ex, LAYOUT_SWA).checksum
    assert sender_tr.arena is not None and sender_tr.arena.event is None
    (extra,) = sender_tr.offers
    assert extra["arena"]["event"] is None and fake.waited == [None] and fake.event_opens == []
    assert sender_tr.counters["event_offers"] == 0 and torch.equal(sink.delivered["req-1"].pages, ex.pages)


async def test_an_unwritten_export_without_an_event_times_out() -> None:
    err, sink = await refused(FakeIpc(events=False, written=False), cfg=dataclasses.replace(config(), idle_timeout_s=0.3))
    assert err.code == TIMEOUT and "not written" in err.message and sink.offered == []


async def test_a_checksum_for_another_request_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import transfer.sender as sender_mod
    from transfer.messages import Sum

    monkeypatch.setattr(sender_mod, "Sum", lambda rid, checksum: Sum("someone-else", checksum))
    err, sink = await refused(FakeIpc())
    assert err.code == PROTOCOL and "someone-else" in err.message
    assert "req-1" not in sink.delivered and sink.errors


# ---- pages in place: the sender's pool pages into the receiver's ---------------------------------------


def a_pool(layout: KVLayout) -> torch.Tensor:
    """A PE's KV pool of 16 pages, random bytes."""
    return torch.randn(layout.page_shape(16), generator=torch.Generator().manual_seed(99))


def in_pool(
    exp: SequenceExport, layout: KVLayout, blocks: list[int], tr: IpcTransport | None = None, pool: torch.Tensor | None = None
) -> SequenceExport:
    """The export as the PE makes it in place: its pages written at `blocks` of pool (a new one unless
    given), its state (if any) in tr's arena."""
    pool = a_pool(layout) if pool is None else pool
    pool[torch.tensor(blocks)] = exp.pages
    state = exp.state
    if state is not None and tr is not None:
        state = tr.allocate(tuple(state.shape), state.dtype, CPU)
        assert state is not None
        state.copy_(exp.state)
    return dataclasses.replace(exp, pages=PoolPages(pool, blocks), state=state)


@pytest.mark.parametrize("layout", [LAYOUT_SWA, LAYOUT_LATENT], ids=["swa", "latent"])
@pytest.mark.parametrize("hash", [True, False])
async def test_pool_pages_are_copied_straight_into_the_receivers_pool(layout: KVLayout, hash: bool) -> None:
    fake = FakeIpc(hash=hash)
    sender_tr = RecordingIpc(config(), fake)
    recv_tr = IpcTransport(config(), fake)
    sink = PoolSink(layout, [9, 3, 4, 5, 14, 0, 1, 7], "a", "b")
    sender = KVSender(TOKEN, layout, config=config(), transport=sender_tr)
    assert sender.exports_pages_in_place
    src_blocks = {"a": [2, 11, 12, 13, 0, 6, 8, 15], "b": [15, 14, 1, 2, 3, 4, 5, 10]}
    pool = a_pool(layout)
    async with receiver(sink, layout=layout, config=config(), transports={"ipc": recv_tr}) as r:
        sink.receiver = r
        for rid in ("a", "b"):
            exp = dataclasses.replace(make_export(layout, num_prompt=120, seed=ord(rid)), request_id=rid)
            ex = in_pool(exp, layout, src_blocks[rid], sender_tr, pool)
            await sender.send(r.address, ex)
            del ex
            got = sink.delivered[rid]  # (the sink lands every handoff in the same blocks: checked now)
            assert isinstance(got.pages, PoolPages) and got.pages.pool is sink.pages
            assert got.pages.block_ids == tuple(sink.blocks) and torch.equal(got.pages.gather(), exp.pages)
            if layout.has_state:
                assert got.state is not None and torch.equal(got.state, exp.state)
    for rid, extra in zip(("a", "b"), sender_tr.offers):
        assert extra["pool"]["pages"] == src_blocks[rid] and extra["offsets"][0] is None
        assert extra["pool"]["page_bytes"] == layout.page_bytes and extra["pool"]["event"] is not None
        assert ("arena" in extra) == layout.has_state and len(extra["offsets"]) == (2 if layout.has_state else 1)
    assert sender_tr.counters["pool_offers"] == 2 and sender_tr.counters["event_offers"] == 2
    assert recv_tr.counters["pool_opens"] == 1 and recv_tr.counters["pool_hits"] == 1  # opened once
    assert recv_tr.counters["in_place_receives"] == 2
    assert len({extra["pool"]["id"] for extra in sender_tr.offers}) == 1  # exported once
    assert recv_tr.counters["arena_opens"] == (1 if layout.has_state else 0)


async def test_pool_pages_into_a_buffer_of_the_receivers_own() -> None:
    """A receiver without a pool to land in (--ipc-copy-in, or no reservation pages) copies the sender's
    pool pages into its own buffer."""
    fake = FakeIpc()
    sender_tr = IpcTransport(config(), fake)
    sink = Sink("req-1")
    exp = make_export(num_prompt=60)
    async with receiver(sink, transports={"ipc": IpcTransport(config(), fake)}) as r:
        await KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=sender_tr).send(
            r.address, in_pool(exp, LAYOUT_SWA, [7, 0, 3, 12], sender_tr)
        )
    got = sink.delivered["req-1"]
    assert isinstance(got.pages, torch.Tensor) and torch.equal(got.pages, exp.pages)


async def test_a_corrupt_copy_into_the_pool_is_refused() -> None:
    fake = FakeIpc()
    fake.corrupt = True
    sender_tr = IpcTransport(config(), fake)
    sink = PoolSink(LAYOUT_SWA, [1, 2, 3, 4], "req-1")
    async with receiver(sink, config=config(), transports={"ipc": IpcTransport(config(), fake)}) as r:
        sink.receiver = r
        with pytest.raises(HandoffError) as e:
            await KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=sender_tr).send(
                r.address, in_pool(make_export(num_prompt=60), LAYOUT_SWA, [0, 5, 6, 9], sender_tr)
            )
    assert e.value.code == CHECKSUM and "req-1" not in sink.delivered and sink.errors


@pytest.mark.parametrize(
    "lie",
    [
        lambda x: x["pool"]["pages"].__setitem__(0, x["pool"]["nbytes"] // x["pool"]["page_bytes"]),  # past the pool
        lambda x: x["pool"]["pages"].pop(),  # one page short of the header's
        lambda x: x["pool"].__setitem__("page_bytes", x["pool"]["page_bytes"] // 2),
        lambda x: x["offsets"].__setitem__(1, None),  # the state "in the pool" too
        lambda x: x.pop("pool"),
    ],
    ids=["page-past-the-pool", "page-missing", "page-size", "state-in-pool", "no-pool"],
)
async def test_malformed_pool_offers_are_refused(lie: Callable[[dict[str, Any]], Any]) -> None:
    fake = FakeIpc()

    class Lying(IpcTransport):
        async def offer(self, ch: Any, segments: list[Any]) -> dict[str, Any]:
            extra = await super().offer(ch, segments)
            lie(extra)
            return extra

    sender_tr = Lying(config(), fake)
    sink = Sink("req-1")
    async with receiver(sink, transports={"ipc": IpcTransport(config(), fake)}) as r:
        with pytest.raises(HandoffError) as e:
            await KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=sender_tr).send(
                r.address, in_pool(make_export(num_prompt=60), LAYOUT_SWA, [0, 5, 6, 9], sender_tr)
            )
    assert e.value.code == TRANSPORT and "malformed" in e.value.message
    assert fake.opens == [] and "req-1" not in sink.delivered


async def test_a_pool_that_cannot_be_exported_is_gathered() -> None:
    """The KV pool's export fails (no IPC for that memory): the pages are gathered, then go as before."""
    exp = make_export(num_prompt=60)
    pool = a_pool(LAYOUT_SWA)

    class NoPool(FakeIpc):
        pool_tries = 0

        def export(self, t: torch.Tensor) -> dict[str, Any]:
            if t is pool:  # the arena, the event and other tensors export fine
                self.pool_tries += 1
                raise RuntimeError("this memory cannot be exported")
            return super().export(t)

    fake = NoPool()
    sender_tr = RecordingIpc(config(), fake)
    sink = Sink("req-1")
    async with receiver(sink, transports={"ipc": IpcTransport(config(), fake)}) as r:
        await KVSender(TOKEN, LAYOUT_SWA, config=config(), transport=sender_tr).send(
            r.address, in_pool(exp, LAYOUT_SWA, [3, 9, 0, 5], sender_tr, pool)
        )
    (extra,) = sender_tr.offers
    assert "pool" not in extra and sender_tr.counters["pool_offers"] == 0  # the gathered pages: their own handle
    assert torch.equal(sink.delivered["req-1"].pages, exp.pages)
    assert sender_tr._pool_export(PoolPages(pool, [0])) is None and fake.pool_tries == 1  # tried once, remembered


async def test_other_transports_gather_pool_pages_first() -> None:
    """tcp reads no pool: the sender gathers an in-place export's pages before the offer."""
    sink = Sink("req-1")
    exp = make_export(num_prompt=60)
    async with receiver(sink) as r:
        sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
        assert not sender.exports_pages_in_place
        await sender.send(r.address, in_pool(exp, LAYOUT_SWA, [4, 2, 8, 1]))
    assert torch.equal(sink.delivered["req-1"].pages, exp.pages)


def test_copy_in_turns_pages_in_place_off() -> None:
    cfg = dataclasses.replace(config(), ipc_copy_in=True)
    tr = IpcTransport(cfg, FakeIpc())
    assert not KVSender(TOKEN, LAYOUT_SWA, config=cfg, transport=tr).exports_pages_in_place
    sink = PoolSink(LAYOUT_SWA, [1, 2, 3, 4], "r")
    header = make_header(make_export(num_prompt=60), LAYOUT_SWA)
    assert tr.receive_buffers(header, CPU, sink) is None  # the receiver allocates its own buffers
    assert IpcTransport(config(), FakeIpc()).receive_buffers(header, CPU, sink) is not None


def test_engine_export_names_its_pages_in_the_pool(tiny_model_dir) -> None:
    from engine.request import SamplingParams
    from tests.engine_utils import small_engine

    eng = small_engine(tiny_model_dir("qwen3_hybrid"), hicache_gb=0)
    tr = IpcTransport(config(), FakeIpc())
    eng.add_request("r", list(range(3, 44)), SamplingParams(max_tokens=4, ignore_eos=True), use_prefix_cache=False)
    seq = eng.scheduler.find("r")
    assert seq is not None
    while not seq.output_token_ids:
        eng.step()
    plain = eng.export_sequence("r", device=None)
    ex = eng.export_sequence("r", device=None, alloc=tr.allocate, pages_in_place=True)
    assert isinstance(ex.pages, PoolPages) and ex.pages.pool is eng.kv.pages
    assert list(ex.pages.block_ids) == seq.block_ids[: len(ex.pages)]
    assert torch.equal(ex.pages.gather().view(torch.uint8), plain.pages.view(torch.uint8))
    assert ex.state is not None and tr.arena is not None and tr.arena.offset_of(ex.state) is not None
    assert ex.pages_sum is None  # CPU: hashed by the sender from the pool
    assert make_header(ex, eng.handoff_layout).checksum == make_header(plain, eng.handoff_layout).checksum
    skipped = eng.export_sequence("r", device=None, skip_pages=1, pages_in_place=True)
    assert isinstance(skipped.pages, PoolPages) and list(skipped.pages.block_ids) == seq.block_ids[1 : len(ex.pages)]
