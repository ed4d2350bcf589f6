"""Helpers the engine tests share: a small engine, raw logits of a prompt, a transformers reference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.sequence import Sequence
from engine.engine import LLMEngine
from engine.request import SamplingParams


def small_engine(folder: Path, **kw) -> LLMEngine:
    base = dict(device="cpu", block_size=16, max_num_batched_tokens=64, kv_cache_gb=0.05, max_num_seqs=16)
    base.update(kw)
    return LLMEngine(EngineConfig(model=str(folder), **base))


def prompt_logits(eng: LLMEngine, prompts: list[list[int]], chunks: list[list[int]] | None = None) -> list[torch.Tensor]:
    """Last-position logits of each prompt, run together in one batch (optionally in chunks)."""
    seqs = [Sequence(f"p{i}", p, SamplingParams(), 0, 0.0) for i, p in enumerate(prompts)]
    for s in seqs:
        eng.scheduler.allocate(s)
    out: dict[int, torch.Tensor] = {}
    try:
        plan = chunks or [[len(p)] for p in prompts]
        steps = max(len(c) for c in plan)
        for k in range(steps):
            active = [i for i in range(len(seqs)) if k < len(plan[i])]
            sampled, logits = eng.runner.run([seqs[i] for i in active], [plan[i][k] for i in active])
            for i in active:
                seqs[i].num_computed += plan[i][k]
            for j, idx in enumerate(sampled):
                out[active[idx]] = logits[j].clone()
    finally:
        for s in seqs:
            eng.scheduler.release(s)
    return [out[i] for i in range(len(prompts))]


def hf_greedy(folder: Path, prompt: list[int], max_new_tokens: int, dtype=torch.float32, device: str = "cpu"):
    """transformers' greedy tokens and per-step logits (EOS ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = [x[0].float() for x in out.logits]  # raw (unprocessed) logits; the first: the prompt's last position
    return tokens, logits, logits[0]


def compare_greedy(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor], tie_gap: float) -> str:
    """'' if identical; else a report of where they part, asserting the reference was near a tie there."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = torch.topk(ref_logits[i], 2).values
            gap = float(top2[0] - top2[1])
            assert gap < tie_gap, f"tokens part at step {i} ({a} vs {b}) with a clear reference winner (gap {gap:.3g})"
            return f"parted at step {i} on a near-tie (gap {gap:.2e})"
    assert len(ours) == len(ref)
    return ""


def random_prompts(lengths: list[int], seed: int, vocab: int = 512) -> list[list[int]]:
    """Token ids in [3, vocab) (clear of the tiny models' special ids), one prompt per length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def decode_logits(
    eng: LLMEngine, prompts: list[list[int]], max_tokens: int, agree: Callable[[bool], bool] = bool
) -> dict[str, list[torch.Tensor]]:
    """Greedy generation of every prompt at once (request ids r0, r1, ...): each request's logits at
    every sampled step, as float32 on the CPU. The engine ends idle. agree: whether to step, from whether
    this engine has work (an expert-parallel group's ExpertGroup.any: its schedulers step together)."""
    captured: dict[str, list[torch.Tensor]] = {}
    run = eng.runner.run

    def recording_run(seqs, num_new, **kw):  # type: ignore[no-untyped-def]
        sampled, logits = run(seqs, num_new, **kw)
        for j, i in enumerate(sampled):
            captured.setdefault(seqs[i].request_id, []).append(logits[j].float().cpu().clone())
        return sampled, logits

    eng.runner.run = recording_run  # type: ignore[method-assign]
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        while agree(eng.has_unfinished()):
            eng.step()
    finally:
        eng.runner.run = run  # type: ignore[method-assign]
    eng.check_idle()
    # a sequence fed ahead (engine/execution/launch_ahead.py) has one more row computed after its last token, which
    # the engine drops: so are its logits here
    return {rid: rows[:max_tokens] for rid, rows in captured.items()}
