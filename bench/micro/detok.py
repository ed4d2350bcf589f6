"""Incremental detokenization: the engine's IncrementalDetokenizer (its former window re-decode and its
DecodeStream path, stop-string bookkeeping included) against the `tokenizers` library's DecodeStream
alone, on a long stream of each catalogue model's tokens (mixed scripts, emoji, code).

Both must give the same text as one full decode; the table gives microseconds per token and the
total for the stream. The ceiling: a CPU decode step of SmolLM2-135M is ~40-60 ms, so either is
small there; on a GPU step (~5 ms at 8B) tens of microseconds per token per row start to count.

    python bench/micro/detok.py [--tokens 4096] [--models smollm2-135m-instruct,gemma3-270m]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

TEXT = (
    "Hello wörld! 東京は晴れ 🌤️ — naïve café, def f(x):\n    return x**2  # done. "
    "The quick brown fox jumps over the lazy dog; Ωμέγα, Москва, مرحبا, 🚀🔥 and 123,456.78. "
)


def run_ours(tok: Any, ids: list[int], window: bool = False) -> tuple[str, float]:
    from engine.core.detokenizer import IncrementalDetokenizer

    d = IncrementalDetokenizer(tok, ())
    if window:  # the engine's path for tokenizers without a `tokenizers` backend (and its former one)
        d._stream = None
    out = []
    t0 = time.perf_counter()
    for t in ids:
        d.add(t)
        out.append(d.release(is_final=False))
    out.append(d.release(is_final=True))
    return "".join(out), time.perf_counter() - t0


def run_stream(tok: Any, ids: list[int]) -> tuple[str, float]:
    from tokenizers.decoders import DecodeStream

    s = DecodeStream(skip_special_tokens=True)
    backend = tok.backend_tokenizer
    out = []
    t0 = time.perf_counter()
    for t in ids:
        piece = s.step(backend, t)
        if piece is not None:
            out.append(piece)
    return "".join(out), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from engine.checkpoints import resolve_model

    rows = []
    for name in args.models.split(","):
        tok = AutoTokenizer.from_pretrained(str(resolve_model(name)))
        ids: list[int] = []
        while len(ids) < args.tokens:
            ids += tok.encode(TEXT, add_special_tokens=False)
        ids = ids[: args.tokens]
        full = tok.decode(ids, skip_special_tokens=True)
        for label, fn in (
            ("IncrementalDetokenizer, window re-decode (before)", lambda t, i: run_ours(t, i, window=True)),
            ("IncrementalDetokenizer, DecodeStream (now)", run_ours),
            ("tokenizers DecodeStream alone", run_stream),
        ):
            fn(tok, ids[:64])  # warm up
            text, secs = fn(tok, ids)
            rows.append((name, label, secs / len(ids) * 1e6, secs * 1e3, text == full))
    print(f"\n{args.tokens} tokens per stream, one token at a time")
    print("| model | detokenizer | us per token | whole stream | equals full decode |")
    print("| --- | --- | --- | --- | --- |")
    for name, label, us, total_ms, same in rows:
        print(f"| {name} | {label} | {us:.1f} | {total_ms:.0f} ms | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
