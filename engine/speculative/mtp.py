"""Drafting with the checkpoint's own multi-token-prediction layer (`--speculative-config '{"method": "mtp"}'`,
engine/models/mtp.py MTPLayer; DeepSeek-V3's num_nextn_predict_layers).

The MTP layer keeps a KV entry for every position the target has computed, in lockstep with it: after
each step, every sequence's positions [start, c) that the target computed and kept this step (a prefill
chunk, a decode, a verify's last token and accepted drafts) run through the MTP layer, position i fed
the target's hidden state h_i and the next token x_{i+1} (known: prompt, or drawn by now). That
"catch-up" is one forward for the whole batch. Its last row of a decoding sequence (i = c - 1, fed
x_c: the token the next step feeds) predicts x_{c+1}, the first draft; drafts 2..k chain, one
forward each for the batch, position c + j - 2 fed draft j - 1 and the MTP layer's own output at the
position before, as DeepSeek describes:

    target computed:   ... h_{c-2}  h_{c-1}      (the verify's kept rows)
    MTP catch-up:      ... (h_{c-2}, x_{c-1})  (h_{c-1}, x_c)  -> d1
    MTP chain:                                  (g, d1) -> d2,  (g', d2) -> d3, ...

The chain's KV entries lie past the target's computed tokens; the next catch-up writes those positions
again before any MTP row reads them. A sequence parked after its prefill (a PE's) gets its catch-up too,
so the KV it hands off covers its whole prompt; the CE drafts from its own first decode step's hidden
state on. Drafts are greedy (the MTP head's argmax): verification (speculator.py) keeps the output
the target's own."""

from __future__ import annotations

from typing import cast

import torch

from engine.config import ForwardConfig
from engine.core.kv_cache import KVCache
from engine.core.scheduler import Scheduler
from engine.core.sequence import SeqStatus, Sequence
from engine.layers.context import SeqChunk, forward_context
from engine.layers.numerics import Numerics
from engine.models.decoder import CausalLM
from engine.models.mtp import MTPLayer


class MtpDrafter:
    def __init__(
        self, model: CausalLM, kv: KVCache, numerics: Numerics, config: ForwardConfig, scheduler: Scheduler
    ) -> None:
        if model.mtp is None:
            raise ValueError("the model was built without its multi-token-prediction layers")
        self.layer = cast(MTPLayer, model.mtp[0])
        self.kv, self.numerics, self.config, self.scheduler = kv, numerics, config, scheduler
        self.device = kv.device
        self._drafts: dict[str, list[int]] = {}  # request id -> its drafts for the next step

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self._drafts.pop(seq.request_id, [])[:k]

    def forget(self) -> None:
        """Drops every draft (after a failed forward)."""
        self._drafts.clear()

    @torch.inference_mode()
    def after_step(
        self,
        seqs: list[Sequence],
        starts: list[int],
        hidden: torch.Tensor,
        first_rows: dict[int, int],
        num_drafts: int,
    ) -> None:
        """seqs: the step's batch; starts: each one's computed count before the step; hidden, first_rows: the
        runner's last forward (its hidden states, each sequence's first row by its index in seqs).
        num_drafts: how many to draft for each decoding sequence (0: the catch-up alone)."""
        self._drafts.clear()
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        chunks: list[SeqChunk] = []
        drafting: list[tuple[Sequence, int]] = []  # (seq, its catch-up's last row)
        for i, (seq, start) in enumerate(zip(seqs, starts)):
            end = seq.num_computed
            if seq.status not in (SeqStatus.RUNNING, SeqStatus.PARKED) or end <= start or i not in first_rows:
                continue
            chunks.append(SeqChunk(len(ids), end - start, start, seq.block_ids, seq.state_slot))
            ids += seq.token_ids(start + 1, end + 1)
            positions += range(start, end)
            rows += range(first_rows[i], first_rows[i] + end - start)
            if num_drafts and seq.status is SeqStatus.RUNNING and seq.num_uncomputed == 1:
                drafting.append((seq, len(ids) - 1))
        if not chunks:
            return
        last = [r for _, r in drafting]
        out, tokens = self._forward(chunks, ids, positions, hidden[torch.tensor(rows, device=self.device)], last)
        if not drafting:
            return
        prev = out[torch.tensor(last, device=self.device)]  # each drafting sequence's row, updated as its chain goes
        drafts = [[t] for t in tokens.tolist()]
        going = list(range(len(drafting)))
        for j in range(1, num_drafts):
            # chain row j sits at position c + j - 1, past the sequence's tokens: it needs a page there
            going = [g for g in going if self.scheduler.grow_all([drafting[g][0]], j)]
            if not going:
                break
            sel = torch.tensor(going, device=self.device)
            chain = []
            for n, g in enumerate(going):
                seq = drafting[g][0]
                chain.append(SeqChunk(n, 1, seq.num_computed + j - 1, seq.block_ids, seq.state_slot))
            out, chained = self._forward(
                chain, tokens[sel].tolist(), [c.start_pos for c in chain], prev[sel], list(range(len(chain)))
            )
            prev[sel] = out
            tokens[sel] = chained
            for g, t in zip(going, tokens[sel].tolist()):
                drafts[g].append(t)
        for (seq, _), d in zip(drafting, drafts):
            self._drafts[seq.request_id] = d

    def _forward(
        self, chunks: list[SeqChunk], ids: list[int], positions: list[int], prev: torch.Tensor, draw: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over the chunks' rows: its output [rows, hidden] and the greedy tokens of rows `draw`."""
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        with forward_context(chunks, self.kv, self.numerics, config=self.config):
            out = self.layer(ids_t, pos_t, prev)
            if not draw:
                return out, out.new_empty(0, dtype=torch.long)
            return out, self.layer.logits(out[torch.tensor(draw, device=self.device)]).argmax(-1)
