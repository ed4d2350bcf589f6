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

    python bench/micro/moe_layer.py [--tokens 1,4,64,8192] [--fp8] [--out DIR]
    python bench/micro/moe_layer.py --tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
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
    """layer's expert weights quantized to 128x128-block FP8 (engine/fp8.py), as fused_moe takes them."""
    from engine.fp8 import quantize

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
        from engine.fp8 import dequantize

        first = fp8_layers[0]
        dense = {**layers[0], "w_gate_up": dequantize(first["w_gate_up"], first["w_gate_up_scale"], dtype),
                 "w_down": dequantize(first["w_down"], first["w_down_scale"], dtype)}  # fmt: skip
        ref8 = fused_moe_reference(x, ids, weights, **dense, **kw)
        fp8_paths = [("fp8" + suffix, extra) for suffix, extra in paths] + [("fp8 w8a8", {"fp8_activations": True})]
        rows += [{**timed(label, fp8_layers, ref8, extra), "of_ceiling": None} for label, extra in fp8_paths]
    if floor_ms:
        rows.append(row("ceiling", floor_ms))
    return rows


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,4,64,8192")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, the reference only")
    p.add_argument("--fp8", action="store_true",
                   help="CUDA: also FP8 expert weights, dequantized per tile and with FP8 activations (w8a8)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(SEED)
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
