"""The default-mode SDPA prefill path (engine/layers/attention.py `_sdpa_chunk`) on CUDA, through
`chunked_attention` over a real, NaN-poisoned KVCache: against the Triton kernel path (prefill_sdpa
"off") and a float32 torch reference, at bf16. Each run passes its ForwardConfig (the setting and the
thresholds) into the forward context, as the engine's runner does. Which chunks took which path is recorded, so a case
that silently fell back to the kernel fails. Skipped without CUDA and Triton."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch

from tests.gpu_support import require_triton

require_triton()
if not torch.cuda.is_available():  # under TRITON_INTERPRET: the SDPA path needs CUDA (flash, bf16)
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import pdkernels.prefill_attention as prefill_kernel  # noqa: E402
from engine.config import ForwardConfig  # noqa: E402
from engine.core.kv_cache import KVCache  # noqa: E402
from engine.handoff import KVLayout  # noqa: E402
from engine.layers import attention  # noqa: E402
from engine.layers.attention import AttnSpec, chunked_attention  # noqa: E402
from engine.layers.context import SeqChunk, forward_context  # noqa: E402
from engine.layers.numerics import Numerics  # noqa: E402
from tests.engine_utils import prompt_logits, small_engine  # noqa: E402

pytestmark = pytest.mark.cuda
DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
TOL = 1e-2  # relative error (norm), as tests/test_kernels_prefill_gpu.py
BLOCK = 16
# flash, thresholds at 1 so small chunks qualify (a test may raise them)
LOW = ForwardConfig(
    prefill_sdpa="flash", prefill_sdpa_min_pairs=1, prefill_sdpa_min_queries=1, prefill_sdpa_fresh_min_tokens=1
)


@dataclass
class Paths:
    """What the layer calls of a test did: the SDPA chunks (start_pos, num_tokens) and the chunk
    lengths of each Triton launch."""

    sdpa: list[tuple[int, int]]
    kernel: list[list[int]]


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[Paths]:
    """Records both paths."""
    rec = Paths([], [])
    sdpa_chunk, launch = attention._sdpa_chunk, prefill_kernel.prefill_attention

    def spy_sdpa(ctx, spec, c, *args):
        rec.sdpa.append((c.start_pos, c.num_tokens))
        return sdpa_chunk(ctx, spec, c, *args)

    def spy_launch(q, k, v, cache, layer, meta, *args, **kw):
        rec.kernel.append(meta.q_len.tolist())
        return launch(q, k, v, cache, layer, meta, *args, **kw)

    monkeypatch.setattr(attention, "_sdpa_chunk", spy_sdpa)
    monkeypatch.setattr(prefill_kernel, "prefill_attention", spy_launch)
    yield rec


class Step:
    """Sequences with true K/V over [0, end) and queries for their chunk [start, end), a KV cache
    holding each one's prefix (pages, and the ring's last `window` positions), NaN elsewhere."""

    def __init__(self, shapes: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, window: int,
                 dtype: torch.dtype = DTYPE, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.shapes, self.window, self.scale = shapes, window, dim**-0.5
        self.k = [torch.randn(p0 + n, kv_heads, dim, generator=gen).to(dtype) for p0, n in shapes]
        self.v = [torch.randn(p0 + n, kv_heads, dim, generator=gen).to(dtype) for p0, n in shapes]
        self.q = [torch.randn(n, heads, dim, generator=gen).to(dtype) for _, n in shapes]
        need = [math.ceil((p0 + n) / BLOCK) for p0, n in shapes]
        self.num_blocks = sum(need) + 4
        perm = torch.randperm(self.num_blocks, generator=gen).tolist()
        self.tables = [perm[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(shapes))]
        self.layout = KVLayout(2, 2, BLOCK, window or 1, kv_heads, dim, dtype)

    def new_cache(self) -> KVCache:
        kv = KVCache(self.layout, self.num_blocks, len(self.shapes) + 2, DEVICE)
        kv.pages.fill_(float("nan"))
        kv.swa.fill_(float("nan"))
        for i, (p0, _) in enumerate(self.shapes):
            pos = torch.arange(p0)
            ids = torch.tensor(self.tables[i], dtype=torch.long)[pos // BLOCK]
            for j, x in enumerate((self.k[i], self.v[i])):
                kv.pages[ids.to(DEVICE), 1, j, (pos % BLOCK).to(DEVICE)] = x[:p0].to(DEVICE)
                if self.window:
                    ring = torch.arange(max(0, p0 - self.window), p0)
                    kv.swa[i + 1, 1, j, (ring % self.window).to(DEVICE)] = x[ring].to(DEVICE)
        return kv

    def run(self, is_sliding: bool, numerics: Numerics = Numerics.DEFAULT, kv: KVCache | None = None,
            config: ForwardConfig = LOW) -> torch.Tensor:
        """The step's attention output on layer 1 (full or sliding), [tokens, heads, dim], on the CPU."""
        kv = kv or self.new_cache()
        chunks, row = [], 0
        for i, (p0, n) in enumerate(self.shapes):
            chunks.append(SeqChunk(row, n, p0, self.tables[i], i + 1))
            row += n
        q = torch.cat(self.q).to(DEVICE)
        k = torch.cat([k[p0 : p0 + n] for k, (p0, n) in zip(self.k, self.shapes)]).to(DEVICE)
        v = torch.cat([v[p0 : p0 + n] for v, (p0, n) in zip(self.v, self.shapes)]).to(DEVICE)
        spec = AttnSpec(is_sliding, 1, self.window if is_sliding else None, self.scale)
        with forward_context(chunks, kv, numerics, config=config):
            out = chunked_attention(q, k, v, spec)
        return out.cpu()

    def reference(self, is_sliding: bool) -> torch.Tensor:
        """float32: the query at position p sees keys [0, p], or (p - window, p] on a sliding layer."""
        outs = []
        for (p0, n), q, k, v in zip(self.shapes, self.q, self.k, self.v):
            k, v = k[: p0 + n], v[: p0 + n]
            group = q.shape[1] // k.shape[1]
            kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", q.float(), kf) * self.scale
            q_pos, k_pos = torch.arange(p0, p0 + n)[:, None], torch.arange(p0 + n)[None]
            mask = k_pos <= q_pos
            if is_sliding:
                mask &= k_pos > q_pos - self.window
            outs.append(torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), vf))
        return torch.cat(outs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def check_both_paths(step: Step, is_sliding: bool, paths: Paths, setting: str = "flash",
                     config: ForwardConfig = LOW) -> None:
    """The SDPA path's rows against the reference and the kernel path's."""
    fast = step.run(is_sliding, config=replace(config, prefill_sdpa=setting))
    slow = step.run(is_sliding, config=replace(config, prefill_sdpa="off"))
    ref = step.reference(is_sliding)
    assert not fast.isnan().any()
    assert rel_err(slow, ref) < TOL
    assert rel_err(fast, ref) < TOL, rel_err(fast, ref)
    assert rel_err(fast, slow.float()) < TOL


LAYOUTS = [(8, 2, 128), (4, 4, 64), (6, 2, 80)]  # heads, kv_heads, head_dim: GQA 4, 1, 3


@pytest.mark.parametrize("heads,kv_heads,dim", LAYOUTS)
@pytest.mark.parametrize("setting", ["flash", "cudnn"])
def test_no_prefix(paths: Paths, heads: int, kv_heads: int, dim: int, setting: str) -> None:
    step = Step([(0, 300)], heads, kv_heads, dim, window=0)
    check_both_paths(step, False, paths, setting)
    assert paths.sdpa == [(0, 300)] and paths.kernel == [[300]]  # the second run: the kernel's


@pytest.mark.parametrize("prefix,n", [(48, 100), (37, 91), (256, 200), (130, 1)])
@pytest.mark.parametrize("setting", ["flash", "cudnn"])
def test_cached_prefix(paths: Paths, prefix: int, n: int, setting: str) -> None:
    """A chunk after a prefix of a few pages (a prefix-cache hit, or a later chunk), aligned or not."""
    step = Step([(prefix, n)], 8, 2, 128, window=0, seed=prefix)
    check_both_paths(step, False, paths, setting)
    assert paths.sdpa == [(prefix, n)]


def test_chunked_prompt(paths: Paths) -> None:
    """A 400-token prompt prefilled in three steps on one cache: each chunk's own K/V lands in the pages
    (as the engine stores them) and the next chunk reads it as its prefix."""
    whole = Step([(0, 400)], 8, 2, 128, window=0, seed=3)
    ref = whole.reference(False)
    outs = {}
    for setting in ("flash", "off"):
        kv, pos, rows = whole.new_cache(), 0, []
        for n in (150, 150, 100):
            part = Step([(pos, n)], 8, 2, 128, window=0)
            part.k, part.v, part.q = whole.k, whole.v, [whole.q[0][pos : pos + n]]
            part.tables = whole.tables
            rows.append(part.run(False, kv=kv, config=replace(LOW, prefill_sdpa=setting)))
            pos += n
        outs[setting] = torch.cat(rows)
    assert paths.sdpa == [(0, 150), (150, 150), (300, 100)]
    assert rel_err(outs["flash"], ref) < TOL and rel_err(outs["off"], ref) < TOL
    assert rel_err(outs["flash"], outs["off"].float()) < TOL


def test_two_sequences(paths: Paths) -> None:
    step = Step([(0, 200), (64, 150)], 8, 2, 128, window=0, seed=5)
    check_both_paths(step, False, paths)
    assert paths.sdpa == [(0, 200), (64, 150)]


def test_mixed_step_rest_on_kernel(paths: Paths) -> None:
    """Chunks below the threshold run in one Triton launch beside the SDPA chunks; no row is lost."""
    step = Step([(0, 200), (32, 40), (70, 130), (5, 1)], 8, 2, 128, window=0, seed=6)
    check_both_paths(step, False, paths, config=replace(LOW, prefill_sdpa_min_queries=100))
    assert paths.sdpa == [(0, 200), (70, 130)]
    assert paths.kernel[0] == [40, 1]


def test_sliding_within_window(paths: Paths) -> None:
    """Window 256: a fresh chunk and one after a 100-token ring (end 250) take SDPA; one ending past the
    window (start 200, end 300) stays on the kernel, in the same step."""
    step = Step([(0, 200), (100, 150), (200, 100)], 8, 2, 128, window=256, seed=7)
    check_both_paths(step, True, paths)
    assert paths.sdpa == [(0, 200), (100, 150)]
    assert paths.kernel[0] == [100]


def test_deterministic_mode_never_takes_it(paths: Paths) -> None:
    """Deterministic mode: the Triton kernel for every chunk, bit-identical to the path with SDPA off."""
    step = Step([(0, 200), (48, 100)], 8, 2, 128, window=0, seed=8)
    det = step.run(False, Numerics.BATCH_INVARIANT)
    off = step.run(False, Numerics.BATCH_INVARIANT, config=replace(LOW, prefill_sdpa="off"))
    assert paths.sdpa == []
    assert torch.equal(det, off)
    assert rel_err(det, step.reference(False)) < TOL


def test_float32_keeps_kernel(paths: Paths) -> None:
    """flash has no float32: such a step (the float32 engine tests) stays on the kernel."""
    step = Step([(0, 64)], 4, 2, 64, window=0, dtype=torch.float32)
    out = step.run(False)
    assert paths.sdpa == [] and rel_err(out, step.reference(False)) < 1e-4


def test_fresh_setting_takes_only_chunks_without_a_prefix(paths: Paths) -> None:
    """The default setting: a long chunk with nothing cached goes to SDPA (cuDNN where torch can), a
    chunk after a prefix or a short one stays on the kernel, in the same step."""
    step = Step([(0, 300), (48, 100), (0, 200)], 8, 2, 128, window=0, seed=4)
    check_both_paths(step, False, paths, "fresh", replace(LOW, prefill_sdpa_fresh_min_tokens=256))
    assert paths.sdpa == [(0, 300)] and paths.kernel == [[100, 200], [300, 100, 200]]


def test_default_setting_is_fresh() -> None:
    assert ForwardConfig().prefill_sdpa == "fresh"


def test_default_threshold_skips_small_chunks(paths: Paths) -> None:
    step = Step([(0, 1024), (0, 512), (1000, 100)], 8, 2, 128, window=0, seed=9)
    step.run(False, config=ForwardConfig(prefill_sdpa="flash"))  # the default min pairs and queries
    assert paths.sdpa == [(0, 1024)]  # 512 x 512 and 100 queries stay on the kernel
    assert paths.kernel == [[512, 100]]


@pytest.mark.parametrize("family,plan", [("llama", [40, 37, 50]), ("gemma3_hybrid", [10, 14, 40])])
@pytest.mark.parametrize("setting", ["flash", "cudnn"])
def test_engine_prefill_logits(tiny_model_dir, paths: Paths, family: str, plan: list[int], setting: str) -> None:
    """A tiny bf16 model's last-position logits, prompts prefilled in chunks (two sequences, one step
    each chunk): the SDPA path against the kernel path, with q/k/v as the model hands them (strided
    views of one fused projection). gemma3_hybrid (window 24): its first two chunks take SDPA on the
    sliding layers too, the third does not."""
    eng = small_engine(tiny_model_dir(family), device="cuda", dtype="bfloat16", hicache_gb=0.1, forward=LOW)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (sum(plan),), generator=gen).tolist() for _ in range(2)]
    eng.runner.forward_config = replace(LOW, prefill_sdpa=setting)
    fast = prompt_logits(eng, prompts, [plan, plan])
    assert paths.sdpa
    eng.runner.forward_config = replace(LOW, prefill_sdpa="off")
    slow = prompt_logits(eng, prompts, [plan, plan])
    for a, b in zip(fast, slow):
        assert rel_err(a, b.float()) < 5e-2  # bf16 through the whole model


