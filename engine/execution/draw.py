"""A batch's tokens drawn from its logits: each row's logits processed (penalties, logit_bias, min_tokens:
engine/layers/sampler.py) and masked by its grammar (engine/core/grammar.py), then sampled; a row that
fails fails alone."""

from __future__ import annotations

import dataclasses

import torch

from engine.core.grammar import mask_logits
from engine.core.sequence import Sequence
from engine.faults import raise_if_fatal
from engine.layers.sampler import process_logits, sample
from engine.request import SamplingParams, TokenLogprob

Drawn = tuple[int, TokenLogprob | None] | Exception  # a row's token and logprobs, or what its row raised


class TokenDrawer:
    """Draws the tokens of the rows of a batch; eos_token_ids: what min_tokens bars."""

    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Drawn]:
        """Each sequence's token and logprobs, or the exception its row raised. The batch is drawn at
        once; if that fails it is drawn again row by row, which gives the same tokens (a row's draw
        depends only on its own logits, seed and output index), so only the culprit fails."""
        try:
            tokens, logprobs = sample(
                self._process(logits, seqs),
                [s.params for s in seqs],
                [s.seed for s in seqs],
                [len(s.output_token_ids) for s in seqs],
                logits,
            )
            return list(zip(tokens, logprobs))
        except Exception as e:
            raise_if_fatal(e)
        out: list[Drawn] = []
        for i, s in enumerate(seqs):
            try:
                row = logits[i : i + 1]
                tokens, logprobs = sample(
                    self._process(row, [s]), [s.params], [s.seed], [len(s.output_token_ids)], row
                )
                out.append((tokens[0], logprobs[0]))
            except Exception as e:
                raise_if_fatal(e)
                out.append(e)
        return out

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The logits each row draws from: processed (sampler.process_logits), then masked by its grammar.
        Where a grammar allows only tokens that min_tokens bars (the end, or a stop id), the grammar wins:
        that row is processed again without the bar, so the request ends there with "stop" rather than
        drawing from nothing (all -inf: a sampled row's draw raises, a greedy one takes token 0)."""
        processed = mask_logits(self._processed(logits, seqs), [s.matcher for s in seqs])
        barred = [i for i, s in enumerate(seqs) if s.matcher is not None and len(s.output_token_ids) < s.params.min_tokens]
        if barred:
            empty = torch.isneginf(processed[barred]).all(-1).tolist()
            stuck = [i for i, e in zip(barred, empty) if e]
            if stuck:
                rows = [seqs[i] for i in stuck]
                lifted = [dataclasses.replace(s.params, min_tokens=0) for s in rows]
                processed[stuck] = mask_logits(self._processed(logits[stuck], rows, lifted), [s.matcher for s in rows])
        return processed

    def _processed(
        self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams] | None = None
    ) -> torch.Tensor:
        return process_logits(
            logits,
            [s.params for s in seqs] if params is None else params,
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            self.eos_token_ids,
        )
