"""CE decode cache: evictable pages in the block pool (counted free, LRU tail first, pinned by share),
the index (hash chain, token-by-token check, retain), reservations that hold cached pages, and multi-turn
P/D conversations between two in-process engines whose later turns hand over only the pages the CE
lacks: token-identical with a single engine and with the cache off, after an eviction, after an edit."""

from __future__ import annotations

import time

import pytest
import torch

from engine.core.block_pool import BlockPool
from engine.core.decode_cache import DecodeCache
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.sequence import Sequence
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.handoff import SequenceExport
from engine.handoff.ledger import Grant, HandoffLedger, Phase
from engine.request import SamplingParams
from tests.engine_utils import small_engine

BS = 4  # unit tests: tokens per page


# ---- block pool ---------------------------------------------------------------------------------------


def test_evictable_pages_count_free_and_are_evicted_tail_first() -> None:
    pool = BlockPool(6)
    evicted: list[int] = []
    pool.set_on_evict(evicted.append)
    chain = pool.allocate(4)  # [0, 1, 2, 3]
    for b in chain[:3]:
        pool.mark_cached(b)
    pool.free(chain)
    assert (pool.num_free, pool.num_evictable, pool.num_used) == (6, 3, 0) and pool.can_allocate(6)
    pool.check_idle()  # evictable pages are idle
    assert pool.allocate(3) == [4, 5, 3] and evicted == []  # truly free pages first
    assert pool.allocate(2) == [2, 1] and evicted == [2, 1]  # then the LRU: the chain's tail first
    pool.share([0])  # pins the last evictable page
    assert pool.refcount(0) == 1 and pool.num_evictable == 0 and pool.num_free == 0
    with pytest.raises(ValueError, match="not referenced"):
        BlockPool(2).mark_cached(0)
    pool.free([4])
    with pytest.raises(ValueError, match="is free"):
        pool.share([4])  # a truly free page cannot be shared
    with pytest.raises(AssertionError, match="still referenced"):
        pool.check_idle()
    pool.free([5, 3, 2, 1, 0])  # 0 is still cached: back to the LRU
    assert pool.num_evictable == 1 and pool.is_cached(0)
    pool.check_idle()
    with pytest.raises(ValueError, match="already has an index"):
        pool.set_on_evict(evicted.append)


def test_a_pool_without_an_index_is_a_plain_free_list() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    pool.free(a)
    assert pool.num_evictable == 0 and pool.allocate(4) == [3, 0, 1, 2]  # the order as always
    pool.free([0, 1, 2, 3])
    pool.check_idle()


# ---- index ----------------------------------------------------------------------------------------------


def test_match_verifies_tokens_and_stops_at_the_first_differing_page() -> None:
    pool = BlockPool(8)
    cache = DecodeCache(pool, BS)
    tokens = list(range(100, 110))  # 10 computed tokens: pages 0 and 1 are full
    blocks = pool.allocate(3)
    assert cache.retain(tokens, blocks) == 2 and cache.num_retained_pages == 2
    pool.free(blocks)
    assert pool.num_evictable == 2 and pool.num_used == 0 and pool.num_free == 8
    assert cache.match(tokens + [7, 7, 7]) == (8, blocks[:2])
    edited = list(tokens)
    edited[5] = 1  # page 1 differs
    assert cache.match(edited) == (4, blocks[:1])
    assert cache.match([1] + tokens[1:]) == (0, [])
    assert cache.match(tokens[:7]) == (4, blocks[:1])  # whole pages only
    assert (cache.counters.lookups, cache.counters.hit_tokens) == (4, 8 + 4 + 0 + 4)
    # another sequence with the same first page in another block: not indexed twice, simply freed
    other = pool.allocate(2)
    assert cache.retain(tokens[:4] + [9, 9, 9, 9], other) == 1
    pool.free(other)
    assert cache.num_retained_pages == 3 and not pool.is_cached(other[0]) and pool.is_cached(other[1])
    cache.check_idle()
    pool.check_idle()


def test_eviction_drops_the_tail_first_and_is_counted() -> None:
    pool = BlockPool(4)
    cache = DecodeCache(pool, BS)
    tokens = list(range(200, 213))
    blocks = pool.allocate(4)
    cache.retain(tokens, blocks)  # 13 computed tokens: 3 full pages
    pool.free(blocks)
    assert pool.allocate(1) == [blocks[3]]  # the partial page was free
    taken = pool.allocate(1)  # evicts the chain's last page
    assert taken == [blocks[2]] and cache.counters.evictions == 1
    assert cache.match(tokens) == (8, blocks[:2])  # the head still matches
    pool.free([blocks[3], *taken])
    cache.check_idle()
    pool.check_idle()


