"""engine/handoff/ledger.py on the CPU: a sequence's P/D lifecycle on small pools (no model), then on
a tiny engine (check_idle sees the ledger). FIFO grants, commits that never overcommit, expiry that
waits for a receive in progress, the receiver's thread-safe transitions, abort in every phase."""

from __future__ import annotations

import random
import threading

import pytest

from engine.core.block_pool import BlockPool
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.sequence import SeqStatus, Sequence
from engine.errors import InvalidRequestError
from engine.handoff.ledger import Grant, HandoffLedger, Phase
from engine.request import SamplingParams
from tests.engine_utils import small_engine

BLOCK = 4  # tokens per page: a commit of t tokens takes ceil((t + 1) / 4) pages


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class Pools:
    def __init__(self, num_blocks: int = 8, num_slots: int = 4, max_num_seqs: int = 4) -> None:
        self.blocks, self.slots = BlockPool(num_blocks), BlockPool(num_slots)
        config = SchedulerConfig(max_num_seqs, 64, BLOCK, needs_blocks=True, needs_state_slot=True)
        self.scheduler = Scheduler(config, self.blocks, self.slots)
        self.clock = Clock()
        self.ledger = HandoffLedger(self.scheduler, max_num_seqs, clock=self.clock)

    def check_idle(self) -> None:
        self.ledger.check_idle()
        assert not self.scheduler.has_unfinished()
        self.blocks.check_idle()
        self.slots.check_idle()

    def running(self, rid: str, num_prompt: int) -> Sequence:
        """A sequence admitted the usual way and prefilled, its first token sampled."""
        seq = Sequence(rid, list(range(3, 3 + num_prompt)), SamplingParams(max_tokens=4), 0, 0.0)
        self.scheduler.add(seq)
        assert self.scheduler.schedule().seqs == [seq]
        seq.num_computed = num_prompt
        seq.output_token_ids.append(7)
        return seq

    def imported(self, rid: str, num_prompt: int) -> Sequence:
        seq = Sequence(rid, list(range(3, 3 + num_prompt)), SamplingParams(max_tokens=4), 0, 0.0)
        seq.output_token_ids = [7]
        seq.num_computed = num_prompt
        return seq


# ---- CE: waiting, reserved, commits -----------------------------------------------------------------


def test_grants_in_arrival_order_and_never_overcommit() -> None:
    p = Pools(num_blocks=8)
    h = p.ledger
    h.enqueue("a", 5, 23, 30.0)  # commits 6 of 8 pages
    h.enqueue("b", 5, 11, 30.0)  # 3 more: waits for a
    h.enqueue("c", 3, 3, 30.0)  # 1 would fit, but b is first
    assert h.grant() == [Grant("a")]
    assert (h.num_waiting, h.num_held, h.num_committed_blocks) == (2, 1, 6)
    assert h.phase("a") is Phase.RESERVED and h.phase("b") is Phase.WAITING
    assert p.blocks.num_used == 2 and p.slots.num_used == 1  # a's placeholder: 5 tokens and the next one
    assert h.grant() == []
    h.abort("a")
    assert h.grant() == [Grant("b"), Grant("c")]
    assert h.num_committed_blocks == 4 and h.num_waiting == 0
    for rid in ("b", "c"):
        h.abort(rid)
    p.check_idle()


def test_refusals_at_enqueue_and_a_taken_id_at_grant() -> None:
    p = Pools(num_blocks=8)
    h = p.ledger
    with pytest.raises(InvalidRequestError, match=r"need more KV memory than this engine has \(8 pages\)"):
        h.enqueue("huge", 5, 8 * BLOCK, 30.0)
    h.enqueue("a", 5, 5, 30.0)
    with pytest.raises(InvalidRequestError, match="already in use") as e:
        h.enqueue("a", 5, 5, 30.0)
    assert e.value.param == "request_id"
    p.running("a", 5)  # a live sequence took the id before the grant
    (g,) = h.grant()
    assert g.request_id == "a" and g.error is not None and g.error.param == "request_id"
    assert h.phase("a") is None
    p.scheduler.finish(p.scheduler.running[0], "stop")
    p.check_idle()


