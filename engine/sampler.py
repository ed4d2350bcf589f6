"""Token sampling from float32 logits: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

A seeded draw depends only on (seed, index of the token in the output) and the sequence's own
logits, never on the batch: the same request gives the same tokens alone, batched, or after a P/D
handoff that carries just the seed and the output length.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams, TokenLogprob

_SEED_MASK = (1 << 63) - 1


def step_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 + output_index * 7_919 + 1) & _SEED_MASK


def _filter(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    row = row / params.temperature
    if params.top_k > 0 and params.top_k < row.shape[-1]:
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_row, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_row, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
        row = row.scatter(0, order, sorted_row.masked_fill(drop, float("-inf")))
    return row


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], output_indices: list[int]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [n, vocab] float32. Returns the chosen ids and, where asked, their logprobs."""
    tokens = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        probs = torch.softmax(_filter(logits[i], p), dim=-1)
        gen = torch.Generator(device=logits.device).manual_seed(step_seed(seeds[i], output_indices[i]))
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        for i in wanted:
            lp = torch.log_softmax(logits[i], dim=-1)  # one row at a time: the same bits batched or not
            n_top = params[i].logprobs or 0
            top: tuple[tuple[int, float], ...] = ()
            if n_top:
                vals, ids = torch.topk(lp, n_top)
                top = tuple(zip(ids.tolist(), vals.tolist()))
            logprobs[i] = TokenLogprob(tokens[i], float(lp[tokens[i]]), top)
    return tokens, logprobs
