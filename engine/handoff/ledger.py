"""HandoffLedger: the one owner of a sequence's P/D lifecycle in an engine (LLMEngine.handoffs). The
memory an export or import moves is engine/handoff/pages.py's."""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.decode_cache import DecodeCache
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.errors import InvalidRequestError
from engine.request import SamplingParams

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    PARKED = "parked"  # PE: prefilled, first token sampled, memory held for the export
    EXPORTED = "exported"  # PE: gathered for a handoff; memory held until the ack or an abort
    WAITING = "waiting"  # CE: reservation asked for, queued (FIFO) until memory and commits allow
    RESERVED = "reserved"  # CE: memory held for the handoff until deadline_s
    RECEIVING = "receiving"  # CE: the receiver took the offer; expiry waits for the outcome
    IMPORTED = "imported"  # CE: decoding from imported KV; its commit stays until it finishes
    LOCAL = "local"  # CE: prefilled here instead (fallback); its commit stays until it finishes


HOLDS_MEMORY = (Phase.RESERVED, Phase.RECEIVING)  # a placeholder sequence owns the reserved memory
COMMITTED = (Phase.RESERVED, Phase.RECEIVING, Phase.IMPORTED, Phase.LOCAL)


@dataclass
class _Entry:
    phase: Phase
    seq: Sequence | None = None  # PARKED/EXPORTED: the sequence; RESERVED/RECEIVING: the placeholder
    num_tokens: int = 0  # CE: tokens the reservation holds memory for
    commit_blocks: int = 0  # CE: pages the whole decode may take (counted from RESERVED on)
    ttl_s: float = 0.0
    deadline_s: float = 0.0
    token_ids: list[int] | None = None  # WAITING: the prompt, matched against the decode cache at grant
    held_token_ids: list[int] = field(default_factory=list)  # RESERVED/RECEIVING: tokens of the held pages
    # RESERVED/RECEIVING: a sender may write into the placeholder's fresh pages until this time (inf while
    # a receive in place is under way, hold_s past its failure; 0: no write in flight)
    landing_until: float = 0.0
    hold_s: float = 0.0  # how long a sender may go on writing after a receive in place failed


@dataclass(frozen=True)
class Grant:
    """grant()'s answer to one waiting reservation: granted (error None) or refused. num_held_tokens:
    the leading tokens whose pages this engine holds already (whole pages; 0 without a decode cache
    hit): the handoff may start at page num_held_tokens // block_size."""

    request_id: str
    error: InvalidRequestError | None = None
    num_held_tokens: int = 0


@dataclass(frozen=True)
class Expired:
    request_id: str
    ttl_s: float


