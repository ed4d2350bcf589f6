"""The CUDA decode path end to end on tiny models (skipped without CUDA): decode rows through the
paged decode kernel, replayed from CUDA graphs or launched eagerly, against the chunked attention path
that the CPU uses; deterministic mode's decode logits bit-identical alone and among other requests."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.config import ForwardConfig
from engine.execution.runner import ModelRunner
from tests.engine_utils import decode_logits, random_prompts, small_engine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
FAMILIES = ["llama", "qwen3_hybrid", "gemma3_hybrid", "deepseek_v3"]  # deepseek_v3: latent attention


# the decode step's kernel choices: as configured by default; with the batch-1 GEMV and programmatic
# dependent launch; with the rows' q/k norms and rotary before the attention kernel instead of inside it
FORWARDS = {"default": ForwardConfig(), "gemv-pdl": ForwardConfig(gemv_rows=1, pdl=True),
            "rope-outside": ForwardConfig(decode_rope=False)}


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_graph_and_eager_decode_match_chunked_path(tiny_model_dir, family: str, forward: str) -> None:
    """float32, so the three paths agree to float tolerance; prompts cross the 24-token window (rings
    wrap) and page boundaries (block 16); 40 new tokens; batch sizes 3 (padded to a bucket of 4) and 1
    (the GEMV's rows)."""
    folder = tiny_model_dir(family)
    prompts = random_prompts([5, 30, 47], seed=1)
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, hicache_gb=0.1, forward=FORWARDS[forward])
    graphs = small_engine(folder, **kw)
    assert graphs.graph_stats is not None and graphs.graph_stats.batch_sizes == (1, 2, 4, 8)
    eager = small_engine(folder, enforce_eager=True, **kw)
    assert eager.graph_stats is None
    chunked = small_engine(folder, enforce_eager=True, **kw)
    # no decode rows: the CPU's path
    chunked.runner = ModelRunner(chunked.model, chunked.kv, chunked.numerics, chunked.runner.forward_config)
    chunked.ahead.runner = chunked.runner  # batches launched ahead too
    for batch in (prompts, prompts[1:2]):
        results = [decode_logits(e, batch, 40) for e in (graphs, eager, chunked)]
        for rid in results[2]:
            assert len(results[0][rid]) == len(results[2][rid]) == 40
            for a, b, c in zip(results[0][rid], results[1][rid], results[2][rid]):
                torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_decode_batch_invariant(tiny_model_dir, family: str, pdl: bool) -> None:
    """bf16: one request's decode logits alone, then among requests that prefill and decode beside it
    (mixed steps run eagerly, pure decode steps replay graphs of other sizes): bit-identical."""
    eng = small_engine(tiny_model_dir(family), device="cuda", is_deterministic=True, max_num_batched_tokens=48,
                       hicache_gb=0.1, forward=ForwardConfig(pdl=pdl))
    target, *others = random_prompts([61, 9, 100, 40], seed=5)
    alone = decode_logits(eng, [target], 12)["r0"]
    eng.runner.run = type(eng.runner).run.__get__(eng.runner)  # drop the recorder
    batched = decode_logits(eng, [*others[:2], target, others[2]], 12)["r2"]
    assert len(alone) == len(batched) == 12
    for a, b in zip(alone, batched):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid"])  # gemma3: sandwich norms, gelu(tanh)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_chained_residual_norms_bit_identical(tiny_model_dir, dtype: str, family: str, forward: str) -> None:
    """The CUDA forward that does each residual add inside the next norm's kernel gives exactly the
    logits of the layer-by-layer forward (add, then norm): prefill and graph-replayed decode steps, with
    each choice of the decode step's kernels."""
    folder = tiny_model_dir(family)
    prompts = random_prompts([5, 30, 47], seed=3)
    logits = {}
    for chained in (True, False):
        eng = small_engine(folder, device="cuda", dtype=dtype, max_num_seqs=8, hicache_gb=0.1,
                           forward=replace(FORWARDS[forward], chain_residuals=chained))
        logits[chained] = decode_logits(eng, prompts, 12)
    assert logits[True].keys() == logits[False].keys()
    for rid, steps in logits[True].items():
        assert len(steps) == len(logits[False][rid]) == 12
        assert all(torch.equal(a, b) for a, b in zip(steps, logits[False][rid])), rid


