#!/usr/bin/env python3
"""A/B of the host prefix cache against a running server.

A multi-turn conversation (each turn = the whole history + the assistant's answer + a new message);
every turn is sent twice, greedy: once with `"prefix_cache": false` and once with the cache. The two
outputs must be identical token for token. Prints TTFT of each and the cached tokens; exits 1 on
any difference. Run the server with --deterministic so chunking cannot excuse a difference.

    python bench/check_prefix_cache.py --port 8888 --turns 4
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

TOPICS = [
    "Describe how a hash table handles collisions, with a short example.",
    "Now compare that with a balanced binary search tree for ordered lookups.",
    "Write a small Python function that counts word frequencies in a text.",
    "Explain what the function's time complexity is and why.",
    "Summarise everything we discussed in three bullet points.",
    "Give one more example that uses a different data structure.",
]
PADDING = (
    "Context for the discussion follows. " + " ".join(f"Item {i}: a note about data structures and their costs." for i in range(40))
)


@dataclass
class TurnResult:
    tokens: list[str]
    text: str
    ttft_s: float
    cached_tokens: int
    prompt_tokens: int


def run_turn(client, model: str, messages: list[dict], use_cache: bool, max_tokens: int) -> TurnResult:
    start = time.perf_counter()
    ttft = None
    tokens: list[str] = []
    text = ""
    usage = None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"prefix_cache": use_cache},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta and choice.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - start
                text += choice.delta.content
            if choice.logprobs and choice.logprobs.content:
                tokens += [t.token for t in choice.logprobs.content]
    cached = 0
    if usage is not None and usage.prompt_tokens_details is not None:
        cached = usage.prompt_tokens_details.cached_tokens or 0
    return TurnResult(tokens, text, ttft if ttft is not None else float("nan"), cached, usage.prompt_tokens if usage else 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8888)
    ap.add_argument("--url", default=None, help="base URL (overrides --host/--port), e.g. http://h:8888/v1")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    args = ap.parse_args(argv)

    from openai import OpenAI

    client = OpenAI(base_url=args.url or f"http://{args.host}:{args.port}/v1", api_key="none", max_retries=0, timeout=600)
    model = args.model or client.models.list().data[0].id
    messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant. " + PADDING}]
    failures = 0
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'ttft off (ms)':>14} {'ttft on (ms)':>13}  same")
    for turn in range(args.turns):
        messages.append({"role": "user", "content": TOPICS[turn % len(TOPICS)]})
        off = run_turn(client, model, messages, False, args.max_tokens)
        on = run_turn(client, model, messages, True, args.max_tokens)
        same = off.tokens == on.tokens and off.text == on.text
        failures += not same
        print(
            f"{turn:>4} {on.prompt_tokens:>7} {on.cached_tokens:>7} {off.ttft_s * 1e3:>14.1f} {on.ttft_s * 1e3:>13.1f}  "
            f"{'yes' if same else 'NO'}"
        )
        if not same:
            print(f"     without cache: {off.text!r}\n     with cache:    {on.text!r}")
        messages.append({"role": "assistant", "content": on.text})
    print("OK: every turn identical with and without the cache" if not failures else f"FAILED: {failures} turn(s) differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