# ---- reservations that hold cached pages (no model) -------------------------------------------------------


class CachedPools:
    def __init__(self, num_blocks: int = 16) -> None:
        self.blocks, self.slots = BlockPool(num_blocks), BlockPool(4)
        config = SchedulerConfig(4, 64, BS, needs_blocks=True, needs_state_slot=True)
        self.scheduler = Scheduler(config, self.blocks, self.slots)
        self.cache = DecodeCache(self.blocks, BS)
        self.ledger = HandoffLedger(self.scheduler, 4, decode_cache=self.cache)

    def retained(self, tokens: list[int]) -> list[int]:
        """A finished sequence with tokens[:-1] computed, its pages retained; returns its pages."""
        blocks = self.blocks.allocate(self.scheduler.blocks_for(len(tokens)))
        self.cache.retain(tokens[:-1], blocks)
        self.blocks.free(blocks)
        return blocks

    def check_idle(self) -> None:
        self.ledger.check_idle()
        self.blocks.check_idle()
        self.slots.check_idle()
        self.cache.check_idle()


def _imported(rid: str, prompt: list[int]) -> Sequence:
    seq = Sequence(rid, list(prompt), SamplingParams(max_tokens=4), 0, 0.0)
    seq.output_token_ids = [7]
    seq.num_computed = len(prompt)
    return seq


def test_a_grant_holds_cached_pages_and_an_import_keeps_them() -> None:
    p = CachedPools()
    h = p.ledger
    history = list(range(50, 63))  # 13 tokens: 12 computed, 3 full pages retained
    pages = p.retained(history)
    prompt = history + [5, 6, 7]  # the next turn: 16 tokens
    h.enqueue("a", len(prompt) + 1, len(prompt) + 8, 30.0, token_ids=prompt)
    assert h.grant() == [Grant("a", num_held_tokens=12)] and h.held_tokens("a") == 12
    assert [p.blocks.refcount(b) for b in pages[:3]] == [1, 1, 1]  # pinned
    assert h.begin_receive("a", len(prompt) + 1)
    with pytest.raises(InvalidRequestError, match="holds 3 pages"):
        h.import_(_imported("a", prompt), first_page=4)
    with pytest.raises(InvalidRequestError, match="other tokens"):
        h.import_(_imported("a", [0] + prompt[1:]), first_page=1)
    assert h.phase("a") is Phase.RECEIVING  # refused: nothing changed
    seq = _imported("a", prompt)
    h.import_(seq, first_page=3)
    assert seq.block_ids[:3] == pages[:3] and h.held_tokens("a") == 0 and h.phase("a") is Phase.IMPORTED
    p.scheduler.finish(seq, "stop")
    h.end("a")
    p.check_idle()


def test_at_most_the_computed_tokens_pages_are_held() -> None:
    p = CachedPools()
    h = p.ledger
    history = list(range(50, 63))
    p.retained(history)
    h.enqueue("short", 9, 12, 30.0, token_ids=history[:8])  # 8 computed tokens: 2 pages
    h.enqueue("edge", 8, 12, 30.0, token_ids=history[:7])  # 7 computed tokens: 1 page
    h.enqueue("none", 9, 12, 30.0)  # no token ids: no lookup
    assert h.grant() == [Grant("short", num_held_tokens=8), Grant("edge", num_held_tokens=4), Grant("none")]
    assert p.cache.counters.lookups == 2
    for rid in ("short", "edge", "none"):
        h.abort(rid)
    p.check_idle()


@pytest.mark.parametrize("end", ["abort", "expire", "refuse_import", "take_over", "full_import"])
def test_every_end_of_a_holding_reservation_unpins(end: str) -> None:
    p = CachedPools()
    h = p.ledger
    history = list(range(50, 63))
    p.retained(history)
    prompt = history + [5]
    h.enqueue("a", len(prompt) + 1, len(prompt) + 4, 0.0 if end == "expire" else 30.0, token_ids=prompt)
    assert h.grant() == [Grant("a", num_held_tokens=12)]
    assert p.blocks.num_evictable == 0
    if end == "abort":
        h.abort("a")
    elif end == "expire":
        time.sleep(0.01)
        assert [e.request_id for e in h.expire()] == ["a"]
    elif end == "refuse_import":
        assert h.begin_receive("a", len(prompt) + 1)
        h.refuse_import("a")
    elif end == "take_over":
        h.take_over("a", len(prompt) + 4)
        h.end("a")
    else:  # a full handoff: fresh pages, the held ones go back to the cache
        seq = _imported("a", prompt)
        h.import_(seq)
        assert p.blocks.num_evictable == 3 and not any(p.blocks.is_cached(b) for b in seq.block_ids)
        p.scheduler.finish(seq, "stop")
        h.end("a")
    assert p.blocks.num_evictable == 3 and p.cache.num_retained_pages == 3
    p.check_idle()