def test_a_grant_needs_memory_and_a_batch_row_now() -> None:
    p = Pools(num_blocks=8, max_num_seqs=2)
    h = p.ledger
    seq = p.running("busy", 9)  # 3 pages now
    for rid in ("a", "b"):
        h.enqueue(rid, 5, 5, 30.0)
    assert h.grant() == [Grant("a")]  # b: a row for busy and one for a, max_num_seqs 2
    assert not h.can_import(5)
    p.scheduler.finish(seq, "stop")
    assert h.grant() == [Grant("b")]
    for rid in ("a", "b"):
        h.abort(rid)
    p.check_idle()


def test_random_operations_never_overcommit_and_end_idle() -> None:
    rng = random.Random(5)
    p = Pools(num_blocks=12, num_slots=6, max_num_seqs=5)
    h = p.ledger

    def abort(rid: str) -> None:  # what LLMEngine.abort does
        seq = p.scheduler.find(rid)
        h.abort(rid)
        if seq is not None:
            p.scheduler.finish(seq, "abort")

    live: set[str] = set()
    for i in range(400):
        op = rng.random()
        if op < 0.35:
            rid = f"r{i}"
            h.enqueue(rid, rng.randint(2, 10), rng.randint(1, 40), 30.0)
            live.add(rid)
        elif op < 0.55 and live:
            abort(rng.choice(sorted(live)))
        elif op < 0.7:
            held = [r for r in sorted(live) if h.phase(r) is Phase.RESERVED]
            if held:
                rid = rng.choice(held)
                assert h.begin_receive(rid, 2)
                if rng.random() < 0.5:
                    h.receive_failed(rid)
                else:
                    h.import_(p.imported(rid, 1))
        elif op < 0.8:
            done = [r for r in sorted(live) if h.phase(r) is Phase.IMPORTED]
            if done:
                rid = rng.choice(done)
                seq = p.scheduler.find(rid)
                assert seq is not None
                p.scheduler.finish(seq, "stop")
                h.end(rid)
        else:
            h.grant()
        live = {r for r in live if h.phase(r) is not None}
        assert h.num_committed_blocks <= h.num_total_blocks
    assert h.num_imported_total > 10
    for rid in sorted(live):
        abort(rid)
    p.check_idle()


# ---- CE: receiving, import, expiry, local prefill ----------------------------------------------------


def test_import_takes_the_reservations_memory_and_keeps_its_commit() -> None:
    p = Pools(num_blocks=8)
    h = p.ledger
    h.enqueue("a", 6, 13, 30.0)
    assert h.grant() == [Grant("a")]
    used = p.blocks.num_used
    assert not h.begin_receive("a", 7)  # more tokens than reserved
    assert h.begin_receive("a", 6)
    assert not h.begin_receive("a", 6)  # one offer at a time
    seq = p.imported("a", 5)
    h.import_(seq)
    assert h.phase("a") is Phase.IMPORTED and seq.status is SeqStatus.RUNNING
    assert p.scheduler.running == [seq] and p.blocks.num_used == used
    assert h.num_committed_blocks == 4 and h.num_held == 0 and h.num_imported_total == 1
    p.scheduler.finish(seq, "stop")
    h.end("a")
    p.check_idle()


def test_import_without_a_reservation_and_when_nothing_fits() -> None:
    p = Pools(num_blocks=3)
    h = p.ledger
    seq = p.imported("x", 5)
    h.import_(seq)  # free memory: fine, nothing committed
    assert h.phase("x") is Phase.IMPORTED and h.num_committed_blocks == 0
    with pytest.raises(MemoryError):
        h.import_(p.imported("y", 5))
    assert h.phase("y") is None
    p.scheduler.finish(seq, "stop")
    h.end("x")
    p.check_idle()


def test_expiry_waits_for_a_receive_in_progress() -> None:
    p = Pools()
    h = p.ledger
    for rid in ("a", "b"):
        h.enqueue(rid, 5, 5, 1.0)
    assert h.grant() == [Grant("a"), Grant("b")]
    assert h.begin_receive("b", 5)
    p.clock.now_s += 0.5
    assert h.expire() == []
    p.clock.now_s += 1.0
    (late,) = h.expire()
    assert (late.request_id, late.ttl_s) == ("a", 1.0)
    assert h.phase("b") is Phase.RECEIVING and h.num_expired_total == 1
    h.receive_failed("b")  # nothing delivered: back to reserved, the deadline long past
    assert [e.request_id for e in h.expire()] == ["b"]
    assert h.num_expired_total == 2
    p.check_idle()


