"""Compiles the decode step's Triton kernels and the MoE layer's for an H100/H200 (sm_90a) on a machine
without a GPU, and reports each variant's registers and spills (ptxas -v) and where programmatic dependent launch's wait
falls: a check that costs no device time before a device call.

    python bench/checks/offline_compile.py            # needs triton (the project's .venv has it), no GPU

What it cannot tell: speed, and whether the kernels compute the right thing (the Triton interpreter
tests do that: TRITON_INTERPRET=1 pytest tests/pdkernels). The MoE grouped GEMM is compiled with its
launch's integer arguments (unit strides become constants, as at a launch); the other kernels with their
strides unknown, which can differ from what a launch compiles (more registers, no vectorized loads).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BF16 = "*bf16"
Variant = tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]  # name, kernel, types, consts, launch
ALIGNED_INTS = {"N", "K", "n_cols", "M"}  # integer arguments a real launch sees as multiples of 16


def compile_kernel(fn: Any, types: dict[str, str], consts: dict[str, Any], num_warps: int = 4,
                   num_stages: int = 3, pdl: bool = False, ints: dict[str, int] | None = None) -> str:
    """PTX of fn for sm_90a; pointers, strides and ALIGNED_INTS marked 16-byte divisible as a launch
    with aligned tensors would specialize them; other arguments are i32 unless typed. ints: integer
    arguments' values at the launch modelled, specialized as Triton's launch does: 1 a constant, a
    multiple of 16 divisible, others neither. NOTE: a unit stride left unknown changes the code (no
    vectorized or asynchronous loads, more registers): give ints where the launch's strides are known."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ints = ints or {}
    consts = {**consts, **{n: 1 for n, v in ints.items() if v == 1}}
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}

    def is_aligned(n: str) -> bool:
        if n in ints:
            return ints[n] % 16 == 0
        return sig[n].startswith("*") or n.startswith("stride") or n in ALIGNED_INTS

    aligned = [n for n in names if n not in consts and is_aligned(n)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in consts.items()}, attrs)
    opts: dict[str, Any] = {"num_warps": num_warps, "num_stages": num_stages}
    if pdl:
        opts["launch_pdl"] = True
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts).asm["ptx"]


def ptxas_report(ptx: str) -> str:
    import triton

    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(ptx)
    try:
        r = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", fh.name, "-o", os.devnull],
                           capture_output=True, text=True)
    finally:
        os.unlink(fh.name)
    out = r.stderr + r.stdout
    if r.returncode:
        return "ptxas FAILED: " + out[-300:]
    regs = ",".join(re.findall(r"Used (\d+) registers", out))
    spills = ",".join(re.findall(r"(\d+) bytes spill stores", out))
    lines = [ln.strip() for ln in ptx.splitlines()]
    wait = next((i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln), None)
    pdl = "no PDL"
    if wait is not None:
        early = sum(1 for ln in lines[:wait] if re.match(r"(@%p\d+ )?(ld|st)\.global", ln))
        pdl = f"PDL, {early} global loads/stores before the wait"
    return f"{regs} registers, {spills} bytes spilled, {pdl}"


def variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    from pdkernels import bi_matmul, decode_attention, fused_ops, gemv

    split_types = {n: BF16 for n in ("Q", "K_NEW", "V_NEW", "KV", "COS", "SIN", "QW", "KW")}
    split_types |= {"BT": "*i32", "CTX": "*i32", "ACC": "*fp32", "ML": "*fp32", "scale": "fp32", "eps": "fp32"}
    out = []
    for window, rope, norm in [(0, False, False), (0, True, False), (0, True, True), (1024, True, True)]:
        consts = dict(WINDOW=window, UNIT_TOKENS=window or 128, GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128,
                      BLOCK_N=decode_attention.BLOCK_N, MAX_SPLITS=decode_attention.MAX_SPLITS,
                      MIN_SPLIT=decode_attention.MIN_SPLIT_TOKENS, IEEE=False, HAS_NEW=True, PAGE_TILE=True,
                      ROPE=rope, QK_NORM=norm, IS_GEMMA=norm, PDL=True)
        out.append((f"decode split (window {window}, rope {rope}, qk norm {norm})", decode_attention._decode_split_kernel,
                    split_types, consts, dict(num_warps=decode_attention.NUM_WARPS,
                                              num_stages=decode_attention.NUM_STAGES)))
    out.append(("decode fold", decode_attention._decode_reduce_kernel,
                {"ACC": "*fp32", "ML": "*fp32", "CTX": "*i32", "OUT": BF16, "SINKS": "*fp32"},
                dict(WINDOW=0, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=decode_attention.BLOCK_N,
                     MAX_SPLITS=decode_attention.MAX_SPLITS, MIN_SPLIT=decode_attention.MIN_SPLIT_TOKENS,
                     HAS_SINKS=False, PDL=True), dict(num_warps=1)))
    out.append(("qk_rope_ (Gemma norm)", fused_ops._qk_rope_kernel,
                {"X": BF16, "COS": BF16, "SIN": BF16, "QW": BF16, "KW": BF16, "eps": "fp32"},
                dict(HEAD_DIM=128, QK_NORM=True, IS_GEMMA=True, BLOCK_H=16, BLOCK_D=128, PDL=True), {}))
    out.append(("add_rms_norm (sandwich)", fused_ops._rms_norm_kernel,
                {"X": BF16, "H": BF16, "SUM": BF16, "W": BF16, "W0": BF16, "OUT": BF16, "Q": BF16, "QS": BF16,
                 "eps": "fp32", "fp8_max": "fp32"},
                dict(IS_GEMMA=True, HAS_ADD=True, NORM_H=True, BLOCK=4096, QUANT=0, PDL=True), {}))
    out.append(("add_rms_norm + FP8 quantization", fused_ops._rms_norm_kernel,
                {"X": BF16, "H": BF16, "SUM": BF16, "W": BF16, "W0": BF16, "OUT": BF16, "Q": "*fp8e4nv",
                 "QS": "*fp32", "eps": "fp32", "fp8_max": "fp32"},
                dict(IS_GEMMA=False, HAS_ADD=True, NORM_H=False, BLOCK=4096, QUANT=128, PDL=True), {}))
    out.append(("silu_mul", fused_ops._silu_mul_kernel, {"GU": BF16, "OUT": BF16},
                dict(BLOCK=1024, GELU_TANH=False, PDL=True), {}))
    cfg = bi_matmul.matmul_config(4096, 4096)
    out.append(("bi_matmul 4096x4096", bi_matmul._bi_matmul_kernel, {"A": BF16, "B": BF16, "C": "*fp32", "BIAS": BF16},
                dict(HAS_BIAS=False, EVEN_K=True, IEEE=False, SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m,
                     BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PDL=True),
                dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
    out.append(("bi_matmul 4096x4096, 8 warps", bi_matmul._bi_matmul_kernel,
                {"A": BF16, "B": BF16, "C": "*fp32", "BIAS": BF16},
                dict(HAS_BIAS=False, EVEN_K=True, IEEE=False, SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m,
                     BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PDL=True),
                dict(num_warps=8, num_stages=cfg.num_stages)))
    from pdkernels import checksum, copy_hash

    for paged in (False, True):  # the ipc receiver's copy, the PE's export gather
        out.append((f"copy_hash ({'paged' if paged else 'flat'}, keyed)", copy_hash._kernel(),
                    {n: "*i64" for n in ("src_ptr", "ids_ptr", "dst_ptr", "keys_ptr", "ckeys_ptr", "out_ptr")},
                    dict(CHUNK=checksum.CHUNK_WORDS, BLOCK=copy_hash.MAX_BLOCK_WORDS, MUL=checksum.signed64(checksum.MUL),
                         PAGED=paged, PAGE_STEPS=paged, WRITE=True),
                    dict(num_warps=copy_hash.NUM_WARPS)))
    for m, act, k in [(1, 0, 4096), (1, 1, 14336), (4, 0, 4096), (8, 0, 4096)]:
        g = gemv.gemv_config(4096, k, m)
        out.append((f"gemv M={m} act={act} K={k} ({g.block_n}x{g.block_k}, {g.num_warps} warps)", gemv._gemv_kernel,
                    {"X": BF16, "W": BF16, "BIAS": BF16, "OUT": BF16, "SCALE": "*fp32"},
                    dict(M=m, ACT=act, HAS_BIAS=False, HAS_SCALE=False, EVEN_K=True, BLOCK_N=g.block_n,
                         BLOCK_K=g.block_k, VEC=8, PDL=True, PREFETCH=0, LINE=gemv.LINE_BYTES, SCALE_BLOCK=128),
                    dict(num_warps=g.num_warps, num_stages=1)))
    out += moe_variants()
    return out


def grouped_gemm_variant(label: str, rows: int, is_glu: bool, n: int, k: int, cfg: Any, w8: bool, fp8_x: bool,
                         num_experts: int = 128) -> Variant:
    """moe_gemm's grouped GEMM over `rows` (token, slot) rows as fused_moe launches it: gate/up (is_glu) a
    SwiGLU of rows gathered from top-8 tokens, down scattering its rows; contiguous x [., k], w [E, n or 2n,
    k] (FP8 with 128x128 block scales if w8; fp8_x: x too, in K steps of 128), out [., n], no bias; cfg a
    moe_gemm.GemmConfig."""
    import triton

    from pdkernels import moe_gemm

    fp8 = "*fp8e4nv"
    n_w, scale_k = 2 * n if is_glu else n, -(-k // moe_gemm.SCALE_BLOCK)
    block_k = moe_gemm.SCALE_BLOCK if fp8_x else cfg.block_k
    types = {"X": fp8 if fp8_x else BF16, "ROWS": "*i64", "W": fp8 if w8 else BF16, "BIAS": BF16, "OUT": BF16,
             "OFFS": "*i32", "W_SCALE": "*fp32" if w8 else BF16, "X_SCALE": "*fp32" if fp8_x else BF16,
             "alpha": "fp32", "limit": "fp32"}
    # _launch_grouped's integer arguments: its strides (0 for an absent bias or scales), N, the expert count
    ints = dict(num_experts=num_experts, N=n, stride_xm=k, stride_xk=1, stride_we=n_w * k, stride_wn=k, stride_wk=1,
                stride_be=0, stride_bn=0, stride_om=n, stride_on=1,
                stride_se=-(-n_w // moe_gemm.SCALE_BLOCK) * scale_k if w8 else 0, stride_sn=scale_k if w8 else 0,
                stride_sk=int(w8), stride_xsm=scale_k if fp8_x else 0, stride_xsk=int(fp8_x))
    consts = dict(K=k, ACT=int(is_glu), HAS_ROWS=True, GATHER_DIV=8 if is_glu else 0, HAS_BIAS=False, HAS_SCALE=w8,
                  FP8_X=fp8_x, EVEN_K=k % block_k == 0, IEEE=False,
                  E_POW2=max(2, triton.next_power_of_2(num_experts)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=block_k, GROUP_M=cfg.group_m, SCALE_BLOCK=moe_gemm.SCALE_BLOCK, PDL=True)
    name = (f"moe grouped GEMM {label}, {rows} rows, {'gate/up' if is_glu else 'down'} "
            f"({cfg.block_m}x{cfg.block_n}x{block_k} w{cfg.num_warps} s{cfg.num_stages})")
    return (name, moe_gemm._grouped_gemm_kernel, types, consts,
            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, ints=ints))


def moe_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]]:
    """The MoE layer's kernels at Qwen3-30B-A3B's shapes (H 2048, I 768, 128 experts, top 8): the routing,
    the assignments' sort, the grouped GEMM in its decode and prefill tiles, bf16, FP8 weights and w8a8, and
    the few-token GEMVs."""
    from pdkernels import moe_gemm, moe_gemv, moe_route

    out: list[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, Any]]] = []
    for softmax_first in (True, False):
        out.append((f"moe route (softmax first {softmax_first})", moe_route._route_kernel,
                    {"logits_ptr": BF16, "weights_ptr": BF16, "ids_ptr": "*i64", "counts_ptr": "*i64"},
                    dict(TOP_K=8, BLOCK_K=8, BLOCK_E=128, SOFTMAX_FIRST=softmax_first, NORM=True, COUNT=True,
                         PDL=True),
                    dict(num_warps=1)))
    out.append(("moe align (256 assignments)", moe_route._align_kernel,
                {"ids_ptr": "*i64", "order_ptr": "*i64", "offsets_ptr": "*i32"},
                dict(BLOCK_N=256, BLOCK_E=256, CHUNK=moe_route._ALIGN_CHUNK, PDL=True), dict(num_warps=4)))
    fp8 = "*fp8e4nv"
    # rows: a decode step's 1 or 64 tokens, an 8k prefill's, times top-8 (fused_moe's w8a8 has no GEMV path)
    for label, rows, w8, fp8_x in [("bf16", 8, False, False), ("bf16", 8192 * 8, False, False),
                                   ("FP8 weights", 8, True, False), ("FP8 weights", 8192 * 8, True, False),
                                   ("w8a8", 64 * 8, True, True), ("w8a8", 8192 * 8, True, True)]:
        for is_glu, n, k in [(True, 768, 2048), (False, 2048, 768)]:
            cfg = moe_gemm.gemm_config(rows, 128, n, k, is_glu, False)
            out.append(grouped_gemm_variant(label, rows, is_glu, n, k, cfg, w8, fp8_x))
    for label, w_type, elem in [("bf16", BF16, 2), ("FP8 weights", fp8, 1)]:  # a decode step's token: 8 GEMVs
        for act, n, k in [(1, 768, 2048), (0, 2048, 768)]:
            g = moe_gemv.moe_gemv_config(n, k, 8, act != 0, elem)
            out.append((f"moe GEMV {label}, {'gate/up' if act else 'down'} ({g.block_n}x{g.block_k})",
                        moe_gemv._moe_gemv_kernel,
                        {"X": BF16, "IDS": "*i64", "W": w_type, "BIAS": BF16, "OUT": BF16,
                         "SCALE": "*fp32" if w_type == fp8 else BF16, "alpha": "fp32", "limit": "fp32"},
                        dict(K=k, X_DIV=8 if act else 1, ACT=act, HAS_BIAS=False, HAS_SCALE=w_type == fp8,
                             EVEN_K=k % g.block_k == 0, BLOCK_N=g.block_n, BLOCK_K=g.block_k, VEC=16 // elem,
                             SCALE_BLOCK=128, PDL=True),
                        dict(num_warps=g.num_warps)))
    return out


def main() -> int:
    try:
        import triton  # noqa: F401
    except ImportError:
        print("offline_compile: needs triton")
        return 0
    failed = 0
    for name, fn, types, consts, launch in variants():
        try:
            report = ptxas_report(compile_kernel(fn, types, consts, pdl=consts.get("PDL", False), **launch))
        except Exception as e:  # a kernel that does not compile is the finding
            report, failed = f"FAILED {type(e).__name__}: {str(e)[:400]}", failed + 1
        print(f"{name:<70} {report}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