# ---- multi-turn P/D between two engines --------------------------------------------------------------------

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _user(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=gen).tolist()


def _handoff(
    pe: LLMEngine, ces: list[LLMEngine], rid: str, prompt: list[int], skip_held: bool = True
) -> list[tuple[list[int], int]]:
    """One P/D turn, the PE's prefill handed to each CE: the CE reserves (with the prompt), the PE
    exports the pages it lacks, the CE imports and decodes. Returns (output tokens, tokens held) per CE."""
    bs = pe.layout.block_size
    held: list[int] = []
    for ce in ces:
        ce.handoffs.enqueue(rid, len(prompt) + 1, len(prompt) + PARAMS.max_tokens, 30.0, token_ids=prompt)
        (grant,) = ce.handoffs.grant()
        assert grant.error is None and grant.num_held_tokens == ce.handoffs.held_tokens(rid)
        held.append(grant.num_held_tokens)
    pe.add_request(rid, prompt, PARAMS, prefill_only=True)
    while pe.has_unfinished():
        pe.step()
    out = []
    for ce, num_held in zip(ces, held):
        skip = num_held // bs if skip_held else 0
        exp = pe.export_sequence(rid, skip_pages=skip)  # once per CE (exporting again is allowed)
        assert exp.first_page == skip and exp.pages.shape[0] == pe.layout.num_pages(len(prompt)) - skip
        assert ce.handoffs.begin_receive(rid, len(prompt) + 1)
        ce.import_sequence(exp)
        tokens: list[int] = []
        while ce.has_unfinished():
            for o in ce.step():
                tokens += o.new_token_ids
        ce.check_idle()
        out.append((tokens, num_held))
    pe.finish_handoff(rid)
    pe.check_idle()
    return out


def _evict_everything(ce: LLMEngine) -> None:
    """Another request's reservation takes every page: the cached ones are evicted."""
    n = ce.blocks.num_free * ce.layout.block_size - 1
    ce.handoffs.enqueue("filler", n, n, 30.0)
    assert ce.handoffs.grant() == [Grant("filler")]
    ce.abort("filler")