# ---- CE: a receive in place (nixl writes straight into the reservation's pages) ----------------------


def test_an_import_in_place_takes_the_placeholders_own_pages() -> None:
    p = Pools(num_blocks=8)
    h = p.ledger
    h.enqueue("a", 6, 13, 30.0)  # 6 tokens: the placeholder holds blocks_for(7) = 2 pages
    h.grant()
    assert h.land_in_place("a", 0, 2, 5.0) is None  # not receiving yet
    assert h.begin_receive("a", 6)
    assert h.land_in_place("a", 1, 2, 5.0) is None  # page 0 is not held here: a delta cannot land
    block_ids, slot = h.land_in_place("a", 0, 2, 5.0)
    assert len(block_ids) == 2 and slot >= 0
    used = p.blocks.num_used
    seq = p.imported("a", 5)
    with pytest.raises(InvalidRequestError, match="not its reservation's"):
        h.import_(seq, 0, (tuple(block_ids[::-1]), slot))
    assert h.phase("a") is Phase.RECEIVING  # refused, nothing changed
    h.landed("a")
    h.import_(seq, 0, (tuple(block_ids), slot))
    assert seq.block_ids == block_ids and seq.state_slot == slot  # the very pages the sender wrote
    assert h.phase("a") is Phase.IMPORTED and p.scheduler.running == [seq] and p.blocks.num_used == used
    assert h.num_committed_blocks == 4 and h.num_quarantined_blocks == 0
    p.scheduler.finish(seq, "stop")
    h.end("a")
    p.check_idle()


@pytest.mark.parametrize("how", ["abort while receiving", "failed then expired", "failed then abort"])
def test_a_reservation_released_while_a_write_may_land_is_quarantined(how: str) -> None:
    """Its pages and slot go to no other sequence until the sender's write bound (hold_s) has passed."""
    p = Pools(num_blocks=8)
    h = p.ledger
    h.enqueue("a", 6, 6, 1.0)
    h.grant()
    assert h.begin_receive("a", 6)
    block_ids, slot = h.land_in_place("a", 0, 2, 5.0)
    if how == "abort while receiving":
        h.abort("a")
    else:
        h.receive_failed("a")  # the sender may go on writing for 5 s
        assert h.phase("a") is Phase.RESERVED
        p.clock.now_s += 2.0
        if how == "failed then expired":
            assert [e.request_id for e in h.expire()] == ["a"]  # the reservation ends; its memory does not
        else:
            h.abort("a")
    assert h.phase("a") is None and h.num_quarantined_blocks == 2
    assert p.blocks.num_used == 2 and h.num_committed_blocks == 2  # commits count it: grants wait for it
    with pytest.raises(AssertionError, match="quarantined"):
        h.check_idle()
    p.clock.now_s += 2.9
    h.expire()
    assert h.num_quarantined_blocks == 2  # the sender's bound has not passed yet
    p.clock.now_s += 3.1
    h.expire()
    assert h.num_quarantined_blocks == 0
    p.check_idle()


@pytest.mark.parametrize("in_place", [False, True])
def test_refused_import_frees_the_reservation(in_place: bool) -> None:
    """At once, a receive in place too: its payload was verified (landed), so no write is in flight."""
    p = Pools()
    h = p.ledger
    h.enqueue("a", 5, 5, 30.0)
    h.grant()
    assert h.begin_receive("a", 5)
    if in_place:
        assert h.land_in_place("a", 0, 2, 60.0) is not None
        h.landed("a")
    h.refuse_import("a")
    assert h.phase("a") is None and not h.begin_receive("a", 5) and h.num_quarantined_blocks == 0
    p.check_idle()


