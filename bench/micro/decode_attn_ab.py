"""The paged decode attention kernel alone, from the tree given, at llama8b's shape: 64 sequences of
1,025 tokens (32 query heads, 8 KV heads of 128, 128-token pages), the new token's k/v passed in, with
and without the rotary inside the kernel where the tree has it; 10 calls in a CUDA graph, median of 7.
An A/B between trees (unpacked from `python bench/speed_guard.py pack ...`) on one GPU:

    python bench/micro/decode_attn_ab.py /tmp/t_0e19af7 0e19af7
    python bench/micro/decode_attn_ab.py . HEAD
"""

from __future__ import annotations

import importlib
import sys

import torch

BATCH, HEADS, KV_HEADS, HEAD_DIM, PAGE, CONTEXT = 64, 32, 8, 128, 128, 1025


def main() -> None:
    root, label = sys.argv[1], sys.argv[2]
    sys.path.insert(0, root)
    da = importlib.import_module("pdkernels.decode_attention")
    dev, dt = torch.device("cuda"), torch.bfloat16
    per = -(-CONTEXT // PAGE)
    g = torch.Generator(device=dev).manual_seed(0)
    cache = torch.randn(BATCH * per + 1, 1, 2, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g)
    table = (torch.arange(BATCH * per, device=dev, dtype=torch.int32) + 1).view(BATCH, per)
    ctx = torch.full((BATCH,), CONTEXT, device=dev, dtype=torch.int32)
    qkv = torch.randn(BATCH, HEADS + 2 * KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=g)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    out = torch.empty(BATCH, HEADS, HEAD_DIM, device=dev, dtype=dt)
    cos = torch.randn(BATCH, HEAD_DIM, device=dev, dtype=dt, generator=g)
    sin = torch.randn(BATCH, HEAD_DIM, device=dev, dtype=dt, generator=g)
    variants: dict[str, dict] = {"plain": {}}
    if hasattr(da, "Rope"):
        variants["rope"] = {"rope": da.Rope(cos, sin)}
    kv_bytes = BATCH * CONTEXT * KV_HEADS * HEAD_DIM * 2 * 2
    for name, kw in variants.items():
        def call(kw: dict = kw) -> None:
            da.paged_decode_attention(q, cache, 0, table, ctx, 0.088, window=0, out=out, k_new=k, v_new=v,
                                      min_split=da.WIDE_SPLIT_TOKENS, **kw)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                call()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 10)
        ms = sorted(times)[len(times) // 2]
        print(f"{label:10s} {name:6s} {ms * 1e3:8.1f} us  {kv_bytes / ms / 1e6:8.0f} GB/s (KV read)", flush=True)


if __name__ == "__main__":
    main()
