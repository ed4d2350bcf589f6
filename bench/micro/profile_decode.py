"""Where a decode step's time goes, on the GPU: the wall time of `engine.step()`, the GPU time of the
step's CUDA graph replayed alone (the difference is host work: scheduling, filling the decode buffers,
sampling, bookkeeping), and the GPU time of each kernel in one replay (torch.profiler), for an
8B-shaped dummy model (bench/configs) at a few batch sizes and one context length.

    python bench/micro/profile_decode.py --model llama8b --batches 1,64 --context 1024 --out $OUT
"""

from __future__ import annotations

import argparse
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

from bench.micro.engine_speed import copy_bytes_per_s, replay_ms  # noqa: E402
from engine.config import EngineConfig, ForwardConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from pd.flags import add_flags, from_flags  # noqa: E402


def _bench_engine() -> Any:
    from bench.micro import engine_speed

    return engine_speed


def _median_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _kernel_table(graph: torch.cuda.CUDAGraph, reps: int) -> tuple[list[dict[str, Any]], float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.count:
            rows.append({"kernel": e.key[:90], "per_step": e.count / reps, "us_per_step": t / reps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows, sum(r["us_per_step"] for r in rows)


def _weights_floor(eng: LLMEngine, batch: int, reps: int) -> dict[str, Any] | None:
    """The step's matrix products alone (every layer's fused qkv, o, gate_up, down and the lm head, in
    order, through F.linear as the model calls them) captured in one graph: what the weights cost at
    this batch, and the GB/s that reaches; the rest of the step is norms, rotary, attention, glue.
    None for a model whose layers are not all dense with fused projections (MoE, latent attention)."""
    import torch.nn.functional as F

    model = eng.runner.model
    weights = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if not all(hasattr(a, n) for n in ("qkv_proj", "o_proj")) or not hasattr(m, "gate_up_proj"):
            return None
        weights += [a.qkv_proj.weight, a.o_proj.weight, m.gate_up_proj.weight, m.down_proj.weight]
    weights.append(model.lm_head_weight)
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], device=w.device, dtype=w.dtype) for w in weights}
    by_shape: dict[tuple[int, int], float] = {}

    def run() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = replay_ms(graph, reps)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    # one shape at a time: 32 distinct weights of that shape (64 for the lm head's one: repeated)
    for shape in sorted({tuple(w.shape) for w in weights}):
        ws = [w for w in weights if tuple(w.shape) == shape]
        g = torch.cuda.CUDAGraph()
        x = xs[shape[1]]
        for w in ws:
            F.linear(x, w)
        with torch.cuda.graph(g):
            for w in ws:
                F.linear(x, w)
        t = replay_ms(g, reps) / len(ws)
        by_shape[f"{shape[0]}x{shape[1]}"] = {
            "us": t * 1e3,
            "GBps": shape[0] * shape[1] * 2 / (t / 1e3) / 1e9,
        }
    del graph
    return {"ms": ms, "bytes": nbytes, "GBps": nbytes / (ms / 1e3) / 1e9, "by_shape": by_shape}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama8b")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--out", default=".")
    p.add_argument("--tag", default="", help="suffix of the JSON's name")
    p.add_argument("--prefill", type=int, default=0, help="also profile one prompt of this many tokens (one chunk)")
    add_flags(p, ForwardConfig)  # --pdl/--no-pdl, --gemv-rows, ...: the engine's own flags
    args = p.parse_args()
    be = _bench_engine()
    batches = [int(b) for b in args.batches.split(",")]
    report: dict[str, Any] = {"model": args.model, "context": args.context, "rows": []}
    with tempfile.TemporaryDirectory() as scratch:
        ns = argparse.Namespace(tiny=False)
        folder = be.model_folder(args.model, ns, Path(scratch))
        max_len = args.context + 64
        eng = LLMEngine(
            EngineConfig(
                model=str(folder),
                load_format="dummy",
                max_num_seqs=max(batches),
                max_model_len=max_len,
                # every row's pages, plus one SWA state slot a sequence (and a spare) for a hybrid model
                kv_cache_gb=kv_gib(folder, max(batches), max_len),
                num_swa_slots=max(batches) + 1 if has_sliding(folder) else None,
                hicache_gb=0,
                is_deterministic=args.deterministic,
                forward=from_flags(ForwardConfig, args),
            )
        )
        print(f"graphs: {eng.graph_stats}", flush=True)
        report["copy_GBps"] = copy_gbps = copy_bytes_per_s(torch.device("cuda")) / 1e9
        print(f"copy ceiling {copy_gbps:,.0f} GB/s (read + write)", flush=True)
        for b in batches:
            ids = [f"p{b}-{i}" for i in range(b)]
            params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
            for rid, prompt in zip(ids, be.random_prompts(b, args.context, eng.arch.vocab_size, 0)):
                eng.add_request(rid, prompt, params)
            be.admit_prefilled(eng)
            for _ in range(3):
                eng.step()
            step_ms = _median_ms(eng.step, 15)
            assert eng.runner.graphs is not None
            bucket = eng.runner.graphs.bucket(b)
            graph = eng.runner.graphs._graphs[bucket][0]
            graph_replay_ms = replay_ms(graph, 15)
            kernels, kernel_us = _kernel_table(graph, 3)
            be.release_all(eng, ids)
            floor = _weights_floor(eng, b, 15)
            if floor is None:
                print(f"b={b}: weights floor: not for this model's layers (MoE or latent attention)", flush=True)
            else:
                print(
                    f"b={b}: weights alone (F.linear graph) {floor['ms']:.3f} ms = {floor['GBps']:,.0f} GB/s "
                    f"({floor['GBps'] / copy_gbps:.1%} of copy); per shape: "
                    + ", ".join(
                        f"{k} {v['us']:.1f} us {v['GBps']:,.0f} GB/s" for k, v in floor["by_shape"].items()
                    ),
                    flush=True,
                )
            row = {
                "weights_floor": floor,
                "batch": b,
                "step_ms": step_ms,
                "replay_ms": graph_replay_ms,
                "host_ms": step_ms - graph_replay_ms,
                "kernel_ms": kernel_us / 1e3,
                "num_kernels": sum(k["per_step"] for k in kernels),
                "kernels": kernels[:40],
            }
            report["rows"].append(row)
            print(
                f"\nb={b}: step {step_ms:.3f} ms wall, graph replay {graph_replay_ms:.3f} ms GPU (host {step_ms - graph_replay_ms:.3f} ms), "
                f"kernels {kernel_us / 1e3:.3f} ms in {row['num_kernels']:.0f} launches",
                flush=True,
            )
            for k in kernels[:30]:
                print(f"  {k['us_per_step']:9.1f} us  x{k['per_step']:<5.0f} {k['kernel']}")
        if args.prefill:
            del eng
            torch.cuda.empty_cache()
            profile_prefill(folder, args.prefill, from_flags(ForwardConfig, args), report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_decode_{args.model}{'_' + args.tag if args.tag else ''}.json").write_text(json.dumps(report, indent=1))
    return 0


def profile_prefill(folder: Path, tokens: int, forward: ForwardConfig, report: dict[str, Any]) -> None:
    """One prompt of `tokens` tokens prefilled in one chunk: its wall time (median of 3) and the GPU time of
    each kernel of one run (torch.profiler), to see where a long prefill's time goes."""
    from torch.profiler import ProfilerActivity, profile

    be = _bench_engine()
    eng = LLMEngine(EngineConfig(model=str(folder), load_format="dummy", max_num_seqs=2, max_model_len=tokens + 64,
                                 max_num_batched_tokens=tokens, kv_cache_gb=kv_gib(folder, 2, tokens + 64),
                                 hicache_gb=0, enforce_eager=True, forward=forward))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompts = be.random_prompts(5, tokens, eng.arch.vocab_size, 7)

    def once(i: int) -> None:
        eng.add_request(f"pf{i}", prompts[i], params)
        while eng.has_unfinished():
            eng.step()
        be.release_all(eng, [f"pf{i}"])

    once(0)
    runs = iter(range(1, 4))
    wall = _median_ms(lambda: once(next(runs)), 3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        once(4)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.count:
            rows.append({"kernel": e.key[:90], "count": e.count, "ms": t / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    print(f"\nprefill {tokens}: wall {wall:.1f} ms, kernels {total:.1f} ms", flush=True)
    for r in rows[:22]:
        print(f"  {r['ms']:9.2f} ms  x{r['count']:<5} {r['kernel']}")
    report["prefill"] = {"tokens": tokens, "wall_ms": wall, "kernel_ms": total, "kernels": rows[:40]}


def has_sliding(folder: Path) -> bool:
    from engine.models.registry import arch_from_hf, load_hf_config

    return arch_from_hf(load_hf_config(folder)).has_sliding


def kv_gib(folder: Path, batch: int, max_len: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """KV memory for `batch` sequences of max_len tokens: their pages (two spare each) and, for a hybrid
    model, one SWA state slot each and a spare (the engine gives slots their share first)."""
    from engine.core.kv_cache import layout_of
    from engine.models.registry import arch_from_hf, load_hf_config

    arch = arch_from_hf(load_hf_config(folder))
    layout = layout_of(arch, 128, dtype)
    pages = batch * (max_len / 128 + 2) * layout.page_bytes if arch.has_full else 0
    slots = (batch + 1) * layout.state_bytes if arch.has_sliding else 0
    return (pages + slots) / 2**30


if __name__ == "__main__":
    sys.exit(main())