def test_local_prefill_takes_over_a_reservation_and_commits() -> None:
    p = Pools(num_blocks=8)
    h = p.ledger
    h.enqueue("held", 5, 13, 30.0)
    h.enqueue("queued", 5, 3, 30.0)
    assert h.grant() == [Grant("held"), Grant("queued")]
    h.enqueue("waiting", 5, 3, 30.0)
    h.take_over("held", 13)
    h.take_over("none", 11)  # no reservation (it expired): committed now
    assert h.phase("held") is h.phase("none") is Phase.LOCAL
    assert p.blocks.num_used == 2 and h.num_committed_blocks == 4 + 1 + 3
    assert h.grant() == []  # 8 + 1 of 8: waiting's page does not fit
    assert not h.begin_receive("held", 5)  # a late handoff is refused
    h.take_over("waiting", 3)
    assert h.num_waiting == 0
    for rid in ("held", "none", "waiting"):
        h.end(rid)
    h.abort("queued")
    p.check_idle()


def test_begin_receive_from_many_threads_takes_the_offer_once() -> None:
    p = Pools()
    h = p.ledger
    h.enqueue("a", 5, 5, 30.0)
    h.grant()
    wins: list[bool] = []
    start = threading.Barrier(8)

    def offer() -> None:
        start.wait()
        wins.append(h.begin_receive("a", 5))

    threads = [threading.Thread(target=offer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == [False] * 7 + [True]
    h.abort("a")
    p.check_idle()


# ---- PE: parked, exported, handed off ----------------------------------------------------------------


def test_park_export_hand_off() -> None:
    p = Pools()
    h = p.ledger
    seq = p.running("a", 6)
    h.park(seq)
    assert seq.status is SeqStatus.PARKED and not p.scheduler.has_unfinished()
    assert h.parked("a") is seq and h.phase("a") is Phase.PARKED and h.num_exported == 0
    with pytest.raises(InvalidRequestError, match="never exported"):
        h.hand_off("a")
    h.export("a")
    h.export("a")  # again (e.g. a retry): still exported
    assert h.phase("a") is Phase.EXPORTED and h.num_exported == 1
    assert h.hand_off("a") is seq and seq.finish_reason == "handoff"
    assert h.hand_off("a") is None  # aborted or handed off already: nothing to do
    p.check_idle()


@pytest.mark.parametrize(
    "phase", ["waiting", "reserved", "receiving", "imported", "local", "parked", "exported"]
)
def test_abort_in_every_phase_frees_everything(phase: str) -> None:
    p = Pools(num_blocks=8)
    h = p.ledger
    seq: Sequence | None = None
    if phase in ("parked", "exported"):
        seq = p.running("a", 6)
        h.park(seq)
        if phase == "exported":
            h.export("a")
    else:
        if phase == "waiting":
            h.enqueue("first", 5, 23, 30.0)  # commits 6 pages: a waits behind it
            h.grant()
        h.enqueue("a", 5, 9, 30.0)
        h.grant()
        if phase in ("receiving", "imported"):
            assert h.begin_receive("a", 5)
        if phase == "imported":
            seq = p.imported("a", 4)
            h.import_(seq)
        if phase == "local":
            h.take_over("a", 9)
    assert h.phase("a") is Phase(phase)
    ended = h.abort("a")
    if phase in ("parked", "exported"):
        assert ended is seq and seq is not None and seq.finish_reason == "abort"
    else:
        assert ended is None
    if phase == "imported":  # the running sequence is the scheduler's to end (the engine does)
        assert seq is not None
        p.scheduler.finish(seq, "abort")
    assert h.phase("a") is None and h.abort("a") is None
    h.abort("first")
    p.check_idle()


# ---- on a tiny engine: the engine owns one ledger and check_idle reads it ----------------------------


def test_engine_check_idle_sees_the_ledger(tiny_model_dir) -> None:
    eng = small_engine(tiny_model_dir("llama"), hicache_gb=0)
    eng.handoffs.enqueue("r", 5, 9, 30.0)
    with pytest.raises(AssertionError, match="P/D lifecycle not empty"):
        eng.check_idle()
    assert eng.handoffs.grant() == [Grant("r")]
    eng.abort("r")
    eng.check_idle()
    # PE: a prefill-only request parks after its first token, holding its memory, until aborted
    eng.add_request("p", [3, 4, 5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), prefill_only=True)
    (out,) = eng.step()
    assert out.is_handoff_ready and eng.handoffs.phase("p") is Phase.PARKED and not eng.has_unfinished()
    with pytest.raises(AssertionError):
        eng.check_idle()
    eng.abort("p")
    (final,) = eng.step()
    assert final.is_finished and final.finish_reason == "abort"
    eng.check_idle()
