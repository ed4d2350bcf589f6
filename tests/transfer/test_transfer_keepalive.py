"""Kept connections over real sockets on 127.0.0.1: one authenticated connection carries handoff after
handoff; a connection the receiver closed (restart, idle limit) is noticed and replaced without failing
the send; a failed handoff closes its connection and the next send opens a new one."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest
import torch

from tests.transfer.support import FAST, LAYOUT_SWA, TOKEN, Sink, make_export, receiver
from transfer.auth import client_handshake
from transfer.errors import BAD_HEADER, TIMEOUT, UNEXPECTED, HandoffError
from transfer.header import IDS_INLINE_MAX, make_header
from transfer.messages import Ids, Nack, Offer
from transfer.sender import KVSender
from transfer.wire import Channel


def export(rid: str, n: int = 40):
    return dataclasses.replace(make_export(num_prompt=n, seed=len(rid)), request_id=rid)


async def test_handoffs_share_one_authenticated_connection() -> None:
    exps = [export(f"r{i}", 30 + i) for i in range(3)]
    sink = Sink(*[e.request_id for e in exps])
    sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
    try:
        async with receiver(sink) as r:
            acks = [await sender.send(r.address, e) for e in exps]
    finally:
        sender.close()
    assert [a.reused for a in acks] == [False, True, True]
    assert sender.counters == {"connects": 1, "reuses": 2, "stale": 0}
    assert r.counters["handoffs"] == 3 and r.counters["refused_auth"] == 0
    for e in exps:
        assert torch.equal(sink.delivered[e.request_id].pages, e.pages)
    # the receiver says where its time went, and a kept connection skips connect and handshake
    assert {"decode", "on_handoff", "accept", "complete"} <= set(acks[1].receiver_phases)
    assert acks[1].connect_s < acks[0].connect_s


async def test_receiver_restart_replaces_the_kept_connection() -> None:
    sink = Sink("a", "b")
    sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
    try:
        async with receiver(sink) as r:
            await sender.send(r.address, export("a"))
            port = r.port
        async with receiver(sink, port=port) as r2:  # the same address, a new process's listener
            ack = await sender.send(r2.address, export("b"))
    finally:
        sender.close()
    assert not ack.reused and sender.counters["connects"] == 2
    assert sorted(sink.delivered) == ["a", "b"] and sink.errors == []


async def test_receiver_closes_an_idle_connection() -> None:
    idle_out = dataclasses.replace(FAST, keepalive_s=0.2)
    sink = Sink("a", "b")
    sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)  # keeps connections for 30 s: longer than idle_out
    try:
        async with receiver(sink, config=idle_out) as r:
            await sender.send(r.address, export("a"))
            await asyncio.sleep(0.6)  # past the receiver's keepalive: it has hung up
            ack = await sender.send(r.address, export("b"))
    finally:
        sender.close()
    assert not ack.reused and sender.counters["connects"] == 2 and sink.errors == []
    assert sorted(sink.delivered) == ["a", "b"]


async def test_stale_connection_found_after_the_offer_is_sent() -> None:
    """A kept connection that looks open when taken but is dropped before the receiver answers: the
    send goes again on a new connection (nothing was taken on the old one)."""
    sink = Sink("a", "b")
    sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
    try:
        async with receiver(sink) as r:
            await sender.send(r.address, export("a"))
            (conn,) = sender._idle[r.address]
            conn.ch.is_idle_open = lambda: True  # type: ignore[method-assign]  # the check races a close
            for task in list(r._conns):  # the receiver drops the connection
                task.cancel()
            await asyncio.sleep(0.1)
            ack = await sender.send(r.address, export("b"))
    finally:
        sender.close()
    assert not ack.reused and sender.counters == {"connects": 2, "reuses": 1, "stale": 1}
    assert sorted(sink.delivered) == ["a", "b"]


async def test_failed_handoff_closes_its_connection() -> None:
    sink = Sink("b")  # "a" is not expected: refused
    sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
    try:
        async with receiver(sink) as r:
            with pytest.raises(HandoffError) as e:
                await sender.send(r.address, export("a"))
            assert e.value.code == UNEXPECTED and sender._idle.get(r.address, []) == []
            ack = await sender.send(r.address, export("b"))
    finally:
        sender.close()
    assert not ack.reused and sender.counters["connects"] == 2 and list(sink.delivered) == ["b"]


async def test_concurrent_sends_open_one_connection_each() -> None:
    exps = [export(f"c{i}", 20 + i) for i in range(4)]
    sink = Sink(*[e.request_id for e in exps], "d0", "d1")
    sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
    try:
        async with receiver(sink) as r:
            await asyncio.gather(*[sender.send(r.address, e) for e in exps])
            kept = len(sender._idle[r.address])
            again = await asyncio.gather(*[sender.send(r.address, export(f"d{i}")) for i in range(2)])
    finally:
        sender.close()
    assert kept == 4 and [a.reused for a in again] == [True, True]
    assert sender.counters["connects"] == 4 and r.counters["handoffs"] == 6
    for e in exps:
        assert torch.equal(sink.delivered[e.request_id].pages, e.pages)


async def test_long_prompt_ids_after_the_offer_over_tcp() -> None:
    n = IDS_INLINE_MAX + 100
    exp = dataclasses.replace(make_export(num_prompt=n, seed=3), request_id="long")
    exp = dataclasses.replace(exp, prompt_token_ids=[(13 * i) % 49000 for i in range(n)])
    sink = Sink("long")
    sender = KVSender(TOKEN, LAYOUT_SWA, config=FAST)
    try:
        async with receiver(sink) as r:
            await sender.send(r.address, exp)
    finally:
        sender.close()
    got = sink.delivered["long"]
    assert got.prompt_token_ids == exp.prompt_token_ids and torch.equal(got.pages, exp.pages)


@pytest.mark.parametrize("ids", [None, b"\x01\x00\x00\x00"])  # never sent; one id instead of many
async def test_announced_ids_missing_or_wrong_are_refused(ids: bytes | None) -> None:
    n = IDS_INLINE_MAX + 1
    exp = dataclasses.replace(make_export(num_prompt=n), request_id="req-1")
    header = make_header(exp, LAYOUT_SWA)
    sink = Sink("req-1")
    quick = dataclasses.replace(FAST, handshake_timeout_s=0.5)
    async with receiver(sink, config=quick) as r:
        host, port = r.address.rsplit(":", 1)
        ch = Channel(socket.create_connection((host, int(port))), r.address)
        try:
            await client_handshake(ch, TOKEN, "raw-test-sender")
            await ch.send(Offer("tcp", header.encode()))
            if ids is not None:
                await ch.send(Ids(ids))
            reply = await asyncio.wait_for(ch.recv(), 10)
        finally:
            ch.close()
    assert isinstance(reply, Nack) and reply.code == (TIMEOUT if ids is None else BAD_HEADER)
    assert sink.delivered == {} and len(sink.errors) == 1  # the reservation is released