class HandoffLedger:
    """Every P/D state of a sequence, and the transitions between them.

        PE   running ─park─► PARKED ─export─► EXPORTED ─hand_off─► gone (freed, no further output)
        CE   enqueue ─► WAITING ─grant─► RESERVED ─begin_receive─► RECEIVING ─import_─► IMPORTED ─end─► gone
                        (FIFO)             │ expire (deadline)  ◄─receive_failed─┘ refuse_import: gone
                                           └ take_over (AddRequest: local prefill) ─► LOCAL ─end─► gone
        abort: gone from every state, everything freed.

    Invariants:
    - A request id is in at most one phase; ids here never collide with a live sequence's
      (grant refuses a taken id, and a live sequence takes over only through take_over or import_).
    - PARKED/EXPORTED sequences are out of the scheduler's queues and own their memory until
      hand_off or abort; no step touches them.
    - RESERVED/RECEIVING hold memory through a placeholder sequence of num_tokens tokens (allocated
      with Scheduler.allocate, as the import will need it), and count against max_num_seqs.
    - Commits: a reservation is granted only if it fits now (can_import) AND the commit_blocks of
      every RESERVED, RECEIVING, IMPORTED and LOCAL request plus its own fit in the pool, so no
      admitted sequence is ever preempted (on a CE that would mean a prefill). A commit ends when its
      request does (end, abort, expire, refuse_import).
    - WAITING is served in arrival order: the head waits, those behind it wait too.
    - Only RESERVED expires; RECEIVING waits for the receiver's outcome (import_ or receive_failed).
    - Empty when the engine is idle (check_idle).

    A reservation's memory, with a decode cache (engine/core/decode_cache.py) and the prompt's token ids:

        placeholder.block_ids  [ held 0 .. h-1 | fresh h .. blocks_for(num_tokens + 1) - 1 ]
                                 pinned at grant: the longest run of cached pages matching the prompt,
                                 at most the pages fully inside tokens [0, num_tokens - 1) (an import
                                 has every token but the last computed); h = num_held_tokens / bs
        import_(seq, first_page)   0: the whole placeholder is released (held pages back to evictable,
                                      still cached) and seq gets fresh pages: a full handoff
                                   1..h: seq keeps held[:first_page] (their tokens verified against
                                      seq's), the rest is released and allocated anew for seq
        abort, expire, refuse_import, take_over: the placeholder is released, held pages included.

    A receive in place (land_in_place: a one-sided transport writes the pages straight into the
    placeholder's fresh pages and its SWA slot, nixl) leaves the import nothing to copy: import_(seq,
    first_page, landed) gives seq the placeholder's memory itself. Until the receive ends (landed) a write
    may be landing there, and for hold_s after it failed (receive_failed: the sender's own bound on its
    write): a placeholder released meanwhile (abort, expire, take_over, a full import elsewhere) is
    quarantined, its memory kept from every other sequence until then and counted as committed
    (expire frees it after).

    NOTE: the receiver's thread calls begin_receive and receive_failed; every method holds self._lock,
    so those two are safe from any thread. Everything else is called on the engine thread only (it
    changes the scheduler, through the scheduler's own methods).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        max_num_seqs: int,
        clock: Callable[[], float] = time.monotonic,
        decode_cache: DecodeCache | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._decode_cache = decode_cache
        self._max_num_seqs = max_num_seqs
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._queue: deque[str] = deque()  # WAITING ids, in arrival order
        self._quarantine: list[tuple[float, Sequence]] = []  # (until, placeholder): a write may still land
        self.num_total_blocks = scheduler.blocks.num_blocks
        self.num_imported_total = 0
        self.num_expired_total = 0

    # ---- queries ------------------------------------------------------------------------------

    def phase(self, request_id: str) -> Phase | None:
        with self._lock:
            entry = self._entries.get(request_id)
            return entry.phase if entry is not None else None

    def _count(self, *phases: Phase) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.phase in phases)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_held(self) -> int:
        """Reservations holding memory (RESERVED or RECEIVING)."""
        return self._count(*HOLDS_MEMORY)

    @property
    def num_exported(self) -> int:
        """PE: handoffs in flight."""
        return self._count(Phase.EXPORTED)

    @property
    def num_committed_blocks(self) -> int:
        with self._lock:
            return self._committed_blocks()

    def _committed_blocks(self) -> int:
        held = sum(len(q.block_ids) for _, q in self._quarantine)
        return held + sum(e.commit_blocks for e in self._entries.values() if e.phase in COMMITTED)

    @property
    def num_quarantined_blocks(self) -> int:
        """Pages of released reservations that a failed receive in place may still write into."""
        with self._lock:
            return sum(len(q.block_ids) for _, q in self._quarantine)

    def parked(self, request_id: str) -> Sequence | None:
        """The PARKED or EXPORTED sequence of request_id."""
        with self._lock:
            entry = self._entries.get(request_id)
            return entry.seq if entry is not None and entry.phase in (Phase.PARKED, Phase.EXPORTED) else None

    def held_tokens(self, request_id: str) -> int:
        """RESERVED/RECEIVING: the leading tokens whose pages the reservation holds already (whole
        pages); 0 otherwise."""
        with self._lock:
            entry = self._entries.get(request_id)
            return len(entry.held_token_ids) if entry is not None and entry.phase in HOLDS_MEMORY else 0

    def blocks_for_decode(self, num_tokens: int) -> int:
        """Pages a sequence of num_tokens needs, its next token included (a commit's unit)."""
        return self._scheduler.blocks_for(num_tokens + 1)

    def can_import(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens fits now: memory free and a batch row left."""
        with self._lock:
            return self._can_import(num_tokens)

    def _can_import(self, num_tokens: int, num_held_blocks: int = 0) -> bool:
        num_holding = sum(1 for e in self._entries.values() if e.phase in HOLDS_MEMORY)
        busy = len(self._scheduler.running) + num_holding
        return self._scheduler.can_admit(num_tokens, num_held_blocks) and busy < self._max_num_seqs

    # ---- PE side (engine thread) --------------------------------------------------------------

    def park(self, seq: Sequence) -> None:
        """running -> PARKED: a prefill-only sequence after its first token."""
        with self._lock:
            self._scheduler.park(seq)
            self._entries[seq.request_id] = _Entry(Phase.PARKED, seq)

    def export(self, request_id: str) -> None:
        """PARKED -> EXPORTED (once its state was gathered for a handoff; exporting again is allowed)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.phase is Phase.PARKED:
                entry.phase = Phase.EXPORTED

    def hand_off(self, request_id: str) -> Sequence | None:
        """EXPORTED -> gone: the receiver owns it now; frees it. None if it was aborted meanwhile."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.phase not in (Phase.PARKED, Phase.EXPORTED):
                return None
            if entry.phase is Phase.PARKED:
                raise InvalidRequestError(f"request {request_id!r} was never exported")
            del self._entries[request_id]
            assert entry.seq is not None
            self._scheduler.finish(entry.seq, "handoff")
            return entry.seq

    # ---- CE side ------------------------------------------------------------------------------

    def enqueue(
        self,
        request_id: str,
        num_tokens: int,
        num_commit_tokens: int,
        ttl_s: float,
        token_ids: list[int] | None = None,
    ) -> None:
        """-> WAITING: memory for num_tokens, to be held ttl_s once granted, and num_commit_tokens
        (prompt + max_tokens) committed. token_ids (the prompt): the grant holds the pages of its
        longest prefix the decode cache has. Raises InvalidRequestError if it can never be granted."""
        need = self.blocks_for_decode(num_commit_tokens)
        if need > self.num_total_blocks:
            raise InvalidRequestError(
                f"{num_commit_tokens} tokens need more KV memory than this engine has "
                f"({self.num_total_blocks} pages)",
                "max_tokens",
            )
        with self._lock:
            if request_id in self._entries:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
            self._entries[request_id] = _Entry(
                Phase.WAITING,
                num_tokens=num_tokens,
                commit_blocks=need,
                ttl_s=ttl_s,
                token_ids=list(token_ids) if token_ids and self._decode_cache is not None else None,
            )
            self._queue.append(request_id)

    def grant(self) -> list[Grant]:
        """WAITING -> RESERVED in arrival order while the head fits (never overcommits); an id that a
        live sequence took meanwhile is refused. Returns what was decided, in order."""
        out: list[Grant] = []
        with self._lock:
            if not self._queue:
                return out
            committed = self._committed_blocks()
            while self._queue:
                rid = self._queue[0]
                entry = self._entries[rid]
                if committed + entry.commit_blocks > self.num_total_blocks:
                    break
                if self._scheduler.find(rid) is not None:
                    self._queue.popleft()
                    del self._entries[rid]
                    taken = InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
                    out.append(Grant(rid, taken))
                    continue
                if not self._can_import(entry.num_tokens):
                    break
                self._queue.popleft()
                placeholder = Sequence(rid, [0] * (entry.num_tokens - 1), SamplingParams(), 0, self._clock())
                placeholder.output_token_ids = [0]
                held = self._hold_cached(entry)  # NOTE: pinned before the allocation, which may evict
                self._scheduler.allocate(placeholder, held)
                entry.phase, entry.seq = Phase.RESERVED, placeholder
                entry.deadline_s = self._clock() + entry.ttl_s
                committed += entry.commit_blocks
                out.append(Grant(rid, num_held_tokens=len(entry.held_token_ids)))
        return out

    def _hold_cached(self, entry: _Entry) -> list[int]:
        """Pins the decode cache's pages of entry's prompt (at most those fully inside the computed
        tokens [0, num_tokens - 1)); returns them. can_admit(num_tokens) passed, so the rest still fits:
        pinning h pages takes at most h from num_free and the placeholder then allocates h fewer."""
        token_ids, entry.token_ids = entry.token_ids, None
        if token_ids is None or self._decode_cache is None:
            return []
        bs = self._decode_cache.block_size
        limit = max(0, min(len(token_ids), entry.num_tokens - 1)) // bs * bs
        num_held, block_ids = self._decode_cache.match(token_ids[:limit])
        self._scheduler.blocks.share(block_ids)
        entry.held_token_ids = token_ids[:num_held]
        return block_ids

    def begin_receive(self, request_id: str, num_tokens: int) -> bool:
        """RESERVED -> RECEIVING: the receiver takes an offer of num_tokens (any thread). False:
        refuse it (not reserved here, already being received, or more than was reserved)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.phase is not Phase.RESERVED:
                return False
            if num_tokens > entry.num_tokens:
                log.warning(
                    "handoff %r brings %d tokens, %d reserved", request_id, num_tokens, entry.num_tokens
                )
                return False
            entry.phase = Phase.RECEIVING
            return True

    def receive_failed(self, request_id: str) -> None:
        """RECEIVING -> RESERVED: nothing was delivered (any thread); the deadline stands. After a
        receive in place the sender may go on writing for hold_s: the memory is kept that long."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.phase is Phase.RECEIVING:
                entry.phase = Phase.RESERVED
                if entry.landing_until == math.inf:
                    entry.landing_until = self._clock() + entry.hold_s

    def land_in_place(self, request_id: str, first_page: int, num_pages: int, hold_s: float) -> tuple[list[int], int] | None:
        """RECEIVING: the blocks for pages [first_page, num_pages) and the SWA slot (-1: none) a sender may
        write straight into (any thread), or None where it must not: pages [first_page, held) are the
        decode cache's, shared (a full handoff over held pages writes fresh ones). From now on a write
        may land there: hold_s, how long the sender may go on after a failure."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.phase is not Phase.RECEIVING or entry.seq is None:
                return None
            bs = self._scheduler.config.block_size
            if first_page * bs != len(entry.held_token_ids) or num_pages > len(entry.seq.block_ids):
                return None
            entry.landing_until, entry.hold_s = math.inf, hold_s
            return entry.seq.block_ids[first_page:num_pages], entry.seq.state_slot

    def landed(self, request_id: str) -> None:
        """RECEIVING: a receive in place has ended, verified: no write is in flight (any thread)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.phase is Phase.RECEIVING:
                entry.landing_until = 0.0

    def import_(self, seq: Sequence, first_page: int = 0, landed: tuple[tuple[int, ...], int] | None = None) -> None:
        """(RESERVED | RECEIVING | none) -> IMPORTED: seq, every token but the last computed, gets the
        reservation's memory (or free memory) and goes straight into the running batch, keeping the
        reservation's commit. first_page > 0: seq's pages [0, first_page) are the reservation's held
        pages, which must hold exactly seq's tokens there (else InvalidRequestError, nothing changed);
        seq.block_ids[first_page:] are for the received pages. landed: (block ids, SWA slot) where the
        pages from first_page on and the state were received in place (land_in_place): seq takes the
        placeholder's memory itself, which must be those (else InvalidRequestError, nothing changed).
        Raises MemoryError if it does not fit (the reservation is gone then)."""
        rid = seq.request_id
        with self._lock:
            entry = self._entries.get(rid)
            commit = 0
            kept: list[int] = []
            if entry is not None and entry.phase not in HOLDS_MEMORY:
                raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
            if landed is not None:
                self._adopt(seq, first_page, landed, entry)
                return
            if first_page:
                bs = self._scheduler.config.block_size
                num_held = len(entry.held_token_ids) if entry is not None else 0
                if first_page < 0 or first_page * bs > min(num_held, seq.num_computed):
                    raise InvalidRequestError(  # NOTE: a held page is never written: all of it computed
                        f"handoff of {rid!r} starts at page {first_page}; this engine holds {num_held // bs} "
                        f"pages of it, {seq.num_computed} tokens computed"
                    )
                assert entry is not None and entry.seq is not None
                if seq.token_ids(0, first_page * bs) != entry.held_token_ids[: first_page * bs]:
                    raise InvalidRequestError(f"handoff of {rid!r}: the held pages hold other tokens")
                kept, entry.seq.block_ids = entry.seq.block_ids[:first_page], entry.seq.block_ids[first_page:]
            if entry is not None:
                del self._entries[rid]
                self._release(entry)  # its memory (but the kept pages) goes to seq just below
                commit = entry.commit_blocks
            if not self._can_import(seq.num_tokens, len(kept)):
                self._scheduler.blocks.free(kept)
                raise MemoryError("no free KV memory for the imported sequence")
            self._scheduler.allocate(seq, kept)
            self._scheduler.admit_prefilled(seq)
            self._entries[rid] = _Entry(Phase.IMPORTED, commit_blocks=commit)
            self.num_imported_total += 1

    def _adopt(self, seq: Sequence, first_page: int, landed: tuple[tuple[int, ...], int], entry: _Entry | None) -> None:
        """import_ of a receive in place (under _lock): seq takes the placeholder's pages and slot."""
        rid, (block_ids, slot) = seq.request_id, landed
        holder = entry.seq if entry is not None else None
        bs = self._scheduler.config.block_size
        need = self._scheduler.blocks_for(seq.num_tokens + 1)
        if (
            entry is None
            or holder is None
            or first_page * bs != len(entry.held_token_ids)
            or tuple(holder.block_ids[first_page : first_page + len(block_ids)]) != tuple(block_ids)
            or holder.state_slot != slot
            or need > len(holder.block_ids)
        ):
            raise InvalidRequestError(f"handoff of {rid!r}: received in place into memory not its reservation's")
        if first_page and seq.token_ids(0, first_page * bs) != entry.held_token_ids:
            raise InvalidRequestError(f"handoff of {rid!r}: the held pages hold other tokens")
        seq.block_ids, holder.block_ids = holder.block_ids[:need], holder.block_ids[need:]
        seq.state_slot, holder.state_slot = holder.state_slot, -1
        del self._entries[rid]
        entry.landing_until = 0.0  # the import has the pages: nothing is landing any more
        self._release(entry)  # the pages seq does not need
        self._scheduler.admit_prefilled(seq)
        self._entries[rid] = _Entry(Phase.IMPORTED, commit_blocks=entry.commit_blocks)
        self.num_imported_total += 1

    def refuse_import(self, request_id: str) -> None:
        """RESERVED | RECEIVING -> gone: the handoff was refused; the memory and commit are freed."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.phase in HOLDS_MEMORY:
                del self._entries[request_id]
                self._release(entry)

    def take_over(self, request_id: str, num_commit_tokens: int) -> None:
        """-> LOCAL: the request is prefilled here after all (AddRequest on a CE). A held reservation's
        memory is freed (the scheduler allocates its own) and its commit kept; a waiting one leaves
        the queue; without either, num_commit_tokens are committed now."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.phase not in (Phase.WAITING, *HOLDS_MEMORY):
                return  # it is this engine's already
            if entry is not None and entry.phase is Phase.WAITING:
                self._queue.remove(request_id)
                entry = None
            if entry is not None:
                self._release(entry)
                commit = entry.commit_blocks
            else:
                commit = self.blocks_for_decode(num_commit_tokens)
            self._entries[request_id] = _Entry(Phase.LOCAL, commit_blocks=commit)

    def expire(self) -> list[Expired]:
        """RESERVED past its deadline -> gone, memory and commit freed; and the quarantined memory of
        released reservations freed once no write can land in it any more."""
        now = self._clock()
        with self._lock:
            if self._quarantine:
                for _, q in (due := [x for x in self._quarantine if x[0] <= now]):
                    self._scheduler.release(q)
                self._quarantine = [x for x in self._quarantine if x[0] > now]
                if due:
                    log.info("freed the pages of %d reservations after a failed receive in place", len(due))
            late = [
                rid for rid, e in self._entries.items() if e.phase is Phase.RESERVED and now > e.deadline_s
            ]
            out = []
            for rid in late:
                entry = self._entries.pop(rid)
                self._release(entry)
                out.append(Expired(rid, entry.ttl_s))
            self.num_expired_total += len(out)
            return out

    # ---- any phase ----------------------------------------------------------------------------

    def end(self, request_id: str) -> None:
        """IMPORTED | LOCAL -> gone: the request finished; its commit ends."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.phase in (Phase.IMPORTED, Phase.LOCAL):
                del self._entries[request_id]

    def abort(self, request_id: str) -> Sequence | None:
        """Any phase -> gone, everything freed. Returns the PARKED/EXPORTED sequence it finished
        ("abort"), which owes its caller a final output; IMPORTED/LOCAL sequences stay the
        scheduler's to end (only their commit goes here)."""
        with self._lock:
            entry = self._entries.pop(request_id, None)
            if entry is None:
                return None
            if entry.phase is Phase.WAITING:
                self._queue.remove(request_id)
            elif entry.phase in HOLDS_MEMORY:
                self._release(entry)
            elif entry.phase in (Phase.PARKED, Phase.EXPORTED):
                assert entry.seq is not None
                self._scheduler.finish(entry.seq, "abort")
                return entry.seq
            return None

    def _release(self, entry: _Entry) -> None:
        """Frees a placeholder's memory, or quarantines it while a sender's write may still land there."""
        assert entry.seq is not None
        until = entry.landing_until
        if until == math.inf:  # a receive in place under way: its sender stops writing within hold_s
            until = self._clock() + entry.hold_s
        if until > self._clock():
            self._quarantine.append((until, entry.seq))
        else:
            self._scheduler.release(entry.seq)
        entry.seq = None

    def check_idle(self) -> None:
        """Nothing in any phase; raises otherwise."""
        with self._lock:
            if self._quarantine:
                raise AssertionError(f"P/D lifecycle holds {len(self._quarantine)} quarantined reservations")
            if self._entries or self._queue:
                left = {rid: e.phase.value for rid, e in list(self._entries.items())[:8]}
                raise AssertionError(f"P/D lifecycle not empty: {len(self._entries)} requests, e.g. {left}")
