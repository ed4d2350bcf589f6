"""Row-local fused kernels (Triton) for the model's small ops on CUDA: RMSNorm (alone, after a residual
add, or after a sandwich norm's output norm and its add), rotary (alone, or after the per-head q/k
norms of Qwen 3 and Gemma 3: `qk_rope_`, whose arithmetic `rope_rows` also lends the decode attention
kernel), SiLU- or GELU(tanh)-and-mul. Each may launch with programmatic dependent launch (`pdl_start`,
pdkernels/pdl.py).

In eager torch each of these is several elementwise kernels (RMSNorm: cast, square, mean, rsqrt,
two multiplies, casts; rotary: split, negate, concatenate, multiply, add, for q and k). In a decode step
of an 8B model those launches cost about as much as reading the weights, so each becomes one kernel.

Each kernel casts to the activation dtype at the points where the torch code rounds, so it differs
from the torch path by a rounding at most: where float32 reductions sum in another order (the norm's
mean of squares) or where the compiler keeps a product unrounded inside a sum (rotary, measured on the
H200: not bit-identical to torch's three rounded ops). Every kernel is one program per row: a row's result never depends on the
other rows, which keeps deterministic mode's batch invariance.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pdkernels import pdl

# The FP8 quantization of activations (pdkernels/fp8_gemm.py, and a norm's quantized output here)
FP8_GROUP = 128  # the quantization block of weights and activations
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_EPS = 1e-10  # the smallest group maximum a scale is computed from (an all-zero group gets a tiny scale)


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A PDL-launched kernel's first step (pdkernels/pdl.py): wait for the kernels before it, then let
    the next one launch. A no-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _scaled(x, w, r, IS_GEMMA: tl.constexpr, DTYPE: tl.constexpr):
    """engine.layers.norm.RMSNorm's arithmetic on float32 values x of rows whose 1 / rms is r (broadcast),
    elementwise, rounded to DTYPE."""
    if IS_GEMMA:  # (x * (1 + w)) in float32, then cast
        y = x * r * (1.0 + w)
    else:  # weight * (normed cast to the dtype), the product rounded to the dtype
        y = (x * r).to(DTYPE).to(tl.float32) * w
    return y.to(DTYPE)


@triton.jit
def _normed(x, w, n_cols, eps, IS_GEMMA: tl.constexpr, DTYPE: tl.constexpr):
    """RMSNorm of one float32 row (engine.model.RMSNorm's arithmetic), rounded to DTYPE."""
    return _scaled(x, w, 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / n_cols + eps), IS_GEMMA, DTYPE)


