"""Token sampling from float32 logits: logit processors (penalties, logit_bias, min_tokens), greedy,
temperature, min-p, top-k, top-p, per-request seeds, logprobs.

A seeded draw depends only on (seed, index of the token in the output) and the sequence's own
logits, never on the batch: the same request gives the same tokens alone, batched, or after a P/D
handoff that carries just the seed and the output length. The processors are row-wise too, and their
state is the sequence's own tokens (prompt and output), which a handoff carries: a CE continues with
the same penalties the PE applied to the first token.
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams, TokenLogprob

_SEED_MASK = (1 << 63) - 1


def step_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 + output_index * 7_919 + 1) & _SEED_MASK


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    eos_ids: set[int] | frozenset[int],
) -> torch.Tensor:
    """The logits the choice is made from (OpenAI's and vLLM's semantics), for the whole batch at once:
    logit_bias added; EOS and stop_token_ids barred while the output is shorter than min_tokens; a token
    in the prompt or the output divided by repetition_penalty (multiplied, if its logit is negative);
    then frequency_penalty times its count in the output and presence_penalty once, subtracted. Rows
    without any are returned as they are (and without a copy when no row has one)."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[-1]
    sub = logits[rows].clone()  # [R, V]
    ps = [params[i] for i in rows]
    # logit_bias: one scatter_add over the padded (id, bias) lists (pad: an extra column, dropped)
    if any(p.logit_bias for p in ps):
        ids = _padded([[t for t, _ in p.logit_bias] for p in ps], vocab, dev)
        bias = torch.zeros(ids.shape, dtype=sub.dtype, device=dev)
        for r, p in enumerate(ps):
            if p.logit_bias:
                bias[r, : len(p.logit_bias)] = torch.tensor([b for _, b in p.logit_bias], dtype=sub.dtype)
        wide = torch.zeros(len(rows), vocab + 1, dtype=sub.dtype, device=dev).scatter_add_(1, ids, bias)
        sub += wide[:, :vocab]
    # min_tokens: EOS and the stop ids barred until the output is long enough
    barred = [
        sorted((set() if p.ignore_eos else set(eos_ids)) | set(p.stop_token_ids))
        if len(output_ids[i]) < p.min_tokens
        else []
        for i, p in zip(rows, ps)
    ]
    if any(barred):
        ids = _padded(barred, vocab, dev)
        mask = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)
        sub.masked_fill_(mask[:, :vocab], float("-inf"))
    # penalties: counts of each token in the output, and which tokens the prompt or output holds
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in ps):
        outs = _padded([output_ids[i] for i in rows], vocab, dev)
        counts = torch.zeros(len(rows), vocab + 1, dtype=sub.dtype, device=dev)
        counts = counts.scatter_add_(1, outs, torch.ones(outs.shape, dtype=sub.dtype, device=dev))[:, :vocab]
        column = lambda xs: torch.tensor(xs, dtype=sub.dtype, device=dev).unsqueeze(1)  # noqa: E731
        rp = column([p.repetition_penalty for p in ps])
        if any(p.repetition_penalty != 1.0 for p in ps):
            seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=dev)
            seen.scatter_(1, _padded([prompt_ids[i] for i in rows], vocab, dev), True)
            seen = seen[:, :vocab] | (counts > 0)
            sub = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
        sub -= column([p.frequency_penalty for p in ps]) * counts
        sub -= column([p.presence_penalty for p in ps]) * (counts > 0).to(sub.dtype)
    out = logits.clone()
    out[rows] = sub
    return out


def _filter(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    row = row / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    output_indices: list[int],
    raw_logits: torch.Tensor | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [n, vocab] float32 (processed: process_logits). Returns the chosen ids and, where asked,
    their logprobs, which come from raw_logits (the model's, before the processors: vLLM's default)."""
    raw = logits if raw_logits is None else raw_logits
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
            lp = torch.log_softmax(raw[i], dim=-1)  # one row at a time: the same bits batched or not
            n_top = params[i].logprobs or 0
            top: tuple[tuple[int, float], ...] = ()
            if n_top:
                vals, ids = torch.topk(lp, n_top)
                top = tuple(zip(ids.tolist(), vals.tolist()))
            logprobs[i] = TokenLogprob(tokens[i], float(lp[tokens[i]]), top)
    return tokens, logprobs
