"""One MoE layer through pdkernels/moe_gemm.py's fused_moe (default tiles and batch-invariant) against
fused_moe_reference (torch, a loop over the experts) and against two ceilings measured in the same run,
at Qwen3-30B-A3B's layer shape (H 2048, I 768, 128 experts, top-8, SwiGLU) and gpt-oss-20b's (H 2880,
I 2880, 32 experts, top-4, biases, clamped SwiGLU), for 1, 4, 64 and 8192 tokens in bf16 on one GPU
(up to twice fused_moe's MAX_GEMV_TOKENS its two paths side by side: `gemv` and `grouped`).

    bytes ceiling  the bytes a step must read or write (the weights and biases of the experts the
                   batch's tokens picked, the tokens in, the output out) / the device copy bandwidth
                   (engine_speed.py's ceilings: a 4 GiB eager device-to-device copy, bytes read + written / time)
    flops ceiling  2 * T * k * 3 * H * I / the rate of a bf16 8192^3 torch matmul

Routing is uniform (k distinct experts per token from random logits, fixed seed). Each fused_moe time
is one replay of a CUDA graph that runs the layer over LAYER_COPIES copies of its weights (more than
the L2 holds, as in a forward pass), divided by the copies; the reference syncs with the host, so it
runs eagerly. Prints one table; --out writes JSON. --tiny rehearses the script on the CPU at tiny
shapes, through the reference only.

--w8a8-sweep times, instead, the w8a8 layer (FP8 weights and activations) of the models whose H and I
are multiples of 128 with each of W8A8_TILES' candidate tiles for one grouped GEMM, the other at
gemm_config's, then with both at the fastest found; beside each its error against gemm_config's tiles'
output and ptxas's registers and spills for sm_90a (bench/checks/offline_compile.py's compile, as the
launch specializes it). With --tiny (and TRITON_INTERPRET=1) it rehearses on the CPU, timed eagerly.

    python bench/micro/moe_layer.py [--tokens 1,4,64,8192] [--fp8] [--out DIR]
    python bench/micro/moe_layer.py --tiny
    python bench/micro/moe_layer.py --w8a8-sweep [--tokens 64,8192] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.micro.engine_speed import graph_ms, measure_ceilings  # noqa: E402
from pdkernels.moe_gemm import MAX_GEMV_TOKENS, fused_moe_reference  # noqa: E402

GEMV_ROWS_UP_TO = 2 * MAX_GEMV_TOKENS  # both of fused_moe's paths timed up to this many tokens

LAYER_COPIES = 4
SEED = 0


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    inter: int
    num_experts: int
    top_k: int
    has_bias: bool
    activation: str


MODELS = {
    "qwen3-30b-a3b": MoEShape(2048, 768, 128, 8, False, "swiglu"),
    "gpt-oss-20b": MoEShape(2880, 2880, 32, 4, True, "swiglu_oai"),
}
TINY_MODELS = {
    "tiny": MoEShape(64, 32, 8, 2, False, "swiglu"),
    "tiny-oai": MoEShape(64, 32, 8, 2, True, "swiglu_oai"),
    "tiny-w8a8": MoEShape(256, 128, 8, 2, False, "swiglu"),  # H and I whole 128-blocks: --w8a8-sweep's
}
TINY_SWEEP_TOKENS = [8, 256]  # 2 and 64 rows per expert: the decode and the prefill candidates

# --w8a8-sweep's candidates per grouped GEMM, (BLOCK_M, BLOCK_N, num_warps, num_stages) with BLOCK_K 128:
# "decode" where gemm_config picks 16-row tiles, "prefill" above. At Qwen3-30B-A3B's shapes none spills
# at sm_90a (offline_compile.py) but the down tile 128x128 with 8 warps (80 bytes), gemm_config's before
# this sweep chose 64x128 (bench/figures/fp8-h100.md)
W8A8_TILES = {
    "decode": {
        "gate/up": [(16, 32, 4, 4), (16, 32, 4, 5), (16, 32, 2, 4), (16, 64, 4, 4), (16, 64, 2, 4), (16, 128, 4, 4)],
        "down": [(16, 64, 4, 4), (16, 64, 4, 5), (16, 32, 4, 4), (16, 64, 2, 4), (16, 128, 4, 4), (16, 256, 4, 3)],
    },
    "prefill": {
        "gate/up": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 8, 3), (64, 64, 8, 4), (64, 64, 4, 4),
                    (128, 32, 4, 4), (128, 32, 8, 4), (256, 32, 8, 3)],
        "down": [(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4),
                 (64, 128, 8, 3), (64, 256, 8, 3), (256, 64, 8, 3), (64, 64, 8, 4)],
    },
}


def make_layer(shape: MoEShape, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> dict[str, Any]:
    e, h, i = shape.num_experts, shape.hidden, shape.inter

    def rand(*size: int, scale: float) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device) * scale).to(dtype)

    return {
        "w_gate_up": rand(e, 2 * i, h, scale=h**-0.5),
        "w_down": rand(e, h, i, scale=i**-0.5),
        "b_gate_up": rand(e, 2 * i, scale=0.1) if shape.has_bias else None,
        "b_down": rand(e, h, scale=0.1) if shape.has_bias else None,
    }


def route(shape: MoEShape, num_tokens: int, device: torch.device, dtype: torch.dtype,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(num_tokens, shape.num_experts, generator=gen, device=device)
    values, ids = logits.topk(shape.top_k, dim=-1)
    return ids, torch.softmax(values, dim=-1).to(dtype)


def step_bytes(shape: MoEShape, ids: torch.Tensor, element_bytes: int) -> int:
    """What the step cannot avoid moving: the picked experts' weights and biases, tokens in, output out."""
    h, i = shape.hidden, shape.inter
    per_expert = 3 * h * i + (3 * i + h if shape.has_bias else 0)  # gate_up 2I x H, down H x I
    return (ids.unique().numel() * per_expert + 2 * ids.shape[0] * h) * element_bytes


