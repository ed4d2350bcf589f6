"""Matrix-vector product for decode (Triton): y = act_in(x) @ weight.T (+ bias) for M <= 8 rows of x.

At batch 1 to 8 a linear layer is a trip of its weight through HBM, so the kernel reads each weight
element exactly once per call: program p owns BLOCK_N output columns (weight rows) for all M rows of x
and walks K in BLOCK_K steps; each step's weight tile is loaded once and used by every row. No split-K:
one launch, no reduction kernel after it. Meant to replace cuBLAS for an 8B model's small projections at
batch 1 on an H200 (bench/micro/gemv.py times both against the device-copy ceiling).

Elementwise FMAs, not tl.dot. At small M the arithmetic (M*N*K FMAs for N*K weight elements) hides under
the memory time and the weight tile goes from a 16-byte load straight into FMAs, while tl.dot would pad x
to 16 rows and stage every weight tile through shared memory for the tensor cores, which pays only when
a tile serves more rows than a decode step has. The FMA form measured faster than cuBLAS at M = 1 on an
H200 (the first version of bench/micro/gemv.py, 4096x4096 and 6144x4096 weights). Its cost grows with M:
by M = 8 the FMAs and conversions take about as many issue slots as the weights take to arrive, the end
of the range where this form is expected to keep up (the benchmark shows where cuBLAS overtakes it).

Layout. A step's weight tile is indexed [BLOCK_K // VEC, BLOCK_N, VEC], VEC elements being 16 bytes:
Triton gives each thread one 16-byte run of K, the same run in each of the tile's weight rows, so the
matching piece of x is one 16-byte load per row in the same layout (no exchange through shared memory),
and each thread sums its VEC products in registers before adding them to a [BLOCK_K // VEC, BLOCK_N]
float32 accumulator per row of x: the registers grow with M * BLOCK_N, not M * BLOCK_N * BLOCK_K. The
sum across threads runs once, after the K loop. Hence BLOCK_K = VEC * 32 * num_warps in `gemv_config`
(one run per thread and weight row): with a smaller K step the warps split N and every x tile goes
through shared memory inside the loop (both read off the sm_90 TTGIR and PTX of Triton 3.6). Triton 3.6
does not software-pipeline loads that feed no tl.dot, so num_stages changes nothing here: the bytes in
flight are each thread's BLOCK_N 16-byte loads of a step, times the programs resident on a multiprocessor.

act ("silu", "gelu_tanh"): x is [M, 2K] = [gate | up] and the product's input is act(gate) * up,
computed per K tile with fused_ops._silu_mul_kernel's float32 math and its roundings to the dtype (the
activation, then the product), so the result is bit-identical to gemv(fused_ops.silu_mul(x, act), w).
Each program computes act(gate) * up over all of K again: cheap next to the weights at M = 1, not free
at M = 8 (the benchmark times it against silu_mul + cuBLAS).

Programmatic dependent launch (pdl=True, Hopper and later): the kernel lets the next kernel in the stream
start early (if that one is launched with PDL too) and waits for the previous one (gdc_wait) before it
reads x or the bias and before any store. The weights are constants, so with prefetch=P each program
first asks the L2 for the lines of its first P weight tiles, overlapping the previous kernel's tail.
Not batch-invariant (M is compiled in): deterministic mode keeps bi_matmul.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

MAX_ROWS = 8
ACTIVATIONS = {None: 0, "silu": 1, "gelu_tanh": 2}
TARGET_PROGRAMS = 132  # at least one program per multiprocessor of an H200
LINE_BYTES = 128  # one L2 prefetch per cache line
SCALE_BLOCK = 128  # an FP8 weight's scale block (engine/layers/fp8.py BLOCK)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns (weight rows) per program, a power of two
    block_k: int  # K step, a power of two; a multiple of 16 bytes * 32 * num_warps keeps x out of shared memory
    num_warps: int
    num_stages: int = 1  # no effect on this kernel's loop in Triton 3.6 (see the module docstring)


@cache
def gemv_config(n: int, k: int, m: int, elem_bytes: int = 2) -> GemvConfig:
    """The launch configuration for an [N, K] weight of elem_bytes-wide elements and M rows of x.

    BLOCK_K is one 16-byte run per thread and weight row (4 warps, fewer for a short K). BLOCK_N is 16
    up to M = 4, 8 above (ptxas for sm_90, bf16, BLOCK_K 1024: 126/168/255 registers at M = 1/2/4 with
    16, 205 at M = 8 with 8, where 16 spills), halved while the grid would leave multiprocessors idle. An
    FP8 weight (elem_bytes 1) takes half of that BLOCK_N: its 16-byte run is 16 elements, twice the float32
    products per thread and weight row."""
    vec = 16 // elem_bytes
    num_warps = min(4, triton.next_power_of_2(triton.cdiv(k, vec * 32)))
    block_n = (16 if m <= 4 else 8) * elem_bytes // 2 or 1
    while block_n > 1 and triton.cdiv(n, block_n) < TARGET_PROGRAMS:
        block_n //= 2
    return GemvConfig(block_n, vec * 32 * num_warps, num_warps)


@triton.jit
def _load_k(p, k_ok, EVEN_K: tl.constexpr):
    if EVEN_K:
        v = tl.load(p)
    else:
        v = tl.load(p, mask=k_ok, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _x_tile(p, K, k_ok, EVEN_K: tl.constexpr, ACT: tl.constexpr, DTYPE: tl.constexpr):
    """One row's K tile of the product's input in float32; with ACT, act(gate) * up from p (gate) and
    p + K (up), with fused_ops._silu_mul_kernel's arithmetic and roundings."""
    x = _load_k(p, k_ok, EVEN_K)
    if ACT != 0:
        g = x
        u = _load_k(p + K, k_ok, EVEN_K)
        if ACT == 2:  # F.gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * z))
            a = (0.5 * g * (1.0 + t)).to(DTYPE).to(tl.float32)  # the activation in the dtype, then the product
        else:
            a = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)  # F.silu in the dtype, then the product
        x = (a * u).to(DTYPE).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(
    X, W, BIAS, OUT, SCALE, N, K, stride_x, stride_w, stride_o, stride_s,
    M: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    LINE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # columns past N read weight row N - 1 again (unmasked loads along N) and are never stored
    w_rows = W + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_w
    # the K step as [chunks, VEC]: a thread's VEC consecutive elements (16 bytes) sit on the last axis
    kk = tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    w_ptrs = kk[:, None, :] + w_rows[None, :, None]
    if PREFETCH > 0:  # the lines of the first PREFETCH weight tiles into L2, before waiting on x
        lines = tl.arange(0, (BLOCK_K + LINE - 1) // LINE) * LINE
        for s in tl.static_range(PREFETCH):
            p = w_rows[:, None] + tl.minimum(s * BLOCK_K + lines, K - 1)[None, :]
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    dt = OUT.dtype.element_ty
    accs: tl.tuple = ()  # one accumulator per row of x
    for _ in tl.static_range(M):
        accs = accs + (tl.zeros((BLOCK_K // VEC, BLOCK_N), dtype=tl.float32),)
    if HAS_SCALE:  # a weight row's block row of scales; a thread's VEC run lies in one 128-column block
        s_rows = SCALE + (tl.minimum(offs_n, N - 1) // SCALE_BLOCK) * stride_s
        chunks = tl.arange(0, BLOCK_K // VEC) * VEC
        s_cols = chunks // SCALE_BLOCK
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + kk < K
        w = _load_k(w_ptrs + k0, k_ok[:, None, :], EVEN_K)
        if HAS_SCALE:
            sc = tl.load(s_rows[None, :] + (k0 // SCALE_BLOCK + s_cols)[:, None],
                         mask=(k0 + chunks < K)[:, None], other=0.0)  # fmt: skip
        new_accs: tl.tuple = ()
        for m in tl.static_range(M):
            x = _x_tile(X + m * stride_x + k0 + kk, K, k_ok, EVEN_K, ACT, dt)
            # each thread first sums its own VEC products, then adds them to its accumulator
            part = tl.sum(w * x[:, None, :], axis=2)
            if HAS_SCALE:
                part = part * sc
            new_accs = new_accs + (accs[m] + part,)
        accs = new_accs
    n_ok = offs_n < N
    if HAS_BIAS:
        b = tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    for m in tl.static_range(M):
        y = tl.sum(accs[m], axis=0)
        if HAS_BIAS:
            y += b
        tl.store(OUT + m * stride_o + offs_n, y.to(dt), mask=n_ok)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None,
    out: torch.Tensor | None = None, pdl: bool = False, prefetch: int = 0, config: GemvConfig | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = act_in(x) @ weight.T (+ bias). x: [M, K] (act None) or [M, 2K] = [gate | up] (act "silu" or
    "gelu_tanh": the product's input is act(gate) * up, computed inside the kernel exactly as
    fused_ops.silu_mul computes it, i.e. the activation rounded to the dtype, then the product rounded to the
    dtype); weight: [N, K] contiguous (nn.Linear layout); bias [N] or None. M <= MAX_ROWS (8). Returns [M, N] in
    x's dtype.

    x's rows may be strided (its last axis contiguous). out: an [M, N] tensor of x's dtype, last axis
    contiguous, to write into. pdl: programmatic dependent launch (sm_90+ only; off on older GPUs and under
    TRITON_INTERPRET=1). prefetch: weight tiles per program prefetched into L2 before the kernel waits on the
    previous one (0: none; GPU only, like pdl). config: overrides gemv_config (benchmarks).

    scale: a float8_e4m3fn weight's block scales [ceil(N/128), ceil(K/128)] float32 (engine/layers/fp8.py's
    `weight_scale_inv`): weight[n, k] stands for weight[n, k] * scale[n // 128, k // 128]. Each thread's
    16-element run of K lies in one block, so its partial sum is scaled once, in float32, before it is added
    to the accumulator; x stays in its dtype (weights-only FP8: a decode row reads 1 byte per weight)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"gemv: unknown activation {act!r} (known: {list(ACTIVATIONS)})")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, width = x.shape
    n, k = weight.shape
    if m > MAX_ROWS:
        raise ValueError(f"gemv handles at most {MAX_ROWS} rows of x, got {m}")
    if width != (2 * k if act else k):
        need = f"[M, 2 * {k}] = [gate | up]" if act else f"[M, {k}]"
        raise ValueError(f"gemv: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}: act={act} needs {need}")
    if scale is not None:
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"gemv: scale is for a float8_e4m3fn weight, got {weight.dtype}")
        if scale.shape != (triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK)) or scale.stride(-1) != 1:
            raise ValueError(f"gemv: scale {tuple(scale.shape)} is not [{triton.cdiv(n, SCALE_BLOCK)}, "
                             f"{triton.cdiv(k, SCALE_BLOCK)}] float32 with unit column stride")  # fmt: skip
        if config is not None and config.block_k % SCALE_BLOCK:
            raise ValueError(f"gemv: an FP8 weight needs block_k a multiple of {SCALE_BLOCK}, got {config}")
    elif weight.dtype != x.dtype:
        raise ValueError(f"gemv: x and weight must share a dtype (or weight is FP8 with its scale), got "
                         f"{x.dtype}, {weight.dtype}")
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"gemv: bias must be in x's dtype, got {x.dtype} and {bias.dtype}")
    if x.stride(-1) != 1 and x.numel() > 1:
        raise ValueError(f"gemv needs x's last axis contiguous, got strides {x.stride()}")
    if not weight.is_contiguous():
        raise ValueError("gemv needs a contiguous [N, K] weight")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} is not [{n}]")
    if prefetch < 0:
        raise ValueError(f"gemv: prefetch must be >= 0, got {prefetch}")
    if config is not None and not (_is_pow2(config.block_n) and _is_pow2(config.block_k)):
        raise ValueError(f"gemv: block_n and block_k must be powers of two, got {config}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or (out.stride(-1) != 1 and out.numel() > 1):
        raise ValueError(f"gemv: out must be [{m}, {n}] {x.dtype} with its last axis contiguous, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    cfg = config or gemv_config(n, k, m, weight.element_size())
    vec = min(16 // weight.element_size(), cfg.block_k)
    # griddepcontrol is sm_90+, and inline PTX does not run in the interpreter
    gpu = not _interpreting() and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9
    pdl = pdl and gpu
    prefetch = min(prefetch, triton.cdiv(k, cfg.block_k)) if gpu else 0
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, out, scale if scale is not None else weight, n, k,
        x.stride(0), weight.stride(0), out.stride(0), scale.stride(0) if scale is not None else 0,
        M=m, ACT=ACTIVATIONS[act], HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=vec, PDL=pdl, PREFETCH=prefetch,
        LINE=LINE_BYTES // weight.element_size(), SCALE_BLOCK=SCALE_BLOCK, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
