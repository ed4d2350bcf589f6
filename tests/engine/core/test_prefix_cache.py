"""Host prefix cache: index (hash chain, token check, LRU, pinning), pool accounting, and multi-turn
conversations whose every turn is token-identical with and without the cache."""

from __future__ import annotations

import pytest
import torch

from engine.core.prefix_cache import PrefixIndex, chain_hashes
from engine.request import SamplingParams
from tests.engine_utils import small_engine

BS = 4


def _store(index: PrefixIndex, tokens: list[int], with_state: bool = True) -> None:
    index.plan_store(tokens, len(tokens) // BS, with_state)
    index.commit_store()


def test_chain_hashes_are_prefix_stable_and_seeded() -> None:
    a = chain_hashes(list(range(12)), BS)
    b = chain_hashes(list(range(8)) + [99, 99, 99, 99, 5], BS)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert chain_hashes([1, 2, 3, 4], BS) != chain_hashes([2, 1, 3, 4], BS)
    assert chain_hashes(list(range(12)), BS) == a  # same on every call (and host)


def test_match_caps_at_one_token_and_snaps_to_state() -> None:
    index = PrefixIndex(num_pages=16, num_states=16, block_size=BS, needs_state=True)
    tokens = list(range(100, 112))
    _store(index, tokens)  # 3 pages, state at the end of page 2 only
    m = index.match(tokens)  # at most 11 tokens may hit -> 2 pages, but no state there -> 0
    assert m.num_tokens == 0
    index.release(m)
    m = index.match(tokens + [7])
    assert m.num_tokens == 12 and m.entries[-1].state >= 0
    index.release(m)
    stateless = PrefixIndex(num_pages=16, num_states=0, block_size=BS, needs_state=False)
    _store(stateless, tokens, with_state=False)
    m = stateless.match(tokens)
    assert m.num_tokens == 8  # any page boundary, one token left to compute
    stateless.release(m)
    index.check_idle()
    stateless.check_idle()


def test_hash_hit_is_verified_against_tokens() -> None:
    index = PrefixIndex(num_pages=8, num_states=8, block_size=BS, needs_state=False)
    tokens = [1, 2, 3, 4, 5]
    _store(index, tokens, with_state=False)
    entry = next(iter(index._entries.values()))
    entry.tokens = (9, 9, 9, 9)  # as if another prefix had collided on this hash
    m = index.match(tokens)
    assert m.num_tokens == 0
    index.release(m)


def test_lru_evicts_tails_first_and_never_pinned_entries() -> None:
    index = PrefixIndex(num_pages=4, num_states=4, block_size=BS, needs_state=False)
    old = list(range(0, 12))
    _store(index, old, with_state=False)  # 3 pages
    pinned = index.match(old + [1])
    assert pinned.num_pages == 3
    _store(index, list(range(50, 58)), with_state=False)  # needs 2 pages: only 1 free, rest pinned
    assert index.num_used_pages == 4  # stored what fit (the chain is cut), evicted nothing pinned
    index.release(pinned)
    _store(index, list(range(70, 78)), with_state=False)  # now eviction may happen
    assert index.counters.evictions >= 1
    m = index.match(old + [1])
    assert 0 < m.num_pages < 3  # the head of the old chain survives, its tail went first
    index.release(m)
    index.check_idle()


def _run(eng, request_id: str, prompt: list[int], use_prefix_cache: bool = True) -> tuple[list[int], int]:
    """12 greedy tokens of prompt, run to the end: (the tokens, the prompt tokens the cache gave)."""
    eng.add_request(request_id, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_prefix_cache=use_prefix_cache)
    out: list[int] = []
    cached = -1
    while eng.has_unfinished():
        for o in eng.step():
            out += o.new_token_ids
            if o.is_finished:
                cached = o.num_cached_tokens
    return out, cached


def _conversation(eng, turns: int, use_cache: bool, user_len: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    history: list[int] = []
    outputs, cached = [], []
    for t in range(turns):
        history += torch.randint(3, 500, (user_len,), generator=gen).tolist()
        out, hit = _run(eng, f"t{t}-{use_cache}", history, use_prefix_cache=use_cache)
        outputs.append(out)
        cached.append(hit)
        history += out
    return outputs, cached


@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid", "qwen3_hybrid", "mistral", "phi3", "deepseek_v3"])
def test_multi_turn_identical_with_and_without_cache(tiny_model_dir, family: str) -> None:
    eng = small_engine(tiny_model_dir(family), is_deterministic=True, hicache_gb=0.01, max_model_len=1024)
    without, cached0 = _conversation(eng, 4, use_cache=False, user_len=37)
    with_cache, cached1 = _conversation(eng, 4, use_cache=True, user_len=37)
    assert with_cache == without
    assert cached0 == [0, 0, 0, 0] and cached1[0] == 0 and all(c > 24 for c in cached1[1:])  # > the 24-token window
    st = eng.stats()
    assert st.cache_hit_tokens_total == sum(cached1) and st.cache_stored_pages_total > 0
    eng.check_idle()


def test_sliding_layers_only_hit_the_state_alone(tiny_model_dir) -> None:
    """Phi-3 with a window slides every layer (no full-attention layer): a prefix is its SWA state at a
    page boundary, no page. The same long prompt twice (6 pages of 16, 4 windows of 24, in chunks of 64):
    the second restores 96 tokens from the host and gives the first's greedy tokens."""
    eng = small_engine(tiny_model_dir("phi3"), is_deterministic=True, hicache_gb=0.01, max_model_len=1024)
    assert eng.prefix_cache is not None and eng.kv.layout.num_full_layers == 0
    prompt = torch.randint(3, 500, (101,), generator=torch.Generator().manual_seed(3)).tolist()
    outputs, cached = [], []
    for i in range(2):
        out, hit = _run(eng, f"r{i}", prompt)
        outputs.append(out)
        cached.append(hit)
    assert len(outputs[0]) == 12 and outputs[1] == outputs[0]
    assert cached == [0, 96]  # the last page boundary before the prompt's last token
    st = eng.stats()
    assert st.cache_hit_tokens_total == 96 and st.cache_stored_pages_total > 0
    eng.check_idle()


def test_cache_off_and_abort_during_store_leave_nothing(tiny_model_dir) -> None:
    eng = small_engine(tiny_model_dir("gemma3_hybrid"), hicache_gb=0.0)
    assert eng.prefix_cache is None
    eng = small_engine(tiny_model_dir("gemma3_hybrid"), hicache_gb=0.0005, max_num_batched_tokens=16)
    eng.add_request("a", list(range(3, 80)), SamplingParams(max_tokens=4, temperature=0.0))
    eng.step()
    eng.step()
    eng.abort("a")
    eng.step()
    eng.check_idle()
    # a tiny pool under pressure: every store evicts, nothing leaks
    for i in range(6):
        eng.add_request(f"r{i}", [3 + i] * 70, SamplingParams(max_tokens=2, temperature=0.0))
    while eng.has_unfinished():
        eng.step()
    eng.check_idle()
    assert eng.stats().cache_evictions_total > 0


def test_no_enable_prefix_caching_turns_every_prefix_cache_off(tiny_model_dir) -> None:
    """vLLM's --no-enable-prefix-caching: no host prefix cache, whatever --hicache-gb says, and no decode
    cache; the same prompt twice is computed twice (with it on, the second restores its pages)."""
    prompt = torch.randint(3, 500, (101,), generator=torch.Generator().manual_seed(3)).tolist()
    cached = {}
    for enabled in (True, False):
        eng = small_engine(tiny_model_dir("llama"), hicache_gb=0.01, enable_prefix_caching=enabled)
        assert (eng.prefix_cache is not None, eng.decode_cache is not None) == (enabled, enabled)
        cached[enabled] = [_run(eng, f"r{i}", prompt)[1] for i in range(2)]
        eng.check_idle()
    assert cached == {True: [0, 96], False: [0, 0]}