def step_flops(shape: MoEShape, num_tokens: int) -> int:
    return 2 * num_tokens * shape.top_k * 3 * shape.hidden * shape.inter


def eager_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def fp8_layer(layer: dict[str, Any]) -> dict[str, Any]:
    """layer's expert weights quantized to 128x128-block FP8 (engine/layers/fp8.py), as fused_moe takes them."""
    from engine.layers.fp8 import quantize

    gu8, gu_s = quantize(layer["w_gate_up"])
    d8, d_s = quantize(layer["w_down"])
    return {**layer, "w_gate_up": gu8, "w_down": d8, "w_gate_up_scale": gu_s, "w_down_scale": d_s}


def bench_tokens(name: str, shape: MoEShape, layers: list[dict[str, Any]], num_tokens: int,
                 gen: torch.Generator, gbps: float | None, tflops: float | None,
                 fp8_layers: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The reference and, on CUDA, fused_moe's paths and the ceiling, at one token count; with fp8_layers
    also FP8 weights (`fp8`; `fp8 gemv` and `fp8 grouped` at few tokens, the grouped GEMM dequantizing each
    tile in registers) and with the activations in FP8 too (`fp8 w8a8`), their error against the
    reference on the dequantized weights (no ceiling: the rows compare with the bf16 ones above them)."""
    from pdkernels.moe_gemm import fused_moe

    w0 = layers[0]["w_gate_up"]
    device, dtype = w0.device, w0.dtype
    x = torch.randn(num_tokens, shape.hidden, generator=gen, device=device).to(dtype)
    ids, weights = route(shape, num_tokens, device, dtype, gen)
    kw: dict[str, Any] = {"activation": shape.activation}
    nbytes = step_bytes(shape, ids, w0.element_size())
    flops = step_flops(shape, num_tokens)
    floor_ms = max(nbytes / gbps / 1e6, flops / tflops / 1e9) if gbps and tflops else None

    def row(impl: str, ms: float, err: float | None = None) -> dict[str, Any]:
        return {"model": name, "tokens": num_tokens, "impl": impl, "ms": ms, "GBps": nbytes / ms / 1e6,
                "TFLOPs": flops / ms / 1e9, "of_ceiling": floor_ms / ms if floor_ms else None, "err": err}

    reps = 3 if num_tokens >= 4096 else 10

    def reference() -> torch.Tensor:
        return fused_moe_reference(x, ids, weights, **layers[0], **kw)

    ref = reference()
    rows = [row("torch reference", eager_ms(reference, reps=reps))]
    if device.type != "cuda":
        return rows

    def timed(label: str, copies: list[dict[str, Any]], want: torch.Tensor, extra: dict[str, Any]) -> dict[str, Any]:
        """fused_moe over the layer's copies in one CUDA graph, per layer, and its error against want."""
        out = fused_moe(x, ids, weights, **copies[0], **kw, **extra)

        def run() -> None:
            for layer in copies:
                fused_moe(x, ids, weights, **layer, **kw, **extra)

        return row(label, graph_ms(run, reps=reps * 2) / len(copies), rel_err(out, want))

    # fused_moe's default path, or both of its paths where the GEMVs may take this many tokens
    paths: list[tuple[str, dict[str, Any]]] = [("", {})]
    if num_tokens <= GEMV_ROWS_UP_TO:
        paths = [(" gemv", {"gemv_tokens": num_tokens}), (" grouped", {"gemv_tokens": 0})]
    rows += [timed("fused_moe" + suffix, layers, ref, extra) for suffix, extra in paths]
    rows.append(timed("fused_moe bi", layers, ref, {"batch_invariant": True}))
    if fp8_layers:
        from engine.layers.fp8 import dequantize

        first = fp8_layers[0]
        dense = {**layers[0], "w_gate_up": dequantize(first["w_gate_up"], first["w_gate_up_scale"], dtype),
                 "w_down": dequantize(first["w_down"], first["w_down_scale"], dtype)}  # fmt: skip
        ref8 = fused_moe_reference(x, ids, weights, **dense, **kw)
        fp8_paths = [("fp8" + suffix, extra) for suffix, extra in paths] + [("fp8 w8a8", {"fp8_activations": True})]
        rows += [{**timed(label, fp8_layers, ref8, extra), "of_ceiling": None} for label, extra in fp8_paths]
    if floor_ms:
        rows.append(row("ceiling", floor_ms))
    return rows


def ptxas_usage(shape: MoEShape, num_rows: int, gemm: str, cfg: Any) -> str:
    """ptxas's registers and spills for one w8a8 grouped GEMM launch at sm_90a, or why not known."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "- (interpreted kernels: no compile)"
    try:
        from bench.checks.offline_compile import compile_kernel, grouped_gemm_variant, ptxas_report

        is_glu = gemm == "gate/up"
        n, k = (shape.inter, shape.hidden) if is_glu else (shape.hidden, shape.inter)
        _, fn, types, consts, launch = grouped_gemm_variant("w8a8", num_rows, is_glu, n, k, cfg, True, True,
                                                            shape.num_experts)  # fmt: skip
        return ptxas_report(compile_kernel(fn, types, consts, pdl=True, **launch)).split(", PDL")[0]
    except Exception as e:  # no triton backend or ptxas here: the timing stands without it
        return f"- ({type(e).__name__})"


def sweep_w8a8(name: str, shape: MoEShape, fp8_layers: list[dict[str, Any]], num_tokens: int,
               dtype: torch.dtype, gen: torch.Generator) -> list[dict[str, Any]]:
    """The w8a8 layer at num_tokens with each candidate tile of one grouped GEMM (W8A8_TILES), the other at
    gemm_config's, then both at the fastest: a row each, gemm_config's tiles first."""
    from pdkernels.moe_gemm import SCALE_BLOCK, GemmConfig, fused_moe, gemm_config

    device = fp8_layers[0]["w_gate_up"].device
    x = torch.randn(num_tokens, shape.hidden, generator=gen, device=device).to(dtype)
    ids, weights = route(shape, num_tokens, device, dtype, gen)
    num_rows, e, h, i = num_tokens * shape.top_k, shape.num_experts, shape.hidden, shape.inter
    default = {gemm: replace(gemm_config(num_rows, e, n, k, gemm == "gate/up", False, fp8_x=True), block_k=SCALE_BLOCK)
               for gemm, n, k in [("gate/up", i, h), ("down", h, i)]}  # fmt: skip
    phase = "decode" if default["gate/up"].block_m == 16 else "prefill"
    kw: dict[str, Any] = {"activation": shape.activation, "fp8_activations": True}
    reps = 3 if num_tokens >= 4096 else 10

    def layer_ms(configs: tuple[GemmConfig, GemmConfig]) -> tuple[float, torch.Tensor]:
        out = fused_moe(x, ids, weights, **fp8_layers[0], **kw, configs=configs)

        def run() -> None:
            for layer in fp8_layers:
                fused_moe(x, ids, weights, **layer, **kw, configs=configs)

        ms = graph_ms(run, reps=reps * 2) if device.type == "cuda" else eager_ms(run, reps=1)
        return ms / len(fp8_layers), out

    base_ms, base = layer_ms((default["gate/up"], default["down"]))

    def row(gemm: str, tiles: str, ms: float, out: torch.Tensor, usage: str = "") -> dict[str, Any]:
        return {"model": name, "tokens": num_tokens, "gemm": gemm, "tiles": tiles, "ms": ms,
                "vs_default": ms / base_ms, "err": rel_err(out, base), "ptxas": usage}

    rows = [row("default", f"{tiles_label(default['gate/up'])} + {tiles_label(default['down'])}", base_ms, base)]
    best = dict(default)
    for gemm in ("gate/up", "down"):
        best_ms = float("inf")
        for block_m, block_n, num_warps, num_stages in W8A8_TILES[phase][gemm]:
            cfg = GemmConfig(block_m, block_n, SCALE_BLOCK, num_warps, num_stages)
            ms, out = layer_ms((cfg, default["down"]) if gemm == "gate/up" else (default["gate/up"], cfg))
            label = gemm + (" *" if cfg == default[gemm] else "")
            rows.append(row(label, tiles_label(cfg), ms, out, ptxas_usage(shape, num_rows, gemm, cfg)))
            if ms < best_ms:
                best_ms, best[gemm] = ms, cfg
    ms, out = layer_ms((best["gate/up"], best["down"]))
    rows.append(row("both fastest", f"{tiles_label(best['gate/up'])} + {tiles_label(best['down'])}", ms, out))
    return rows


def tiles_label(cfg: Any) -> str:
    """BLOCK_MxBLOCK_N, warps and stages of a moe_gemm.GemmConfig (BLOCK_K is 128 in the sweep)."""
    return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"


def print_sweep(rows: list[dict[str, Any]]) -> None:
    """The sweep's table: one GEMM's tiles per row (* gemm_config's), the layer's ms and its ratio to the
    default tiles', the error against their output, ptxas's registers and spills."""
    print(f"{'model':<14} {'T':>5} {'gemm':<12} {'tiles':<34} {'ms':>9} {'vs dflt':>8} {'err':>8}  ptxas sm_90a")
    for r in rows:
        print(f"{r['model']:<14} {r['tokens']:>5} {r['gemm']:<12} {r['tiles']:<34} {r['ms']:9.3f} "
              f"{r['vs_default']:8.3f} {r['err']:8.1e}  {r['ptxas']}")


def bench_model(name: str, shape: MoEShape, token_counts: list[int], device: torch.device,
                gbps: float | None, tflops: float | None, fp8: bool = False) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(SEED)
    copies = LAYER_COPIES if device.type == "cuda" else 1
    layers = [make_layer(shape, device, dtype, gen) for _ in range(copies)]
    # FP8 experts need I a whole number of 128-blocks (the gate rows' blocks end where the up rows' begin)
    can_fp8 = fp8 and device.type == "cuda" and shape.inter % 128 == 0
    fp8_layers = [fp8_layer(layer) for layer in layers] if can_fp8 else None
    rows = []
    for num_tokens in token_counts:
        rows += bench_tokens(name, shape, layers, num_tokens, gen, gbps, tflops, fp8_layers)
    return rows


def run_sweep(args: argparse.Namespace) -> int:
    """--w8a8-sweep: sweep_w8a8's rows for the models whose H and I are whole 128-blocks (w8a8's steps)."""
    if args.tiny:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("moe_layer --w8a8-sweep --tiny: needs TRITON_INTERPRET=1 (the kernels run on the CPU)")
            return 0
        device, models, token_counts = torch.device("cpu"), TINY_MODELS, TINY_SWEEP_TOKENS
    elif not torch.cuda.is_available():
        print("moe_layer --w8a8-sweep: needs CUDA (or --tiny with TRITON_INTERPRET=1)")
        return 0
    else:
        device, models, token_counts = torch.device("cuda"), MODELS, [int(t) for t in args.tokens.split(",")]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    copies = LAYER_COPIES if device.type == "cuda" else 1
    rows = []
    for name, shape in models.items():
        if shape.hidden % 128 or shape.inter % 128:
            continue
        gen = torch.Generator(device=device).manual_seed(SEED)
        fp8_layers = [fp8_layer(make_layer(shape, device, dtype, gen)) for _ in range(copies)]
        for num_tokens in token_counts:
            rows += sweep_w8a8(name, shape, fp8_layers, num_tokens, dtype, gen)
        del fp8_layers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_sweep(rows)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        payload = {"layer_copies": copies, "models": {k: asdict(v) for k, v in models.items()}, "rows": rows}
        (Path(args.out) / "moe_layer_w8a8_sweep.json").write_text(json.dumps(payload, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,4,64,8192")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, the reference only")
    p.add_argument("--fp8", action="store_true",
                   help="CUDA: also FP8 expert weights, dequantized per tile and with FP8 activations (w8a8)")
    p.add_argument("--w8a8-sweep", action="store_true",
                   help="instead: the w8a8 layer per candidate grouped GEMM tile (W8A8_TILES); CUDA, or --tiny "
                        "with TRITON_INTERPRET=1")  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(SEED)
    if args.w8a8_sweep:
        return run_sweep(args)
    if args.tiny:
        device, models, token_counts, gbps, tflops = torch.device("cpu"), TINY_MODELS, [1, 64], None, None
    elif not torch.cuda.is_available():
        print("moe_layer: needs CUDA (or --tiny)")
        return 0
    else:
        device, models = torch.device("cuda"), MODELS
        token_counts = [int(t) for t in args.tokens.split(",")]
        ceilings = measure_ceilings(torch.device("cuda"), torch.bfloat16, tiny=False)  # engine_speed's, eager
        gbps, tflops = ceilings["copy_bytes_per_s"] / 1e9, ceilings["matmul_flops_per_s"] / 1e12
        print(f"copy ceiling {gbps:,.0f} GB/s (read + written), bf16 matmul {tflops:,.0f} TFLOP/s")
    rows = []
    for name, shape in models.items():
        rows += bench_model(name, shape, token_counts, device, gbps, tflops, args.fp8)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the last model's weights
    print(f"{'model':<14} {'T':>5} {'impl':<16} {'ms':>9} {'GB/s':>8} {'TFLOP/s':>8} {'of ceil':>8} {'rel err':>8}")
    for r in rows:
        frac = f"{r['of_ceiling']:8.1%}" if r["of_ceiling"] else f"{'-':>8}"
        err = f"{r['err']:8.1e}" if r["err"] is not None else f"{'-':>8}"
        print(f"{r['model']:<14} {r['tokens']:>5} {r['impl']:<16} {r['ms']:9.3f} {r['GBps']:8,.0f} "
              f"{r['TFLOPs']:8.1f} {frac} {err}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        payload = {"copy_GBps": gbps, "matmul_TFLOPs": tflops, "layer_copies": LAYER_COPIES,
                   "models": {k: asdict(v) for k, v in models.items()}, "rows": rows}
        (Path(args.out) / "moe_layer.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