@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid"])
def test_pdl_changes_no_number(tiny_model_dir, family: str) -> None:
    """Programmatic dependent launch only lets kernels start early: bf16 logits of graph-replayed decode
    steps (batch 3, then 1 on the GEMV) bit-identical with it and without it."""
    folder = tiny_model_dir(family)
    prompts = random_prompts([5, 30, 47], seed=4)
    logits = {}
    for pdl in (False, True):
        eng = small_engine(folder, device="cuda", max_num_seqs=8, hicache_gb=0.1,
                           forward=ForwardConfig(gemv_rows=1, pdl=pdl))
        logits[pdl] = [decode_logits(eng, prompts, 12), decode_logits(eng, prompts[:1], 12)]
    for run_off, run_on in zip(logits[False], logits[True]):
        assert run_off.keys() == run_on.keys()
        for rid, steps in run_off.items():
            assert all(torch.equal(a, b) for a, b in zip(steps, run_on[rid])), rid


@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid"])
def test_launch_ahead_same_tokens_from_graphs(tiny_model_dir, family: str) -> None:
    """--launch-ahead with decode graphs (the next replay queued before a step returns): the same
    tokens, logprobs and finish reasons as without, with requests arriving mid-stream (deterministic,
    so a request's tokens do not depend on the batches it shares)."""
    from tests.engine.execution.test_launch_ahead import PROMPTS, params, run, summary

    late = {5: [("late", PROMPTS[4], params(4))]}
    got = {}
    for ahead in (False, True):
        eng = small_engine(tiny_model_dir(family), device="cuda", is_deterministic=True, launch_ahead=ahead,
                           max_num_seqs=8, hicache_gb=0.1)
        assert eng.graph_stats is not None
        for i, prompt in enumerate(PROMPTS[:4]):
            eng.add_request(f"r{i}", prompt, params(i), use_prefix_cache=False)
        got[ahead] = {rid: summary(o) for rid, o in run(eng, {k: list(v) for k, v in late.items()}).items()}
        assert (eng.ahead.num_launched_ahead >= 10) == ahead
    assert got[True] == got[False] and "late" in got[True]


@pytest.mark.parametrize("family", ["llama", "gemma3_hybrid"])
def test_launch_ahead_fed_greedy_same_tokens_from_graphs(tiny_model_dir, family: str) -> None:
    """--launch-ahead on greedy rows: the next graph replay is fed the argmax on the device (written
    into the static input buffer after the host's fill) before the tokens reach the host; stop ids
    end some sequences in flight (so batches differ: deterministic numerics). The same tokens as without."""
    from tests.engine.execution.test_launch_ahead import PROMPTS, fed_run, greedy

    folder = tiny_model_dir(family)
    kw = dict(device="cuda", is_deterministic=True, max_num_seqs=8, hicache_gb=0.1)
    first, _ = fed_run(folder, False, [(f"r{i}", p, greedy(i)) for i, p in enumerate(PROMPTS)], **kw)
    stops = {i: (first[f"r{i}"][0][2 + i],) for i in (1, 3, 4)}
    requests = [(f"r{i}", p, greedy(i, stops.get(i, ()))) for i, p in enumerate(PROMPTS)]
    got = {}
    for ahead in (False, True):
        got[ahead], eng = fed_run(folder, ahead, requests, **kw)
        assert eng.graph_stats is not None and (eng.ahead.num_fed_ahead >= 10) == ahead
    assert got[True] == got[False]
