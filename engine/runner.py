"""Runs the model on a scheduled batch: flattens the sequences' new tokens, sets the forward
context, returns the float32 logits of every sequence whose chunk reaches its last token."""

from __future__ import annotations

import torch

from engine.context import SeqChunk, forward_context
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.numerics import Numerics
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, numerics: Numerics) -> None:
        self.model = model
        self.kv = kv
        self.numerics = numerics
        self.device = kv.device

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new_tokens: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Returns (indices into seqs that get a sampled token, their logits [k, vocab])."""
        input_ids: list[int] = []
        positions: list[int] = []
        chunks: list[SeqChunk] = []
        last_rows: list[int] = []
        sampled: list[int] = []
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            start = seq.num_computed
            tokens = seq.all_token_ids[start : start + n]
            chunks.append(SeqChunk(len(input_ids), n, start, seq.block_ids, seq.state_slot))
            input_ids += tokens
            positions += range(start, start + n)
            if start + n == seq.num_tokens:
                sampled.append(i)
                last_rows.append(len(input_ids) - 1)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        with forward_context(chunks, self.kv, self.numerics):
            hidden = self.model(ids_t, pos_t)
            if not sampled:
                return [], None
            rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
            logits = self.model.logits(hidden[rows])
        return sampled, logits
