#!/usr/bin/env python3
"""Prefix-cache speed on a GPU: the page-copy kernel against the pinned host<->device bandwidth,
and the TTFT of a long conversation's next turn with and without the host cache.

    python bench/micro/prefix_cache.py --config bench/configs/llama8b.json --context 16384 --new 300

Ceilings measured in the same run: a 1 GiB pinned host->device (and device->host) copy. The TTFT
bar: with the cache at most 20% of the same turn without it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from pdkernels.page_copy import copy_units  # noqa: E402


def _time_cuda(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bench(page_bytes: int, num_pages_list: list[int]) -> list[dict]:
    big = 1 << 30
    pinned = torch.empty(big, dtype=torch.uint8).pin_memory()
    device_buf = torch.empty(big, dtype=torch.uint8, device="cuda")
    h2d = big / _time_cuda(lambda: device_buf.copy_(pinned, non_blocking=True)) / 1e9
    d2h = big / _time_cuda(lambda: pinned.copy_(device_buf, non_blocking=True)) / 1e9
    pinned = device_buf = torch.empty(0)
    rows = []
    pool = 512
    elems = page_bytes // 2
    gpu = torch.randn(pool, elems, device="cuda").to(torch.bfloat16)
    cpu = torch.empty(pool, elems, dtype=torch.bfloat16).pin_memory()
    for n in num_pages_list:
        src = torch.randperm(pool)[:n].tolist()
        dst = torch.randperm(pool)[:n].tolist()
        t_in = _time_cuda(lambda s=src, d=dst: copy_units(cpu, s, gpu, d))
        t_out = _time_cuda(lambda s=src, d=dst: copy_units(gpu, s, cpu, d))
        gb = n * page_bytes / 1e9
        rows.append(dict(pages=n, mib=n * page_bytes / 2**20, h2d_gbs=gb / t_in, d2h_gbs=gb / t_out, h2d_ceiling=h2d, d2h_ceiling=d2h))
    return rows


def ttft_bench(config: Path, context: int, new: int, hicache_gb: float) -> dict:
    folder = Path(tempfile.mkdtemp())
    shutil.copy(config, folder / "config.json")
    eng = LLMEngine(
        EngineConfig(model=str(folder), device="cuda", load_format="dummy", max_model_len=context + new + 64,
                     max_num_batched_tokens=8192, hicache_gb=hicache_gb)
    )
    gen = torch.Generator().manual_seed(0)
    history = torch.randint(100, 30000, (context,), generator=gen).tolist()

    def turn() -> list[int]:  # a fresh new message each run: only the history can hit
        return history + torch.randint(100, 30000, (new,), generator=gen).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def first_token_s(rid: str, prompt: list[int], use_cache: bool) -> tuple[float, int]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.add_request(rid, prompt, params, use_prefix_cache=use_cache)
        cached = 0
        while eng.has_unfinished():
            for o in eng.step():
                cached = o.num_cached_tokens
        torch.cuda.synchronize()
        return time.perf_counter() - t, cached

    first_token_s("warm", history[:2048], False)
    first_token_s("turn1", history, True)  # writes the conversation through to host memory
    off = sorted(first_token_s(f"off{i}", turn(), False)[0] for i in range(3))[1]
    on_runs = [first_token_s(f"on{i}", turn(), True) for i in range(3)]
    on = sorted(t for t, _ in on_runs)[1]
    st = eng.stats()
    return dict(context=context, new_tokens=new, ttft_off_s=off, ttft_on_s=on, ratio=on / off, cached_tokens=on_runs[-1][1],
                page_bytes=eng.layout.page_bytes, bytes_to_device=st.cache_bytes_to_device_total)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(REPO / "bench/configs/llama8b.json"))
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--new", type=int, default=300)
    ap.add_argument("--hicache-gb", type=float, default=6.0)
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "bench/results")))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures GPU copies and GPU TTFT; nothing to do")
        return 0
    page_bytes = 32 * 2 * 128 * 8 * 128 * 2  # an 8B-shaped page: 32 layers, k+v, 128 tokens, 8 heads x 128, bf16
    copies = copy_bench(page_bytes, [1, 8, 64, 256])
    ttft = ttft_bench(Path(args.config), args.context, args.new, args.hicache_gb)
    print(f"\n== prefix cache on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    print(f"{'pages':>6} {'MiB':>8} {'h2d GB/s':>9} {'of pinned h2d':>14} {'d2h GB/s':>9} {'of pinned d2h':>14}")
    for r in copies:
        print(f"{r['pages']:>6} {r['mib']:>8.0f} {r['h2d_gbs']:>9.1f} {r['h2d_gbs'] / r['h2d_ceiling']:>13.0%} "
              f"{r['d2h_gbs']:>9.1f} {r['d2h_gbs'] / r['d2h_ceiling']:>13.0%}")
    print(f"ceilings: pinned h2d {copies[0]['h2d_ceiling']:.1f} GB/s, d2h {copies[0]['d2h_ceiling']:.1f} GB/s (1 GiB copy)")
    print(f"TTFT of a {ttft['context']}-token conversation's next turn (+{ttft['new_tokens']} tokens): "
          f"without cache {ttft['ttft_off_s'] * 1e3:.0f} ms, with cache {ttft['ttft_on_s'] * 1e3:.0f} ms "
          f"({ttft['ratio']:.0%}; bar 20%), cached tokens {ttft['cached_tokens']}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "prefix_cache_bench.json").write_text(json.dumps(dict(copies=copies, ttft=ttft), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