def test_prints_speed(paths: Paths) -> None:
    """One Llama-3-8B-shaped layer (32 heads, 8 kv heads, 128 dims): an 8k fresh chunk and an 8k chunk
    after a 24k prefix (the last of a 32k prompt in 8k chunks), each path's TFLOP/s (causal pairs)."""
    for prefix, n in [(0, 8192), (24576, 8192)]:
        step = Step([(prefix, n)], 32, 8, 128, window=0, seed=10)
        kv = step.new_cache()
        chunks = [SeqChunk(0, n, prefix, step.tables[0], 1)]
        q = step.q[0].to(DEVICE)
        k, v = step.k[0][prefix:].to(DEVICE), step.v[0][prefix:].to(DEVICE)
        spec = AttnSpec(False, 1, None, step.scale)
        flops = 4 * 32 * 128 * n * (prefix + (n + 1) / 2)
        line = f"prefix {prefix} chunk {n}:"
        for setting in ("flash", "cudnn", "off"):
            with forward_context(chunks, kv, Numerics.DEFAULT, config=replace(LOW, prefill_sdpa=setting)):
                for _ in range(3):
                    chunked_attention(q, k, v, spec)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    chunked_attention(q, k, v, spec)
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / 10
            line += f" {setting} {dt * 1e3:.2f} ms ({flops / dt / 1e12:.0f} TFLOP/s)"
        print(line)