@triton.jit
def _rms_norm_kernel(X, H, SUM, W, W0, OUT, Q, QS, stride_x, stride_h, stride_s, stride_o, stride_q, stride_qm,
                     stride_qg, n_cols, eps, fp8_max, IS_GEMMA: tl.constexpr, HAS_ADD: tl.constexpr,
                     NORM_H: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:  # x + h (or x + norm0(h), rounded to the dtype first) rounded to the dtype, then normed
        h = tl.load(H + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
        if NORM_H:  # a sandwich norm's output norm, applied to h before the add
            w0 = tl.load(W0 + offs, mask=mask, other=0.0).to(tl.float32)
            h = _normed(h, w0, n_cols, eps, IS_GEMMA, SUM.dtype.element_ty).to(tl.float32)
        x = (x + h).to(SUM.dtype.element_ty)
        tl.store(SUM + row * stride_s + offs, x, mask=mask)
        x = x.to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    y = _normed(x, w, n_cols, eps, IS_GEMMA, OUT.dtype.element_ty)
    tl.store(OUT + row * stride_o + offs, y, mask=mask)
    if QUANT:  # also y quantized per group of QUANT columns (pdkernels/fp8_gemm.py per_token_group_quant's)
        groups = tl.reshape(y.to(tl.float32), (BLOCK // QUANT, QUANT))
        gi = tl.arange(0, BLOCK // QUANT)
        scale = tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-10) / fp8_max  # 1e-10: FP8_EPS
        q = tl.reshape(tl.clamp(groups / scale[:, None], -fp8_max, fp8_max), (BLOCK,))
        tl.store(Q + row * stride_q + offs, q.to(Q.dtype.element_ty), mask=mask)
        tl.store(QS + row * stride_qm + gi * stride_qg, scale, mask=gi * QUANT < n_cols)


def quant_buffers(rows: int, k: int, rows_to: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where an FP8 quantization of [rows, k] values per group of 128 columns goes (pdkernels/fp8_gemm.py
    per_token_group_quant's layout, also a norm's quantized output): values [rows', k], rows rounded up to
    rows_to (float32 under TRITON_INTERPRET: per_token_group_quant's NOTE), and scales [rows', ceil(k/128)],
    stored column-major when rows_to > 1 (cuBLAS's 1x128 scales)."""
    padded = -(-rows // rows_to) * rows_to
    is_interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    q = torch.empty(padded, k, dtype=torch.float32 if is_interpreted else torch.float8_e4m3fn, device=device)
    groups = -(-k // FP8_GROUP)
    if rows_to > 1:
        return q, torch.empty(groups, padded, dtype=torch.float32, device=device).t()
    return q, torch.empty(padded, groups, dtype=torch.float32, device=device)


def _norm_launch(x: torch.Tensor, h: torch.Tensor | None, total: torch.Tensor | None, weight: torch.Tensor,
                 h_weight: torch.Tensor | None, out: torch.Tensor, eps: float, is_gemma: bool,
                 quant_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """_rms_norm_kernel over x's rows (x + h first where h is given: the sum into total); with quant_rows,
    out quantized too: returns (values as float8_e4m3fn, scales)."""
    rows, n = x.shape
    quant = quant_rows > 0 and n % FP8_GROUP == 0
    q, qs = quant_buffers(rows, n, quant_rows, x.device) if quant else (out, out)
    if rows:
        hh = h if h is not None else x
        _rms_norm_kernel[(rows,)](
            x, hh, total if total is not None else x, weight, weight if h_weight is None else h_weight, out, q, qs,
            x.stride(0), hh.stride(0), 0 if total is None else total.stride(0), out.stride(0), q.stride(0),
            qs.stride(0), qs.stride(1), n, eps, FP8_MAX, IS_GEMMA=is_gemma, HAS_ADD=h is not None,
            NORM_H=h_weight is not None, BLOCK=triton.next_power_of_2(n), QUANT=FP8_GROUP if quant else 0,
            PDL=pdl.active(), num_warps=4 if n <= 4096 else 8, launch_pdl=pdl.active(),
        )
    return (q.to(torch.float8_e4m3fn), qs) if quant else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, is_gemma: bool) -> torch.Tensor:
    """RMSNorm over the last axis (engine.model.RMSNorm's arithmetic). x: [..., n]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _norm_launch(x2, None, None, weight, None, out, eps, is_gemma, 0)
    return out.view(shape)


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, is_gemma: bool, quant_rows: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(rms_norm(x), its FP8 quantization) for x [rows, n] in one pass: the values and scales
    pdkernels/fp8_gemm.py per_token_group_quant(rms_norm(x), rows_to=quant_rows) gives; None for them
    when n is not whole groups of 128."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm_quant needs a [rows, n] tensor with contiguous rows, got {tuple(x.shape)}")
    out = torch.empty_like(x)
    return out, _norm_launch(x, None, None, weight, None, out, eps, is_gemma, quant_rows)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, is_gemma: bool,
                 h_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)) in one pass. x, h: [rows, n], contiguous rows. With h_weight (a
    sandwich norm's output norm, same eps): (s, rms_norm(s)) for s = x + rms_norm(h, h_weight), each
    rounded to the dtype where the layer-by-layer code rounds (one pass for Gemma norms in bf16/fp16)."""
    total, out, _ = add_rms_norm_quant(x, h, weight, eps, is_gemma, h_weight)
    return total, out


def add_rms_norm_quant(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, is_gemma: bool,
    h_weight: torch.Tensor | None = None, quant_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """add_rms_norm, and with quant_rows > 0 the norm's output quantized in the same pass, as
    rms_norm_quant gives it (None where it cannot)."""
    if x.dim() != 2 or x.shape != h.shape or x.stride(-1) != 1 or h.stride(-1) != 1:
        raise ValueError(f"add_rms_norm needs two [rows, n] tensors, got {tuple(x.shape)} and {tuple(h.shape)}")
    if h_weight is not None and not (is_gemma and x.dtype in (torch.bfloat16, torch.float16)):
        # NOTE: in one kernel the output norm's rounding before the add is kept only for the Gemma norm
        # in a 16-bit dtype (measured on the H200: with the plain norm, or in float32, the compiler
        # contracts norm and add into one FMA, 1 ulp off the layer-by-layer result): two kernels here
        h, h_weight = rms_norm(h, h_weight, eps, is_gemma), None
    total = torch.empty_like(x)
    out = torch.empty_like(x)
    quantized = _norm_launch(x, h, total, weight, h_weight, out, eps, is_gemma, quant_rows)
    return total, out, quantized


@triton.jit
def _bf16_rounded(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), kept in float32, by integer arithmetic:
    a float conversion there lets the compiler fuse the multiply before it into the add after it (one
    rounding fewer than torch's, seen on the H200 for rotary without a norm)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rotated(x, xp, c, s, HALF: tl.constexpr, offs_d, DTYPE: tl.constexpr):
    """x * cos + rotate_half(x) * sin for elements x at head offsets offs_d, whose rotary partners (offset
    d + HALF for d < HALF, d - HALF after) are xp; every product and the sum rounded to DTYPE, as torch
    does (bfloat16: rounded by _bf16_rounded, so no kernel fuses a product into the sum and every kernel
    that rotates agrees with torch bit for bit; other dtypes: within a rounding of torch)."""
    xs = tl.where(offs_d < HALF, -xp, xp)
    if DTYPE == tl.bfloat16:
        return _bf16_rounded(_bf16_rounded(x * c) + _bf16_rounded(xs * s)).to(DTYPE)
    return ((x * c).to(DTYPE).to(tl.float32) + (xs * s).to(DTYPE).to(tl.float32)).to(DTYPE)


@triton.jit
def rope_rows(P, offs_d, mask, COS, SIN, NW, eps, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr,
              IS_GEMMA: tl.constexpr, DTYPE: tl.constexpr):
    """Rows of head vectors with their per-head norm (QK_NORM: Qwen 3, Gemma 3; weight NW) and rotary
    applied, as the model's qkv() does them one kernel at a time. P: pointers to element offs_d of each
    row, [rows, BLOCK_D]; offs_d: [1, BLOCK_D]; COS, SIN: pointers to the row's position's tables
    ([HEAD_DIM] each). Returns DTYPE values of P's shape (masked lanes 0)."""
    half: tl.constexpr = HEAD_DIM // 2
    partner = tl.where(offs_d < half, half, -half)
    x = tl.load(P, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(P + partner, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        r = (1.0 / tl.sqrt_rn(tl.sum(x * x, 1) / HEAD_DIM + eps))[:, None]
        # a row's own elements and their rotary partners are normed alike
        w = tl.load(NW + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
        wp = tl.load(NW + offs_d + partner, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
        x = _scaled(x, w, r, IS_GEMMA, DTYPE).to(tl.float32)
        xp = _scaled(xp, wp, r, IS_GEMMA, DTYPE).to(tl.float32)
    c = tl.load(COS + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
    s = tl.load(SIN + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
    return _rotated(x, xp, c, s, half, offs_d, DTYPE)


@triton.jit
def _qk_rope_kernel(X, COS, SIN, QW, KW, stride_xt, stride_xh, stride_c, num_q, num_k, eps,
                    HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr, IS_GEMMA: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    dt = X.dtype.element_ty
    cos, sin = COS + t * stride_c, SIN + t * stride_c
    for h0 in range(0, num_q + num_k, BLOCK_H):
        heads = h0 + offs_h
        # NOTE: a block of heads is all q or all k (BLOCK_H divides num_q), so one norm weight serves it
        nw = QW
        if h0 >= num_q:
            nw = KW
        mask = (heads[:, None] < num_q + num_k) & mask_d[None, :]
        p = X + t * stride_xt + heads[:, None] * stride_xh + offs_d[None, :]
        y = rope_rows(p, offs_d[None, :], mask, cos, sin, nw, eps, HEAD_DIM, QK_NORM, IS_GEMMA, dt)
        tl.debug_barrier()  # every partner is read before any element of the block is overwritten
        tl.store(p, y, mask=mask)


def qk_rope_(qk: torch.Tensor, num_q: int, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None = None,
             k_weight: torch.Tensor | None = None, eps: float = 0.0, is_gemma: bool = False) -> None:
    """In place, one launch: the q heads (the first num_q of qk's [tokens, heads, dim]) and the k heads
    after them get their per-head RMSNorm (with q_weight / k_weight; None: no norm, rotary alone) and
    then rotary: the arithmetic of rms_norm, then x * cos + rotate_half(x) * sin with torch's roundings
    (one rounding apart at most, where the compiler keeps a product unrounded). A strided view of the
    packed projection is fine."""
    tokens, heads, dim = qk.shape
    if qk.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        raise ValueError("qk_rope_ needs the head_dim axis contiguous and cos/sin laid out alike")
    if dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {dim}")
    has_norm = q_weight is not None and k_weight is not None
    block_h = min(16, triton.next_power_of_2(num_q))
    while num_q % block_h:
        block_h //= 2
    if tokens:
        _qk_rope_kernel[(tokens,)](
            qk, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos,
            qk.stride(0), qk.stride(1), cos.stride(0), num_q, heads - num_q, eps,
            HEAD_DIM=dim, QK_NORM=has_norm, IS_GEMMA=is_gemma, BLOCK_H=block_h,
            BLOCK_D=triton.next_power_of_2(dim), PDL=pdl.active(), num_warps=4, launch_pdl=pdl.active(),
        )


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_g, stride_o, n_cols, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(GU + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(GU + row * stride_g + n_cols + offs, mask=mask, other=0.0)
    tl.store(OUT + row * stride_o + offs, act_mul(g, u, OUT.dtype.element_ty, GELU_TANH), mask=mask)


@triton.jit
def act_mul(g, u, dt, GELU_TANH: tl.constexpr):
    """act(g) * u in dt (silu, or GELU tanh), rounded where torch rounds; also the FP8 activations'
    quantization of the down projection's input (pdkernels/fp8_gemm.py), so both give the same values."""
    g = g.to(tl.float32)
    if GELU_TANH:  # F.gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * z))
        a = (0.5 * g * (1.0 + t)).to(dt).to(tl.float32)  # the activation in the dtype, then the product
    else:
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu in the dtype, then the product
    return (a * u.to(tl.float32)).to(dt)


ACTIVATIONS = ("silu", "gelu_tanh")  # what act_mul computes


def silu_mul(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up for gate_up = [gate | up] along the last axis: [tokens, 2n] -> [tokens, n].
    act: "silu" or "gelu_tanh" (within a rounding of torch's F.gelu(approximate="tanh"))."""
    if act not in ACTIVATIONS:
        raise ValueError(f"no fused kernel for activation {act!r}")
    tokens, width = gate_up.shape
    n = width // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, GELU_TANH=act == "gelu_tanh",
            PDL=pdl.active(), num_warps=4, launch_pdl=pdl.active(),
        )
    return out
