"""The paged decode attention kernel's tile and split constants, swept on the GPU.

For each configuration (keys per tile, fewest keys per split, warps, pipeline stages, PAGE_TILES) and each
(batch, context): 32 layers' launches (distinct KV per layer, so the KV streams from HBM as in a decode
step, new K/V stored as the engine does) captured in one CUDA graph; prints us per layer and the GB/s of
KV read, against the device-copy ceiling of the same run, and each configuration's largest relative
difference from the first (the split layout changes the float sums, nothing else).

    python bench/micro/decode_attn.py --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pdkernels.decode_attention as da  # noqa: E402
from bench.micro.engine_speed import copy_bytes_per_s, replay_ms  # noqa: E402

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 32, 32, 8, 128, 128


def workload(batch: int, ctx: int) -> dict[str, Any]:
    need = -(-(ctx + 1) // BLOCK)
    cache = torch.randn(batch * need + 1, LAYERS, 2, BLOCK, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(batch * need, device="cuda").view(batch, need).to(torch.int32)
    return dict(
        cache=cache, table=table, ctx=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        q=torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16),
        k=torch.randn(batch, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16),
        v=torch.randn(batch, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16),
        out=torch.empty(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16),
    )  # fmt: skip


def run(w: dict[str, Any]) -> None:
    for layer in range(LAYERS):
        da.paged_decode_attention(w["q"], w["cache"], layer, w["table"], w["ctx"], 0.088, out=w["out"],
                                  k_new=w["k"], v_new=w["v"])  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1x1024,64x1024,8x8192,1x8192,256x1024")
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="the current and a few promising configurations only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("decode_attn: needs CUDA")
        return 0
    ceiling = copy_bytes_per_s(torch.device("cuda")) / 1e9
    print(f"copy ceiling {ceiling:,.0f} GB/s (read + write)", flush=True)
    current = (da.BLOCK_N, da.MIN_SPLIT_TOKENS, da.NUM_WARPS, da.NUM_STAGES, da.PAGE_TILES)
    if args.quick:
        tiles = [(64, 128, 4, 2), (64, 256, 4, 2), (32, 256, 4, 2), (128, 128, 8, 2), (128, 256, 8, 2), (64, 256, 4, 3), (128, 512, 8, 3)]
    else:
        tiles = [c for c in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 3)) if c[1] >= c[0]]
    configs = [current] + [(*c, pt) for c in tiles for pt in (True, False) if (*c, pt) != current]
    rows = []
    for shape in args.shapes.split(","):
        batch, ctx = (int(x) for x in shape.split("x"))
        w = workload(batch, ctx)
        kv_bytes = LAYERS * batch * ctx * 2 * KV_HEADS * DIM * 2
        first = None
        for block_n, min_split, warps, stages, page_tiles in configs:
            da.BLOCK_N, da.MIN_SPLIT_TOKENS, da.NUM_WARPS, da.NUM_STAGES = block_n, min_split, warps, stages
            da.PAGE_TILES = page_tiles
            try:
                run(w)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    run(w)
                ms = replay_ms(g)
            except Exception as e:  # a tile that does not fit shared memory: skip it
                print(f"  {block_n}/{min_split}/{warps}/{stages}/{page_tiles}: {type(e).__name__}", flush=True)
                continue
            out = w["out"].float().clone()
            diff = 0.0 if first is None else float((out - first).norm() / first.norm())
            first = out if first is None else first
            row = dict(batch=batch, ctx=ctx, block_n=block_n, min_split=min_split, warps=warps, stages=stages,
                       page_tiles=page_tiles, us_per_layer=ms * 1e3 / LAYERS, gbps=kv_bytes / (ms / 1e3) / 1e9, rel_diff=diff)  # fmt: skip
            rows.append(row)
        best = sorted((r for r in rows if (r["batch"], r["ctx"]) == (batch, ctx)), key=lambda r: r["us_per_layer"])
        base = next(r for r in rows if (r["batch"], r["ctx"]) == (batch, ctx))
        print(f"b={batch} ctx={ctx}: current {'/'.join(map(str, current))} {base['us_per_layer']:.1f} us/layer "
              f"({base['gbps'] / ceiling:.0%} of copy); best:", flush=True)  # fmt: skip
        for r in best[:5]:
            print(f"   {r['block_n']}/{r['min_split']}/{r['warps']}/{r['stages']}/{r['page_tiles']}: {r['us_per_layer']:.1f} us/layer, "
                  f"{r['gbps']:,.0f} GB/s ({r['gbps'] / ceiling:.0%}), diff {r['rel_diff']:.1e}")  # fmt: skip
        del w
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode_attn.json").write_text(json.dumps({"copy_GBps": ceiling, "rows": rows}, indent=1))
    # the configurations' mean rank over the shapes (lower is better)
    ranks: dict[tuple, list[int]] = {}
    for shape in {(r["batch"], r["ctx"]) for r in rows}:
        ordered = sorted((r for r in rows if (r["batch"], r["ctx"]) == shape), key=lambda r: r["us_per_layer"])
        for i, r in enumerate(ordered):
            ranks.setdefault((r["block_n"], r["min_split"], r["warps"], r["stages"], r["page_tiles"]), []).append(i)
    print("mean rank over shapes:", sorted((sum(v) / len(v), k) for k in ranks for v in [ranks[k]])[:6])
    return 0


if __name__ == "__main__":
    sys.exit(main())