@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid", "deepseek_v3"])
def test_multi_turn_handoffs_send_only_the_missing_pages(tiny_model_dir, family: str) -> None:
    folder = tiny_model_dir(family)
    kw = dict(is_deterministic=True, hicache_gb=0)
    ref, pe = small_engine(folder, **kw), small_engine(folder, **kw)
    ce, ce_off = small_engine(folder, **kw), small_engine(folder, decode_cache=False, **kw)
    assert ce.decode_cache is not None and ce_off.decode_cache is None
    bs = ce.layout.block_size
    gen = torch.Generator().manual_seed(3)
    prompt = _user(gen, 24)
    hits = computed_before = 0  # computed_before: the tokens the previous turn had computed on the CE
    for turn in range(5):
        rid = f"turn{turn}"
        if turn == 4:
            prompt[20] = 3 if prompt[20] != 3 else 4  # an edited history: page 1 differs
        # turn 1: a full handoff all the same, into a reservation that held pages
        (tokens, held), (off_tokens, off_held) = _handoff(pe, [ce, ce_off], rid, prompt, skip_held=turn != 1)
        (single,) = ref.generate([prompt], PARAMS)
        assert tokens == off_tokens == single.output_token_ids, f"turn {turn}"
        expected = {3: 0, 4: bs}.get(turn, computed_before // bs * bs)  # 3: evicted; 4: edited in page 1
        assert (held, off_held) == (expected, 0), f"turn {turn}"
        assert held > 0 or turn in (0, 3)
        hits += held
        if turn == 2:
            retained = ce.stats().decode_cache_retained_pages
            _evict_everything(ce)
            assert ce.stats().decode_cache_evictions_total == retained > 0
            ce.check_idle()
        computed_before = len(prompt) + len(tokens) - 1
        prompt = prompt + tokens + _user(gen, 5 + turn % 3)
    s = ce.stats()
    assert (s.decode_cache_lookups_total, s.decode_cache_hit_tokens_total) == (5, hits)
    assert s.decode_cache_retained_pages > 0 and s.num_free_blocks == s.num_total_blocks
    assert ce_off.stats().decode_cache_lookups_total == 0


def test_reservation_ends_and_local_prefill_leave_nothing_pinned(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    ce = small_engine(folder, hicache_gb=0)
    bs = ce.layout.block_size
    history = list(range(3, 60))
    # a CE's local prefill (take_over) is retained at its end; a colocated request is not
    ce.generate([list(range(100, 150))], PARAMS)
    assert ce.stats().decode_cache_retained_pages == 0
    ce.handoffs.take_over("local", len(history) + PARAMS.max_tokens)
    ce.add_request("local", history, PARAMS)
    while ce.has_unfinished():
        ce.step()
    ce.check_idle()
    num_computed = len(history) + PARAMS.max_tokens - 1
    assert ce.stats().decode_cache_retained_pages == num_computed // bs
    prompt = history + [7] * 30

    def reserve(rid: str, ttl_s: float = 30.0, token_ids: list[int] | None = prompt) -> int:
        ce.handoffs.enqueue(rid, len(prompt) + 1, len(prompt) + 4, ttl_s, token_ids=token_ids)
        (grant,) = ce.handoffs.grant()
        return grant.num_held_tokens

    assert reserve("abort") == len(history) // bs * bs
    ce.abort("abort")
    ce.check_idle()
    assert reserve("expire", ttl_s=0.0) > 0
    time.sleep(0.01)
    assert [e.request_id for e in ce.handoffs.expire()] == ["expire"]
    ce.check_idle()
    # an import that claims held pages the reservation does not have, or with other tokens there
    pages = torch.zeros(ce.layout.page_shape(ce.layout.num_pages(len(prompt)) - 1))
    for rid, token_ids, sent in [("none", None, prompt), ("other", prompt, [9] + prompt[1:])]:
        reserve(rid, token_ids=token_ids)
        assert ce.handoffs.begin_receive(rid, len(prompt) + 1)
        exp = SequenceExport(rid, sent, [5], len(prompt), PARAMS, 0, pages, None, first_page=1)
        refusal = "holds 0 pages" if token_ids is None else "other tokens"
        with pytest.raises(InvalidRequestError, match=refusal):
            ce.import_sequence(exp)
        ce.handoffs.refuse_import(rid)
        ce.check_idle()
    assert reserve("local2") > 0
    ce.handoffs.take_over("local2", len(prompt) + 4)
    ce.add_request("local2", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while ce.has_unfinished():
        ce.step()
    ce.check_idle()  # its pages 0-2 were cached already (not indexed twice), 3 and 4 are new
    assert ce.stats().decode_cache_retained_pages == num_computed // bs + (len(prompt) + 3) // bs - 3


@pytest.mark.parametrize(
    "family,device",
    [("llama", "cpu"), ("gemma3_hybrid", "cpu"), ("deepseek_v3", "cpu"),
     pytest.param("llama", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)  # fmt: skip
def test_a_local_prefill_starts_after_the_pages_the_decode_cache_holds(tiny_model_dir, family: str, device: str) -> None:
    """A CE that prefills a conversation's turns itself (take_over: --local-prefill-max-tokens, or a PE
    failing) computes only what its decode cache lacks, and answers as a single engine does; a model
    with sliding-window layers computes the whole prompt (pages alone do not give its window state)."""
    folder = tiny_model_dir(family)
    kw = dict(is_deterministic=True, hicache_gb=0, device=device)
    ce, ref = small_engine(folder, **kw), small_engine(folder, decode_cache=False, **kw)
    bs = ce.layout.block_size
    gen = torch.Generator().manual_seed(5)
    prompt, computed_before = _user(gen, 40), 0
    for turn in range(3):
        rid = f"turn{turn}"
        ce.handoffs.take_over(rid, len(prompt) + PARAMS.max_tokens)
        ce.add_request(rid, prompt, PARAMS)
        outs = []
        while ce.has_unfinished():
            outs += ce.step()
        ce.check_idle()
        tokens = [t for o in outs for t in o.new_token_ids]
        (single,) = ref.generate([prompt], PARAMS)
        assert tokens == single.output_token_ids, f"turn {turn}"
        held = 0 if family == "gemma3_hybrid" else computed_before // bs * bs
        assert outs[-1].num_cached_tokens == held, f"turn {turn}"
        computed_before = len(prompt) + len(tokens) - 1
        prompt = prompt + tokens + _user(gen, 7)
    assert ce.stats().num_free_blocks == ce.stats().num_total_blocks
