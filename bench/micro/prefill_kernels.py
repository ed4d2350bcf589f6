"""Prefill attention and batch-invariant matmul kernels against their torch alternatives, on one GPU.

1. Prefill attention at Llama-3-8B head shapes (32 heads, 8 kv heads, head_dim 128, bf16, 128-token
   pages), full layers and sliding layers (window 1024): a whole 8k prompt, the last 2k chunk of an 8k
   prompt (6k cached), the last 8k chunk of a 32k prompt. Candidates: pdkernels/prefill_attention.py
   (a few tile configurations), the engine's previous path (keys gathered, SDPA with a boolean mask)
   and SDPA's flash backend with a lower-right causal mask over gathered keys (full layers only: it
   has no sliding window). TFLOP/s count 4 x heads x head_dim per visible (query, key) pair.
2. pdkernels/bi_matmul.py at the 8B model's projection shapes, for several row counts, against cuBLAS
   (F.linear): TFLOP/s, and for small M the weight bytes read per second. Each time is one eager call:
   at small M a split-K weight (two Triton launches from Python) is bound by launch overhead here
   (seen on an H200: 0.11-0.14 ms for 20-60 us of reading), while the engine replays decode steps as
   CUDA graphs, where it is not: engine_speed.py's deterministic decode rows are the number that counts.
3. Whether torch's own RMSNorm arithmetic (the model's CPU code, run on CUDA) is batch-invariant.

    python bench/micro/prefill_kernels.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from pdkernels import bi_matmul as bim  # noqa: E402
from pdkernels import prefill_attention as pa  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 128
WINDOW = 1024
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DT = torch.bfloat16 if DEV.type == "cuda" else torch.float32
# (kind, cached prefix, chunk tokens, window)
ATTN_CASES = [("full", 0, 8192, 0), ("full", 6144, 2048, 0), ("full", 24576, 8192, 0),
              ("sliding", 0, 8192, WINDOW), ("sliding", 6144, 2048, WINDOW)]


def bench_ms(fn: Any, rep_ms: int = 60) -> float:
    if DEV.type != "cuda":  # --smoke: one host-timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))


def visible_pairs(pos0: int, n: int, window: int) -> int:
    total = 0
    for i in range(n):  # fine for the sizes here
        p = pos0 + i
        total += min(p + 1, window) if window else p + 1
    return total


class AttnCase:
    """A chunk [pos0, pos0 + n) of one sequence, its pages (full) or ring (sliding) filled at random."""

    def __init__(self, pos0: int, n: int, window: int) -> None:
        self.pos0, self.n, self.window = pos0, n, window
        end = pos0 + n
        g = torch.Generator(device=DEV).manual_seed(pos0 + n + window)
        self.q = torch.randn(n, HEADS, DIM, device=DEV, generator=g).to(DT)
        self.k = torch.randn(n, KV_HEADS, DIM, device=DEV, generator=g).to(DT)
        self.v = torch.randn(n, KV_HEADS, DIM, device=DEV, generator=g).to(DT)
        if window:
            self.cache = torch.randn(2, 1, 2, window, KV_HEADS, DIM, device=DEV, generator=g).to(DT)
            self.block_ids: list[int] = []
            self.slot = 1
        else:
            nb = math.ceil(end / BLOCK)
            self.cache = torch.randn(nb + 4, 1, 2, BLOCK, KV_HEADS, DIM, device=DEV, generator=g).to(DT)
            self.block_ids = torch.randperm(nb + 4, generator=torch.Generator().manual_seed(1))[:nb].tolist()
            self.slot = 0
        self.flops = 4.0 * HEADS * DIM * visible_pairs(pos0, n, window)

    def triton_fn(self, cfg: pa.TileConfig) -> Any:
        meta = pa.chunk_meta([0], [self.n], [self.pos0], [self.block_ids], [self.slot], cfg.tile_tokens, BLOCK, DEV)
        out = torch.empty_like(self.q)
        return lambda: pa.prefill_attention(self.q, self.k, self.v, self.cache, 0, meta, DIM**-0.5, self.window,
                                            out=out, config=cfg)

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Keys/values in position order (what the engine's previous path built per layer)."""
        if self.window:
            lo = max(0, self.pos0 - self.window)
            idx = torch.arange(lo, self.pos0, device=DEV) % self.window
            ks = torch.cat([self.cache[self.slot, 0, 0, idx], self.k])
            vs = torch.cat([self.cache[self.slot, 0, 1, idx], self.v])
            return ks, vs, lo
        ids = torch.tensor(self.block_ids, device=DEV)
        kv = self.cache[ids, 0]
        end = self.pos0 + self.n
        return kv[:, 0].reshape(-1, KV_HEADS, DIM)[:end], kv[:, 1].reshape(-1, KV_HEADS, DIM)[:end], 0

    def sdpa_mask_fn(self) -> Any:
        from engine.layers.attention import sdpa_attend

        def run() -> torch.Tensor:
            ks, vs, lo = self.gathered()
            return sdpa_attend(self.q, ks, vs, self.pos0, lo, self.window or None, DIM**-0.5, BLOCK)

        return run

    def sdpa_flash_fn(self, gqa: bool) -> Any:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        def run() -> torch.Tensor:
            ks, vs, _ = self.gathered()
            q = self.q.transpose(0, 1)[None]
            k = ks.transpose(0, 1)[None]
            v = vs.transpose(0, 1)[None]
            if not gqa:
                k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
                v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
            mask = causal_lower_right(q.shape[2], k.shape[2])
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=DIM**-0.5, enable_gqa=gqa)
            return out[0].transpose(0, 1)

        return run


