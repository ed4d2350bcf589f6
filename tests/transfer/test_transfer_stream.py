"""A streamed handoff (--kv-stream; wire.py: open, parts, final offer) over real sockets on 127.0.0.1:
the receiver gets the same sequence as from one offer, over one socket and striped, and over nixl (the
parts written one-sided into the buffer the open registered; where the extra is installed); a delta
handoff streams from its first page; a corrupt part, a sender gone mid-stream and a final offer that
disagrees with the open fail without delivering anything."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from engine.handoff import SequenceExport
from tests.transfer.support import FAST, LAYOUT_SWA, TOKEN, Sink, make_export, receiver
from transfer import sender as sender_module
from transfer.config import TransferConfig, nixl_installed
from transfer.errors import BAD_HEADER, CHECKSUM, INCOMPLETE, TIMEOUT, TRANSPORT, HandoffError
from transfer.header import HandoffHeader, stream_plan
from transfer.receiver import KVReceiver
from transfer.sender import Ack, KVSender, PagesPart, StreamParts

NIXL = pytest.param(
    "nixl", marks=pytest.mark.skipif(not nixl_installed(), reason="the nixl extra is not installed")
)
NUM_PROMPT = 16 * 7 + 5  # 8 pages of 16 tokens: 7 may stream, the 8th (the last prompt token's) goes at the end


def plan_of(exp: SequenceExport, first_page: int = 0) -> HandoffHeader:
    return stream_plan(
        exp.request_id, exp.prompt_token_ids, exp.params, exp.seed, LAYOUT_SWA, first_page=first_page
    )


def final_of(exp: SequenceExport, first_page: int) -> SequenceExport:
    """The export that ends a stream whose parts carried pages up to first_page (of exp's pages from exp.first_page)."""
    cut = first_page - exp.first_page
    return dataclasses.replace(exp, pages=exp.pages[cut:].clone(), first_page=first_page)


async def stream_in_parts(sender: KVSender, addr: str, exp: SequenceExport, cuts: list[int]) -> Ack:
    """Streams exp's pages in parts ending at the pages `cuts` (absolute), then the rest; returns the Ack."""
    parts = StreamParts()
    lo = exp.first_page
    for hi in cuts:
        parts.put(PagesPart(lo, exp.pages[lo - exp.first_page : hi - exp.first_page].clone()))
        lo = hi
    parts.put(final_of(exp, lo))
    return await sender.stream(addr, plan_of(exp, exp.first_page), parts)


def same(a: SequenceExport, b: SequenceExport) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids and a.output_token_ids == b.output_token_ids
    assert a.first_page == b.first_page and a.num_computed == b.num_computed
    assert torch.equal(a.pages, b.pages)
    assert a.state is not None and b.state is not None and torch.equal(a.state, b.state)


@pytest.mark.parametrize("transport, tcp_streams", [("tcp", 1), ("tcp", 3), pytest.param(*NIXL.values, 1, marks=NIXL.marks)])
async def test_a_streamed_handoff_delivers_the_whole_sequence(transport, tcp_streams):
    exp = make_export(num_prompt=NUM_PROMPT)
    sink = Sink("req-1")
    config = dataclasses.replace(FAST, transport=transport, tcp_streams=tcp_streams)
    async with receiver(sink, config=config) as r:
        sender = KVSender(TOKEN, LAYOUT_SWA, config=config)
        try:
            ack = await stream_in_parts(sender, r.address, exp, [2, 3, 7])
        finally:
            sender.close()
    assert ack.num_streamed_pages == 7 and ack.payload_bytes == LAYOUT_SWA.payload_bytes(NUM_PROMPT)
    same(sink.delivered["req-1"], exp)
    assert r.counters["handoffs"] == 1 and r.counters["bytes"] == ack.payload_bytes and not sink.errors
    assert ack.transport == transport
    if transport == "nixl":  # the stream's registration released, nothing held
        nixl = r._transports["nixl"]  # type: ignore[attr-defined]
        assert nixl._streams == {} and nixl._agent._held == {}


async def test_a_streamed_delta_handoff_starts_at_its_first_page_and_long_prompts_send_ids():
    exp = make_export(num_prompt=16 * 80 + 3)  # past IDS_INLINE_MAX: the ids follow the open and the final offer
    exp = dataclasses.replace(exp, pages=exp.pages[5:].clone(), first_page=5)
    sink = Sink("req-1")
    async with receiver(sink) as r:
        sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
        try:
            ack = await stream_in_parts(sender, r.address, exp, [6, 40, 80])
            ack2 = await stream_in_parts(sender, r.address, exp, [])  # nothing streamed: the final is all
        finally:
            sender.close()
    assert ack.num_streamed_pages == 75 and ack2.num_streamed_pages == 0
    same(sink.delivered["req-1"], exp)
    assert sender.counters["reuses"] == 1  # the connection carried both


@pytest.mark.parametrize("transport", ["tcp", NIXL])
async def test_a_corrupt_part_fails_the_handoff_and_delivers_nothing(monkeypatch, transport):
    """A part whose bytes are not those its checksum was computed over (a bit flipped on the way)."""
    real = sender_module.part_checksum
    monkeypatch.setattr(sender_module, "part_checksum", lambda part: real(part) ^ 1)
    exp = make_export(num_prompt=NUM_PROMPT)
    sink = Sink("req-1")
    config = dataclasses.replace(FAST, transport=transport)
    async with receiver(sink, config=config) as r:
        sender = KVSender(TOKEN, LAYOUT_SWA, config=config)
        try:
            with pytest.raises(HandoffError) as e:
                await stream_in_parts(sender, r.address, exp, [3])
        finally:
            sender.close()
        await asyncio.wait_for(sink.failed.wait(), 5)
    assert e.value.code == CHECKSUM and "pages [0, 3)" in e.value.message
    assert not sink.delivered and [x.code for x in sink.errors] == [CHECKSUM]


@pytest.mark.parametrize("transport", ["tcp", NIXL])
async def test_a_sender_gone_mid_stream_fails_the_handoff_on_the_receiver(transport):
    """The PE aborts (or dies) after two parts: its connection closes; the receiver tells on_error (the
    CE's reservation is reserved again) and delivers nothing. Over nixl the stream's buffer stays
    registered for idle_timeout_s after (a write may still land), then is released."""
    exp = make_export(num_prompt=NUM_PROMPT)
    sink = Sink("req-1")
    config = dataclasses.replace(FAST, transport=transport)
    async with receiver(sink, config=config) as r:
        sender = KVSender(TOKEN, LAYOUT_SWA, config=config)
        parts = StreamParts()
        sent: list[int] = []
        task = asyncio.ensure_future(sender.stream(r.address, plan_of(exp), parts, on_part=sent.append))
        parts.put(PagesPart(0, exp.pages[:2].clone()))
        parts.put(PagesPart(2, exp.pages[2:4].clone()))
        while len(sent) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        sender.close()
        await asyncio.wait_for(sink.failed.wait(), 5)
        if transport == "nixl":
            agent = r._transports["nixl"]._agent  # type: ignore[attr-defined]
            assert len(agent._held) == 1  # the stream's registration, held
            deadline = time.monotonic() + FAST.idle_timeout_s + 5
            while agent._held and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert agent._held == {}
    assert not sink.delivered and [x.code for x in sink.errors] == [INCOMPLETE]


async def test_a_final_offer_that_disagrees_with_the_open_is_refused():
    exp = make_export(num_prompt=NUM_PROMPT)
    sink = Sink("req-1")
    async with receiver(sink) as r:
        sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
        parts = StreamParts()
        parts.put(PagesPart(0, exp.pages[:3].clone()))
        parts.put(dataclasses.replace(final_of(exp, 3), prompt_token_ids=list(range(100, 100 + NUM_PROMPT))))
        try:
            with pytest.raises(HandoffError) as e:
                await sender.stream(r.address, plan_of(exp), parts)
        finally:
            sender.close()
        await asyncio.wait_for(sink.failed.wait(), 5)
    assert e.value.code == BAD_HEADER and not sink.delivered


async def test_only_a_transport_that_carries_parts_streams():
    with pytest.raises(ValueError, match="--kv-stream on"):
        TransferConfig(transport="nccl", stream="on")
    assert TransferConfig().streams_handoffs and not TransferConfig(transport="ipc").streams_handoffs
    if nixl_installed():
        assert TransferConfig(transport="nixl").streams_handoffs
    assert not TransferConfig(stream="off").streams_handoffs
    exp = make_export(num_prompt=NUM_PROMPT)
    sender = KVSender(TOKEN, LAYOUT_SWA, config=TransferConfig(transport="ipc"))
    try:
        with pytest.raises(HandoffError) as e:
            await sender.stream("127.0.0.1:1", plan_of(exp), StreamParts())
    finally:
        sender.close()
    assert e.value.code == TRANSPORT


async def test_the_lease_runs_from_the_prefills_end():
    """A prefill longer than the lease streams on (the lease starts with the export); a receiver that
    then never acks fails the send with timeout, lease_s after the export arrived."""
    exp = make_export(num_prompt=NUM_PROMPT)
    sink = Sink("req-1")
    stall = asyncio.Event()

    async def on_complete(header: HandoffHeader, export: SequenceExport) -> None:
        if stall.is_set():
            await asyncio.sleep(30)
        sink.on_complete(header, export)

    async with KVReceiver(TOKEN, LAYOUT_SWA, sink.on_handoff, on_complete, on_error=sink.on_error, config=FAST) as r:
        sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
        try:
            parts = StreamParts()
            task = asyncio.ensure_future(sender.stream(r.address, plan_of(exp), parts, timeout_s=0.5))
            parts.put(PagesPart(0, exp.pages[:4].clone()))
            await asyncio.sleep(1.0)  # the rest of the prefill: twice the lease
            parts.put(final_of(exp, 4))
            ack = await task
            assert ack.num_streamed_pages == 4 and "req-1" in sink.delivered
            stall.set()
            parts = StreamParts()
            parts.put(PagesPart(0, exp.pages[:4].clone()))
            parts.put(final_of(exp, 4))
            t0 = time.monotonic()
            with pytest.raises(HandoffError) as e:
                await sender.stream(r.address, plan_of(exp), parts, timeout_s=0.5)
            assert e.value.code == TIMEOUT and time.monotonic() - t0 < 5
        finally:
            sender.close()


async def test_a_chunk_longer_than_the_receivers_wait_is_bridged_by_keepalives():
    """The receiver waits keepalive_s for each message of a stream; a sender whose next part takes longer
    (a long chunk) sends keepalives meanwhile, and a sender that sends nothing is dropped."""
    exp = make_export(num_prompt=NUM_PROMPT)
    sink = Sink("req-1")
    config = dataclasses.replace(FAST, keepalive_s=0.6)
    async with receiver(sink, config=config) as r:
        sender = KVSender(TOKEN, LAYOUT_SWA, config=config)
        try:
            parts = StreamParts()
            task = asyncio.ensure_future(sender.stream(r.address, plan_of(exp), parts))
            parts.put(PagesPart(0, exp.pages[:4].clone()))
            await asyncio.sleep(2.0)  # the next chunk: three times the receiver's wait
            parts.put(final_of(exp, 4))
            assert (await task).num_streamed_pages == 4 and "req-1" in sink.delivered
        finally:
            sender.close()
        silent = KVSender(TOKEN, LAYOUT_SWA, config=dataclasses.replace(config, keepalive_s=60.0))
        try:
            parts = StreamParts()
            task = asyncio.ensure_future(silent.stream(r.address, plan_of(exp), parts))
            await asyncio.wait_for(sink.failed.wait(), 5)  # beats every 15 s: too late for the receiver
            assert [e.code for e in sink.errors] == [TIMEOUT]
            task.cancel()
        finally:
            silent.close()
