"""One GPU check of the features whose tensors run on the device: structured outputs (the grammar mask
applied to CUDA logits) and the CE's decode cache (a multi-turn P/D conversation between two engines
on one GPU, the PE exporting only the pages the CE lacks). Random weights (`--load-format dummy`) of
a real model's shape with its real tokenizer; prints a summary table and exits non-zero on a failure.

    python bench/checks/gpu_features.py --model .dev/smol-shape [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import torch

from engine.config import EngineConfig
from engine.core.grammar import GrammarCompiler, mask_logits
from engine.engine import LLMEngine
from engine.request import SamplingParams, StructuredOutput

ROWS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    ROWS.append((name, ok, detail))
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)


def engine(model: str, device: str, **kw: object) -> LLMEngine:
    base: dict[str, object] = dict(
        model=model, device=device, load_format="dummy", kv_cache_gb=0.5, max_num_seqs=8,
        block_size=16, is_deterministic=True, enforce_eager=False, seed=0,
    )  # fmt: skip
    base.update(kw)
    return LLMEngine(EngineConfig(**base))  # type: ignore[arg-type]


def run(eng: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str | None]]:
    for rid, (ids, p) in reqs.items():
        eng.add_request(rid, ids, p)
    toks: dict[str, list[int]] = {r: [] for r in reqs}
    fin: dict[str, str | None] = {}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            if o.is_finished:
                fin[o.request_id] = o.finish_reason
    eng.check_idle()
    return {r: (toks[r], fin.get(r)) for r in reqs}


def structured(model: str, device: str) -> None:
    eng = engine(model, device)
    tok = eng.tokenizer
    ids = tok.encode("Answer:", add_special_tokens=False)
    g = lambda so, n: SamplingParams(max_tokens=n, temperature=0, structured=so)  # noqa: E731
    out = run(
        eng,
        {
            "regex": (ids, g(StructuredOutput("regex", "[0-9]{3}-[0-9]{4}"), 16)),
            "choice": (ids, g(StructuredOutput("choice", '["red", "green", "blue"]'), 8)),
            "json": (ids, g(StructuredOutput("json_object"), 48)),
            "free": (ids, SamplingParams(max_tokens=8, temperature=0)),
        },
    )
    text = {k: tok.decode(v[0], skip_special_tokens=True) for k, v in out.items()}
    check("grammar regex on " + device, bool(re.fullmatch("[0-9]{3}-[0-9]{4}", text["regex"])), repr(text["regex"]))
    check("grammar choice on " + device, text["choice"] in ("red", "green", "blue"), repr(text["choice"]))
    json_ok = out["json"][1] != "stop" or isinstance(json.loads(text["json"]), dict)
    check("grammar json_object on " + device, json_ok and text["json"].lstrip().startswith("{"), repr(text["json"][:60]))
    alone = run(eng, {"free": (ids, SamplingParams(max_tokens=8, temperature=0))})
    check("unconstrained row untouched by the batch's masks", alone["free"][0] == out["free"][0])
    # the same mask on the device as on the host
    comp = GrammarCompiler(tok, eng.arch.vocab_size, eng.eos_token_ids)
    m = comp.matcher(StructuredOutput("json_object"), tok.encode('{"a": [1', add_special_tokens=False))
    logits = torch.randn(3, eng.arch.vocab_size)
    on_dev = mask_logits(logits.to(device), [None, m, None]).cpu()
    on_host = mask_logits(logits, [None, m, None])
    check("device mask == host mask", torch.equal(on_dev, on_host))
    for n in (1, 32):
        ms = [comp.matcher(StructuredOutput("json_object"), []) for _ in range(n)]
        big = torch.randn(n, eng.arch.vocab_size, device=device)
        mask_logits(big, list(ms))
        torch.cuda.synchronize() if device == "cuda" else None
        t0 = time.perf_counter()
        for _ in range(20):
            mask_logits(big, list(ms))
        torch.cuda.synchronize() if device == "cuda" else None
        check(f"mask_logits batch {n} on {device}", True, f"{(time.perf_counter() - t0) / 20 * 1e3:.3f} ms per step")


def decode_cache(model: str, device: str) -> None:
    pe = engine(model, device, decode_cache=False)
    ce = engine(model, device)
    ref = engine(model, device, decode_cache=False)
    bs = pe.layout.block_size
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (150,), generator=gen).tolist()
    for turn in range(4):
        rid = f"t{turn}"
        ce.handoffs.enqueue(rid, len(prompt) + 1, len(prompt) + params.max_tokens, 30.0, token_ids=prompt)
        (grant,) = ce.handoffs.grant()
        pe.add_request(rid, prompt, params, prefill_only=True)
        while pe.has_unfinished():
            pe.step()
        skip = min(grant.num_held_tokens // bs, (len(prompt) - 1) // bs)
        exp = pe.export_sequence(rid, device=None, skip_pages=skip)
        assert ce.handoffs.begin_receive(rid, len(prompt) + 1)
        ce.import_sequence(exp)
        got: list[int] = []
        while ce.has_unfinished():
            for o in ce.step():
                got += o.new_token_ids
        pe.finish_handoff(rid)
        want = run(ref, {rid: (prompt, params)})[rid][0]
        check(
            f"decode cache turn {turn} on {device}",
            got == want and (turn == 0 or skip > 0),
            f"{len(prompt)} prompt tokens, {grant.num_held_tokens} held, {exp.pages.shape[0]} pages sent",
        )
        prompt = prompt + got + torch.randint(100, 40000, (20,), generator=gen).tolist()
    ce.check_idle()
    pe.check_idle()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=".dev/smol-shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    for part in (structured, decode_cache):
        try:
            part(args.model, args.device)
        except Exception as e:  # a crash is a failed row, and the other part still runs
            check(part.__name__, False, repr(e))
    print("\n| check | result | detail |\n| --- | --- | --- |")
    for name, ok, detail in ROWS:
        print(f"| {name} | {'ok' if ok else 'FAIL'} | {detail} |")
    return 0 if all(ok for _, ok, _ in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