def attention_rows(quick: bool) -> list[dict[str, Any]]:
    base = pa.tile_config(HEADS, KV_HEADS, DIM)
    variants = {"triton": base}
    if not quick:
        variants["triton s3"] = pa.TileConfig(**{**base.__dict__, "num_stages": 3})
        variants["triton n128"] = pa.TileConfig(**{**base.__dict__, "block_n": 128})
        variants["triton m64"] = pa.TileConfig(**{**base.__dict__, "tile_tokens": 16, "num_warps": 4})
    rows = []
    for kind, pos0, n, window in ATTN_CASES:
        case = AttnCase(pos0, n, window)
        ref = case.sdpa_mask_fn()()
        cands: dict[str, Any] = {name: case.triton_fn(cfg) for name, cfg in variants.items()}
        cands["sdpa mask (old)"] = case.sdpa_mask_fn()
        if not window:
            cands["sdpa flash gqa"] = case.sdpa_flash_fn(True)
            cands["sdpa flash rep"] = case.sdpa_flash_fn(False)
        for name, fn in cands.items():
            row: dict[str, Any] = {"kind": kind, "pos0": pos0, "n": n, "impl": name}
            try:
                out = fn()
                row["rel_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
                row["ms"] = bench_ms(fn)
                row["tflops"] = case.flops / row["ms"] / 1e9
            except Exception as e:  # a backend that refuses the case: say so, go on
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


# (name, N, K) of Llama-3-8B's projections with q/k/v and gate/up fused (engine/models/decoder.py on CUDA)
MM_SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
             ("lm_head", 128256, 4096)]
MM_ROWS = [1, 8, 64, 256, 2048, 8192]


class WeightRing:
    """A few copies of one weight, handed out in turn, so small-M rows read weights from HBM, not L2."""

    def __init__(self, n: int, k: int, copies: int = 3) -> None:
        self.ws = [torch.randn(n, k, device=DEV, dtype=DT) for _ in range(copies)]
        self.i = 0

    def __call__(self) -> torch.Tensor:
        self.i = (self.i + 1) % len(self.ws)
        return self.ws[self.i]


