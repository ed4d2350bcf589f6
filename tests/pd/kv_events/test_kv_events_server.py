"""KV events from real engine ranks (issue 51): the shared SmolLM2 servers run with --kv-events-config
(tests/pd/conftest.py). A prompt the single server prefills shows up in the index as its host tier's pages;
through the P/D pair, the PE's host tier holds the prompt and the CE's decode cache (its GPU tier, the
engine's own pool) holds the finished request's pages."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from typing import Any

import pytest

from pd.kv_events.index import PrefixIndex, Subscription
from tests.pd.conftest import KV_EVENTS, SMOLLM

BLOCK_SIZE = 128  # the engines' default page
pytestmark = pytest.mark.usefixtures("smollm_servers")


def complete(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": SMOLLM, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


async def subscribed(index: PrefixIndex, names: list[str]) -> list[Subscription]:
    subs = []
    for name in names:
        endpoint, replay = KV_EVENTS[name]
        s = Subscription(index, name, endpoint, replay, topic="kv")
        s.start()
        subs.append(s)
    await asyncio.sleep(0.5)  # PUB drops what it sends before a subscription reaches it
    return subs


async def until(cond: Any, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.05)


def fresh_prompt(n: int) -> list[int]:
    rng = random.Random(time.monotonic_ns())
    return [rng.randrange(1000, 40000) for _ in range(n)]


async def test_the_single_server_announces_the_prompt_pages_its_host_cache_stores(smollm_servers):
    ref, _ = smollm_servers
    index = PrefixIndex(BLOCK_SIZE)
    subs = await subscribed(index, ["ref"])
    try:
        prompt = fresh_prompt(3 * BLOCK_SIZE + 5)
        assert index.match(prompt, ["ref"])["ref"].any_tokens == 0
        await asyncio.to_thread(complete, ref.url, prompt)
        await until(lambda: index.match(prompt, ["ref"])["ref"].any_tokens == 3 * BLOCK_SIZE)
        assert index.match(prompt, ["ref"])["ref"].gpu_tokens == 0  # a single server keeps no decode cache
        assert index.match(prompt[:BLOCK_SIZE] + fresh_prompt(BLOCK_SIZE + 1), ["ref"])["ref"].any_tokens == BLOCK_SIZE
        assert subs[0].num_gaps == 0 and subs[0].last_seq >= 0
    finally:
        for s in subs:
            await s.stop()


async def test_the_pair_announces_the_pes_host_pages_and_the_ces_decode_cache(smollm_servers):
    _, pair = smollm_servers
    index = PrefixIndex(BLOCK_SIZE)
    subs = await subscribed(index, ["pe", "ce"])
    try:
        prompt = fresh_prompt(2 * BLOCK_SIZE + 7)
        out = await asyncio.to_thread(complete, pair.url, prompt)
        assert out["usage"]["completion_tokens"] >= 1
        await until(lambda: index.match(prompt, ["pe"])["pe"].any_tokens == 2 * BLOCK_SIZE)
        await until(lambda: index.match(prompt, ["ce"])["ce"].gpu_tokens == 2 * BLOCK_SIZE)
        blocks = {name: index.num_blocks(name) for name in ("pe", "ce")}
        assert blocks["pe"] >= 2 and blocks["ce"] >= 2, blocks
    finally:
        for s in subs:
            await s.stop()
