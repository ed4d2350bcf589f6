"""Structured outputs: llguidance (what pdserve uses, engine/core/grammar.py) against xgrammar (what vLLM and
SGLang default to), on the same tokenizer and the same token streams.

For each grammar it measures the first use (tokenizer wrapping is reported once; then compile, or
matcher creation for llguidance, which compiles lazily), and the per-step cost of computing a token
bitmask and advancing the matcher along a fixed valid output (the tokens of a reference text), the
work the engine adds to each decode step of a constrained row. The ceiling: a decode step of the
model itself (stated in the table: SmolLM2-135M's step on this CPU, measured in the same run unless
--no-model).

    python bench/micro/grammar_backends.py [--model smollm2-135m-instruct] [--steps 200] [--xgrammar-path DIR]

xgrammar is optional: install it where you like (`pip install --no-deps --target DIR xgrammar
apache-tvm-ffi` keeps it out of the venv) and pass --xgrammar-path DIR; without it only llguidance runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
PERSON_TEXT = json.dumps(
    {
        "name": "Ann Example",
        "age": 31,
        "email": "ann@example.com",
        "tags": ["runner", "reader", "cook", "traveller"] * 6,
        "address": {"street": "1 Long Road, Flat " + "9" * 40, "city": "Springfield", "zip": "12345"},
    },
    indent=2,
)
CASES: dict[str, tuple[str, Any, str]] = {
    # name: (kind, spec, a valid output)
    "json_schema (person)": ("json_schema", PERSON, PERSON_TEXT),
    "json_object": ("json_object", None, PERSON_TEXT),
    "regex (phone list)": ("regex", r"(\+1 [0-9]{3}-[0-9]{3}-[0-9]{4}\n){1,40}", "+1 555-123-4567\n" * 40),
    "choice (3)": ("choice", ["positive", "negative", "neutral"], "negative"),
}


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _walk(name: str, ids: list[int], step: Callable[[int], bool], compile_s: float) -> dict[str, float]:
    """Times step(token) (fill the next mask, then advance by token) along a valid output: the first
    step counts with the compile (a library may compile lazily), the rest are the per-step cost."""
    times = []
    for i, t in enumerate(ids):
        t0 = time.perf_counter()
        ok = step(t)
        times.append(time.perf_counter() - t0)
        if not ok:
            raise RuntimeError(f"token {i} of {name} was refused")
    return _summary(compile_s + times[0], times[1:])


def run_llguidance(tok: Any, vocab: int, eos: list[int], ids_of: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    import llguidance
    import llguidance.hf
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    from engine.core.grammar import grammar_text
    from engine.request import StructuredOutput

    wrap_s, lltok = _timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos))
    out: dict[str, dict[str, float]] = {"_tokenizer": {"first_s": wrap_s}}
    for name, (kind, spec, _) in CASES.items():
        text_spec = "" if spec is None else spec if isinstance(spec, str) else json.dumps(spec)
        so = StructuredOutput(kind, text_spec)  # type: ignore[arg-type]
        compile_s, m = _timed(lambda so=so: llguidance.LLMatcher(lltok, grammar_text(so)))
        bitmask = allocate_token_bitmask(1, vocab)

        def step(t: int, m: Any = m, bitmask: Any = bitmask) -> bool:
            fill_next_token_bitmask(m, bitmask, 0)
            return bool(m.consume_token(t))

        out[name] = _walk(name, ids_of[name], step, compile_s)
    # the engine's whole per-step path (engine/core/grammar.py mask_logits: the fill, the byte-table add) on a
    # batch of rows, each in the middle of the person schema
    from engine.core.grammar import GrammarCompiler, mask_logits

    compiler = GrammarCompiler(tok, vocab, set(eos))
    so = StructuredOutput("json_schema", json.dumps(PERSON))
    prefix = ids_of["json_schema (person)"][:40]
    for batch in (1, 32):
        matchers = [compiler.matcher(so, prefix) for _ in range(batch)]
        logits = torch.zeros(batch, vocab)
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            mask_logits(logits, list(matchers))
            times.append(time.perf_counter() - t0)
        out[f"engine mask_logits, batch {batch}"] = _summary(0.0, times[5:])
    return out


def run_xgrammar(tok: Any, vocab: int, eos: list[int], ids_of: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    import xgrammar as xgr

    wrap_s, info = _timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out: dict[str, dict[str, float]] = {"_tokenizer": {"first_s": wrap_s}}
    for name, (kind, spec, _) in CASES.items():
        if kind == "json_schema":
            make = lambda spec=spec: compiler.compile_json_schema(json.dumps(spec))  # noqa: E731
        elif kind == "json_object":
            make = compiler.compile_builtin_json_grammar
        elif kind == "regex":
            make = lambda spec=spec: compiler.compile_regex(spec)  # noqa: E731
        else:
            ebnf = "root ::= " + " | ".join(json.dumps(c) for c in spec)
            make = lambda ebnf=ebnf: compiler.compile_grammar(ebnf)  # noqa: E731
        compile_s, compiled = _timed(make)
        m = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

        def step(t: int, m: Any = m, bitmask: Any = bitmask) -> bool:
            m.fill_next_token_bitmask(bitmask, 0)
            return bool(m.accept_token(t))

        out[name] = _walk(name, ids_of[name], step, compile_s)
    return out


def _summary(first_s: float, steps: list[float]) -> dict[str, float]:
    steps_ms = sorted(s * 1e3 for s in steps) or [0.0]
    return {
        "first_s": first_s,
        "steps": len(steps),
        "p50_ms": statistics.median(steps_ms),
        "p99_ms": steps_ms[min(len(steps_ms) - 1, int(0.99 * len(steps_ms)))],
        "mean_ms": statistics.fmean(steps_ms),
    }


def model_step_ms(model: str, n: int = 32) -> float:
    """One greedy decode step of the engine on this machine (batch 1): the ceiling a mask is compared to."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.request import SamplingParams

    eng = LLMEngine(EngineConfig(model=model, device="cpu", kv_cache_gb=0.05, max_num_seqs=4))
    eng.add_request("warm", [1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    eng.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    eng.step()  # the prefill
    t0 = time.perf_counter()
    k = 0
    while eng.has_unfinished():
        eng.step()
        k += 1
    return (time.perf_counter() - t0) / max(1, k) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--xgrammar-path", default=None, help="a folder holding xgrammar (sys.path entry)")
    ap.add_argument("--no-model", action="store_true", help="skip the model-step ceiling")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from engine.checkpoints import resolve_model
    from engine.models.hf_config import generation_eos_ids
    from engine.models.registry import load_hf_config

    folder = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(folder))
    hf = load_hf_config(folder)
    vocab = int(hf.vocab_size)
    eos = sorted(generation_eos_ids(folder, hf))
    ids_of = {
        name: tok.encode(text, add_special_tokens=False) + eos[:1] for name, (_, _, text) in CASES.items()
    }
    torch.set_num_threads(1)
    results = {"llguidance": run_llguidance(tok, vocab, eos, ids_of)}
    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)
    try:
        results["xgrammar"] = run_xgrammar(tok, vocab, eos, ids_of)
    except ImportError as e:
        print(f"xgrammar not measured: {e}")
    step = None if args.no_model else model_step_ms(args.model)
    print(f"\nmodel {args.model}, vocabulary {vocab}; one thread; tokens per case: "
          + ", ".join(f"{n} {len(v)}" for n, v in ids_of.items()))
    if step is not None:
        print(f"ceiling: one decode step of the model, batch 1, this CPU: {step:.1f} ms")
    print("\n| library | grammar | first use (compile + first mask) | mask+advance p50 | p99 | mean | mean / decode step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for lib, rows in results.items():
        print(f"| {lib} | (tokenizer wrap, once) | {rows['_tokenizer']['first_s'] * 1e3:.0f} ms | | | | |")
        for name, r in rows.items():
            if name == "_tokenizer":
                continue
            share = f"{r['mean_ms'] / step * 100:.2f}%" if step else "-"
            first = f"{r['first_s'] * 1e3:.1f} ms" if r["first_s"] else ""
            print(
                f"| {lib} | {name} | {first} | {r['p50_ms']:.3f} ms | {r['p99_ms']:.3f} ms "
                f"| {r['mean_ms']:.3f} ms | {share} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