def matmul_candidates(x: torch.Tensor, w: WeightRing, quick: bool, chosen: bim.MatmulConfig) -> dict[str, Any]:
    """cuBLAS, the chosen configuration, and (always) the chosen one at 8 warps: at 4 warps its 64x128x64
    tile spills 312-416 bytes in an offline compile for sm_90a (bench/checks/offline_compile.py), at 8 none."""
    alts = {
        "m64 n64": bim.MatmulConfig(64, 64, 64, 4, 4),
        "m64 n128": bim.MatmulConfig(64, 128, 64, 4, 4),
        "m128 n128 w8": bim.MatmulConfig(128, 128, 64, 8, 3),
        "m128 n256 w8": bim.MatmulConfig(128, 256, 64, 8, 3),
    }
    cands: dict[str, Any] = {"cublas": lambda: F.linear(x, w()), "bi (chosen)": lambda: bim.bi_linear(x, w())}
    w8 = dataclasses.replace(chosen, num_warps=8)
    cands["bi (chosen) w8"] = lambda: bim.bi_matmul(x, w().t(), config=w8)
    if not quick:
        for name, cfg in alts.items():
            cands[f"bi {name}"] = lambda cfg=cfg: bim.bi_matmul(x, w().t(), config=cfg)
    return cands


def matmul_rows(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for name, n, k in MM_SHAPES:
        ring = WeightRing(n, k)
        chosen = bim.matmul_config(n, k)
        for m in MM_ROWS:
            x = torch.randn(m, k, device=DEV, dtype=DT)
            for cn, fn in matmul_candidates(x, ring, quick, chosen).items():
                row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m, "impl": cn}
                if cn == "bi (chosen)":
                    row["config"] = chosen.__dict__
                try:
                    t = bench_ms(fn, 40)
                    row["ms"] = t
                    row["tflops"] = 2.0 * m * n * k / t / 1e9
                    row["weight_gbps"] = n * k * 2 / t / 1e6
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
            print(json.dumps([r for r in rows if r["m"] == m and r["shape"] == name]), flush=True)
        del ring
        torch.cuda.empty_cache()
    return rows


def rmsnorm_check() -> dict[str, Any]:
    """Rows of torch's RMSNorm arithmetic (engine.model.RMSNorm's CPU code) across row counts."""
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(2048, 4096, device=DEV, generator=g).to(DT)
    w = torch.randn(4096, device=DEV, generator=g).to(DT)

    def norm(t: torch.Tensor) -> torch.Tensor:
        tf = t.float()
        tf = tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-5)
        return w * tf.to(t.dtype)

    alone = torch.cat([norm(x[i : i + 1]) for i in range(256)])
    differing = [m for m in (1, 3, 16, 17, 64, 200, 256) if not torch.equal(norm(x[:m]), alone[:m])]
    big = norm(x)[:256]
    if not torch.equal(big, alone):
        differing.append(2048)
    return {"torch_rmsnorm_row_counts_differing_from_alone": differing}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the chosen configurations only")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results"))
    p.add_argument("--parts", default="attention,matmul,rmsnorm")
    p.add_argument("--smoke", action="store_true", help="toy sizes (runs on the CPU under TRITON_INTERPRET=1)")
    args = p.parse_args()
    if args.smoke:
        global ATTN_CASES, MM_SHAPES, MM_ROWS, WINDOW
        WINDOW = 48
        ATTN_CASES = [("full", 0, 100, 0), ("full", 130, 40, 0), ("sliding", 70, 60, WINDOW)]
        MM_SHAPES, MM_ROWS = [("tiny", 96, 128)], [1, 70]
    parts = args.parts.split(",")
    t0 = time.monotonic()
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "torch": torch.__version__,
                              "triton": triton.__version__}
    if "rmsnorm" in parts:
        result["rmsnorm"] = rmsnorm_check()
        print(json.dumps(result["rmsnorm"]), flush=True)
    if "attention" in parts:
        result["attention"] = attention_rows(args.quick)
    if "matmul" in parts:
        result["matmul"] = matmul_rows(args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_kernels.json").write_text(json.dumps(result, indent=1))
    print(f"\n{time.monotonic() - t0:.0f} s on {result['gpu']}, torch {result['torch']}, triton {result['triton']}")
    for r in result.get("attention", []):
        val = f"{r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s err {r['rel_err']:.1e}" if "ms" in r else r["error"]
        print(f"attn {r['kind']:7s} pos0={r['pos0']:5d} n={r['n']:4d} {r['impl']:16s} {val}")
    for r in result.get("matmul", []):
        val = (f"{r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s {r['weight_gbps']:6.0f} GB/s"
               if "ms" in r else r["error"])
        print(f"mm {r['shape']:8s} m={r['m']:5d} {r['impl']:16s} {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
