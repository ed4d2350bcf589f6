"""What speculative decoding can buy on one GPU: the cost of a verify step against a plain decode step,
and tokens/s when every draft is accepted.

In one run, on dummy 8B-shaped weights (bench/configs/llama8b.json; --tiny: toy sizes on the CPU):
  1. the ceiling: a plain decode step's bytes (every weight once, plus the KV) over the device's copy rate;
  2. per batch (1, 8, 64) at a 1k context: the forward of a plain decode step (CUDA graph, one row per
     sequence) and of a verify step with k = 1..7 drafts per sequence (1 + k rows per sequence, one
     graph of that many rows; `chunked`: the same verify on the prefill path, eagerly, for k = 3),
     each timed as the engine runs it, sampling's copy to the host included; the ratio verify / plain
     is what k accepted tokens must beat;
  3. forced acceptance: a generation whose drafts are the target's own next tokens (a plain run's, so
     every one is accepted while the two runs agree) against the same generation without speculation,
     tokens/s end to end (the engine's step loop: drafting, verifying, sampling, appending). Both with
     --deterministic: default numerics round a verify's rows (1 + k per sequence) differently from a
     plain step's, and random weights' near-tied logits then part the two runs within a few tokens.
The crossover batch is the first where even k = 1 fully accepted (2 tokens per step) costs more than two
plain steps. One table at the end, and JSON in --out.

    python bench/micro/spec_verify.py --out /tmp/spec      # on the GPU
    python bench/micro/spec_verify.py --tiny               # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.micro.engine_speed import ModelFacts, copy_bytes_per_s, model_folder, random_prompts  # noqa: E402
from engine.config import MAX_SPECULATIVE_TOKENS, EngineConfig, ForwardConfig  # noqa: E402
from engine.core.sequence import Sequence  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

GiB = 2**30


def build(folder: Path, args: argparse.Namespace, max_seqs: int, eager: bool = False,
          deterministic: bool = False) -> LLMEngine:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS, "auto_disable": False})
    return LLMEngine(EngineConfig(
        model=str(folder), device=args.device, load_format="dummy", max_num_seqs=max_seqs,
        max_num_batched_tokens=max(2048, max_seqs * (1 + MAX_SPECULATIVE_TOKENS)), block_size=args.block_size,
        max_model_len=args.context + args.gen_tokens + 64, kv_cache_gb=args.kv_gb, seed=0, speculative_config=spec,
        enforce_eager=eager, hicache_gb=0, is_deterministic=deterministic,
        forward=ForwardConfig(decode_rope=not args.no_decode_rope),
    ))  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_decoding(eng: LLMEngine, batch: int, context: int, tag: str) -> list[Sequence]:
    """batch sequences of context tokens, their prompts counted as cached (the bench's import path: no
    prefill), run to their first decode; with pages for every draft position."""
    params = SamplingParams(max_tokens=eng.max_model_len - context, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, context, eng.arch.vocab_size, 1)):
        eng.add_request(f"{tag}-{i}", prompt, params)
    sched = eng.scheduler
    for seq in list(sched.waiting):
        sched.allocate(seq)
        seq.num_computed = seq.num_prompt_tokens - 1
        seq.num_cached_prompt = seq.num_computed
        sched.admit_prefilled(seq)
    assert eng.speculator is not None
    eng.speculator._propose = lambda seq, k: []  # type: ignore[method-assign]
    eng.step()  # the last prompt token: every sequence now decodes
    seqs = list(sched.running)
    assert len(seqs) == batch and all(s.num_uncomputed == 1 for s in seqs)
    assert sched.grow_all(seqs, MAX_SPECULATIVE_TOKENS + 1)
    return seqs


def forward_ms(eng: LLMEngine, seqs: list[Sequence], k: int, reps: int, chunked: bool = False) -> float:
    """Median ms of the runner's forward for seqs with k drafts each (k = 0: a plain decode step), its
    greedy tokens copied to the host (what a step waits for). The drafts' K/V land past the sequences'
    computed tokens, where the next write overwrites them."""
    runner = eng.runner
    saved = runner.verifies_in_kernel
    runner.verifies_in_kernel = not chunked
    for s in seqs:
        s.draft_token_ids = [7] * k
    num_new = [1 + k] * len(seqs)
    try:
        times = []
        for i in range(reps + 3):
            sync(eng.device)
            t0 = time.perf_counter()
            _, logits = runner.run(seqs, num_new)
            assert logits is not None
            logits.argmax(-1).tolist()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)
    finally:
        runner.verifies_in_kernel = saved
        for s in seqs:
            s.draft_token_ids = []


def release(eng: LLMEngine) -> None:
    for seq in list(eng.scheduler.running):
        eng.abort(seq.request_id)
    while eng.has_unfinished():
        eng.step()
    eng.check_idle()


def generate_tps(eng: LLMEngine, batch: int, args: argparse.Namespace, k: int,
                 oracle: dict[str, list[int]] | None) -> tuple[float, dict[str, list[int]], float]:
    """tokens/s of `batch` sequences decoding args.gen_tokens each (prompts prefilled first, untimed); k drafts per step
    from oracle (the tokens each sequence should produce), none without. Returns (tokens/s, the outputs,
    the mean accepted length)."""
    assert eng.speculator is not None
    spec = eng.speculator
    before = (spec.num_drafts, spec.num_accepted_tokens)
    tag = f"g{batch}-{k}-{time.monotonic_ns()}"
    params = SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, args.context, eng.arch.vocab_size, 1)):
        eng.add_request(f"{tag}-{i}", prompt, params)
    seqs = list(eng.scheduler.waiting)
    names = {id(s): s.request_id.rsplit("-", 1)[1] for s in seqs}
    spec._propose = lambda seq, room: []  # type: ignore[method-assign]
    while any(not s.output_token_ids for s in seqs):  # prefilled (the prompts' KV real, as the runs compare)
        eng.step()
    if oracle is not None:
        def propose(seq: Sequence, room: int) -> list[int]:
            want = oracle[names[id(seq)]]
            done = len(seq.output_token_ids)
            return want[done : done + min(k, room)]

        spec._propose = propose  # type: ignore[method-assign]
    sync(eng.device)
    t0 = time.perf_counter()
    first = sum(len(s.output_token_ids) for s in seqs)
    while eng.has_unfinished():
        eng.step()
    sync(eng.device)
    dt = time.perf_counter() - t0
    made = sum(len(s.output_token_ids) for s in seqs) - first
    outputs = {names[id(s)]: list(s.output_token_ids) for s in seqs}
    eng.check_idle()
    drafts, accepted = spec.num_drafts - before[0], spec.num_accepted_tokens - before[1]
    return made / dt, outputs, (1 + accepted / drafts) if drafts else 1.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama8b")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--gen-batches", default="1,8")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--kv-gb", type=float, default=24.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU: a smoke test")
    p.add_argument("--no-decode-rope", action="store_true", help="q/k norms and rotary outside the decode kernel")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.tiny:
        args.context, args.reps, args.gen_tokens, args.kv_gb = 64, 3, 24, 0.2
    device = torch.device(args.device)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as scratch:
        folder = model_folder(args.model, argparse.Namespace(tiny=args.tiny), Path(scratch))
        eng = build(folder, args, max(batches))
        facts = ModelFacts(eng.arch, torch.finfo(eng.dtype).bits // 8)
        copy_rate = copy_bytes_per_s(device, (64 if args.tiny else 4096) * 2**20)
        for b in batches:
            seqs = start_decoding(eng, b, args.context, f"f{b}")
            plain = forward_ms(eng, seqs, 0, args.reps)
            ceiling_ms = 1e3 * facts.decode_bytes(b, args.context) / copy_rate
            row: dict[str, Any] = {"batch": b, "plain_ms": plain, "ceiling_ms": ceiling_ms}
            for k in range(1, MAX_SPECULATIVE_TOKENS + 1):
                row[f"k{k}_ms"] = forward_ms(eng, seqs, k, args.reps)
            row["k3_chunked_ms"] = forward_ms(eng, seqs, 3, args.reps, chunked=True)
            release(eng)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del eng, seqs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        eng = build(folder, args, max(int(x) for x in args.gen_batches.split(",")), deterministic=True)
        gen: list[dict[str, Any]] = []
        for b in [int(x) for x in args.gen_batches.split(",")]:
            plain_tps, outputs, _ = generate_tps(eng, b, args, 0, None)
            for k in (1, 3, 5, 7):
                tps, got, accepted_len = generate_tps(eng, b, args, k, outputs)
                same = sum(got[n] == outputs[n] for n in outputs)
                gen.append({"batch": b, "k": k, "plain_tps": plain_tps, "spec_tps": tps, "speedup": tps / plain_tps,
                            "mean_accepted_len": accepted_len, "same_outputs": f"{same}/{len(outputs)}"})
                print(json.dumps(gen[-1]), flush=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [f"speculative verify cost, {args.model}, context {args.context}, {device_name}, torch {torch.__version__}",
             f"copy ceiling {copy_rate / 1e12:.2f} TB/s; ms per step (forward + greedy tokens to the host); "
             "ratio = verify / plain",
             "batch  ceiling  plain  " + "  ".join(f"k={k:<9}" for k in range(1, MAX_SPECULATIVE_TOKENS + 1))
             + "  k=3 chunked"]
    for r in rows:
        cells = "  ".join(f"{r[f'k{k}_ms']:5.2f} {r[f'k{k}_ms'] / r['plain_ms']:4.2f}x" for k in range(1, 8))
        lines.append(f"{r['batch']:5d}  {r['ceiling_ms']:7.2f}  {r['plain_ms']:5.2f}  {cells}  "
                     f"{r['k3_chunked_ms']:5.2f} {r['k3_chunked_ms'] / r['plain_ms']:4.2f}x")
    cross = next((r["batch"] for r in rows if r["k1_ms"] > 2 * r["plain_ms"]), None)
    lines.append(f"crossover (k=1 fully accepted loses to two plain steps): "
                 f"{'batch ' + str(cross) if cross else 'not reached at ' + args.batches}")
    lines.append("forced acceptance (drafts = a plain run's tokens; --deterministic), tokens/s end to end:")
    lines.append("batch  k  plain tok/s  spec tok/s  speedup  mean accepted length  same outputs")
    for g in gen:
        lines.append(f"{g['batch']:5d}  {g['k']}  {g['plain_tps']:11.1f}  {g['spec_tps']:10.1f}  {g['speedup']:6.2f}x  "
                     f"{g['mean_accepted_len']:20.2f}  {g['same_outputs']}")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spec_verify.txt").write_text(table + "\n")
        (args.out / "spec_verify.json").write_text(json.dumps({"verify": rows, "generate": gen}, indent=1))


if __name__ == "__main__":
    main()
