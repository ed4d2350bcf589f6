"""Runs the model on a scheduled batch: flattens the sequences' new tokens, sets the forward
context, returns the float32 logits of every sequence whose chunk reaches its last token. A sequence
that asks for prompt logprobs also gets those of its chunk's prompt positions, added to its collector
(engine/core/prompt_logprobs.py) in a separate pass over the LM head, so the sampled rows' logits are the
same whether any sequence asks or not.

On CUDA, decode rows (engine/layers/decode.py) go last in the flattened batch and attend through the paged
decode kernel; a step made only of decode rows replays a CUDA graph (engine/execution/cuda_graphs.py) when one
of its size was captured.

A step is planned (`StepPlan`: ints only) and then executed; rank 0 of a tensor-parallel group
broadcasts the plan between the two, and the group's other ranks execute it too (`follow`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.config import ForwardConfig
from engine.core.kv_cache import KVCache
from engine.core.prompt_logprobs import PromptLogprobsCollector
from engine.core.sequence import Sequence
from engine.execution.cuda_graphs import DecodeGraphs, GraphCaptureStats
from engine.layers.context import SeqChunk, forward_context
from engine.layers.decode import DecodeInputs, DecodeRows, decode_rows, is_decode_row
from engine.layers.numerics import Numerics
from engine.models.decoder import CausalLM
from engine.parallel.tensor_parallel import PLAN_STEP

if TYPE_CHECKING:
    from engine.parallel.tensor_parallel import TensorGroup

PROMPT_LOGPROB_ROWS = 256  # prompt positions per LM-head pass: [rows, vocab] float32 at a time


log = logging.getLogger(__name__)

class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        numerics: Numerics,
        forward_config: ForwardConfig,
        max_decode_rows: int = 0,
        max_model_len: int = 0,
        tp: TensorGroup | None = None,
        verify_width: int = 1,
    ) -> None:
        """max_decode_rows > 0 on CUDA: decode rows use the paged decode kernel (max_model_len sizes
        the block tables); 0 keeps every row on the chunked path. forward_config goes into every
        step's context: a benchmark may replace it between steps (decode graphs keep the one they
        were captured with). tp: rank 0 of a tensor-parallel group broadcasts each step's plan to it.
        verify_width: the rows one sequence may verify in a step (1 + its drafts at most; 1 without)."""
        self.model = model
        self.tp = tp
        self.kv = kv
        self.numerics = numerics
        self.forward_config = forward_config
        self.device = kv.device
        self.decode_inputs: DecodeInputs | None = None
        self.graphs: DecodeGraphs | None = None
        self.num_forwards = 0  # forwards begun (an expert-parallel step checks that it ran one)
        # keep_hidden (an MTP proposer reads them): the last forward's hidden states [tokens, hidden] and each
        # sequence's first row in them (by index into the seqs run), its rows in position order
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self.last_hidden_rows: dict[int, int] = {}
        # speculative decoding verifies as decode rows (engine/layers/decode.py); False: on the chunked path
        # (a benchmark compares the two)
        self.verifies_in_kernel = True
        if self.device.type == "cuda" and max_decode_rows > 0:
            max_blocks = math.ceil((max_model_len + 1) / kv.block_size) if kv.num_full_layers else 1
            self.decode_inputs = DecodeInputs(max_decode_rows, max_blocks, kv.block_size, self.device, verify_width)

    def capture_graphs(self, batch_sizes: list[int], verify_sizes: list[int] | None = None) -> GraphCaptureStats:
        """Graphs of decode steps of batch_sizes rows, and of speculative verifies of verify_sizes rows."""
        if self.decode_inputs is None:
            raise RuntimeError("CUDA graphs need the decode kernel path (CUDA, max_decode_rows > 0)")
        max_rows = self.decode_inputs.max_rows
        verify = [b for b in verify_sizes or [] if b <= max_rows] if self.verifies_in_kernel else []
        self.graphs = DecodeGraphs(self.model, self.kv, self.numerics, self.decode_inputs, self.forward_config)
        log.info("capturing decode CUDA graphs (--enforce-eager: none)")
        stats = self.graphs.capture([b for b in batch_sizes if b <= max_rows], verify)
        log.info("%d decode graphs captured in %.1f s", len(stats.batch_sizes) + len(stats.verify_sizes), stats.capture_s)
        return stats

    @torch.inference_mode()
    def run(
        self, seqs: list[Sequence], num_new_tokens: list[int], fed_ids: torch.Tensor | None = None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Returns (indices into seqs that get a sampled token, their logits [k, vocab]: a sequence with
        drafts (Sequence.draft_token_ids) has 1 + len(drafts) rows, its last token's first). fed_ids: every
        row is a decode row whose input token is fed_ids[i] (on the device: sampled by the last step
        and not yet read by the host; the sequence's last token is a placeholder meanwhile). Rank 0 of
        a tensor-parallel group broadcasts the step's plan first (engine/parallel/tensor_parallel.py)."""
        self.num_forwards += 1
        if fed_ids is not None and (len(fed_ids) != len(seqs) or any(n != 1 for n in num_new_tokens)):
            raise ValueError("fed input ids need one decode row per sequence")
        decode: list[int] = []
        num_rows = 0  # the decode rows': a sequence's drafts are rows of their own
        if self.decode_inputs is not None:
            decode = [
                i for i, (s, n) in enumerate(zip(seqs, num_new_tokens))
                if is_decode_row(s, n) and (self.verifies_in_kernel or not s.draft_token_ids)
            ]  # fmt: skip
            num_rows = sum(1 + len(seqs[i].draft_token_ids) for i in decode)
            if num_rows > self.decode_inputs.max_rows:
                decode, num_rows = [], 0
        is_verify = num_rows > len(decode)
        if decode and len(decode) == len(seqs) and self.graphs is not None and self.graphs.bucket(num_rows, is_verify):
            replayed = self.graphs.run(seqs, fed_ids)
            if self.keep_hidden:
                self.last_hidden = self.graphs.last_hidden
                self.last_hidden_rows = _first_rows(seqs, decode, 0)
            return decode, replayed
        is_decode = set(decode)
        input_ids: list[int] = []
        positions: list[int] = []
        chunks: list[SeqChunk] = []
        last_rows: list[int] = []
        sampled: list[int] = []
        prompt_spans: list[tuple[Sequence, int, int]] = []  # (seq, positions [lo, hi)), beside plan.prompt_rows
        prompt_rows: list[tuple[int, int]] = []
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            if i in is_decode:
                continue
            start = seq.num_computed
            drafts = seq.draft_token_ids  # speculative decoding: fed after the last token, each row's logits kept
            tokens = seq.token_ids(start, start + n - len(drafts)) + drafts
            if seq.prompt_logprobs is not None:
                lo, hi = seq.prompt_logprobs.wanted(start, n)
                if lo < hi:
                    prompt_spans.append((seq, lo, hi))
                    prompt_rows.append((len(input_ids) + lo - start, hi - lo))
            chunks.append(SeqChunk(len(input_ids), n, start, seq.block_ids, seq.state_slot))
            input_ids += tokens
            positions += range(start, start + n)
            if start + n == seq.num_tokens + len(drafts):
                sampled.append(i)
                last_rows += range(len(input_ids) - 1 - len(drafts), len(input_ids))
        rows = None
        if decode:
            assert self.decode_inputs is not None
            rows = decode_rows([seqs[i] for i in decode], self.kv.block_size)
            sampled += decode
            last_rows += range(len(input_ids), len(input_ids) + num_rows)
        plan = StepPlan(input_ids, positions, chunks, rows, last_rows, prompt_rows)
        if self.keep_hidden:
            chunked = [i for i in range(len(seqs)) if i not in is_decode]
            self.last_hidden_rows = {i: c.token_start for i, c in zip(chunked, chunks)}
            self.last_hidden_rows.update(_first_rows(seqs, decode, len(input_ids)))
        if self.tp is not None:
            self.tp.send_plan(PLAN_STEP, plan.to_wire())

        def prompt_logits(span: int, first: int, logits: torch.Tensor) -> None:
            seq, lo, hi = prompt_spans[span]
            assert seq.prompt_logprobs is not None
            targets = seq.prompt_token_ids[lo + 1 + first : lo + 1 + first + len(logits)]
            self._prompt_logprobs(logits, targets, seq.prompt_logprobs)

        logits = self.execute(plan, fed_ids, prompt_logits)
        return sampled, logits

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """A tensor-parallel rank other than 0: runs rank 0's plan on its share of the model and KV."""
        self.num_forwards += 1
        self.execute(plan)

    def execute(
        self,
        plan: StepPlan,
        fed_ids: torch.Tensor | None = None,
        prompt_logits: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """One forward of plan; the logits of its logit_rows (None without any). prompt_logits(span,
        first row, logits): each plan.prompt_rows span's logits, PROMPT_LOGPROB_ROWS rows at a time."""
        ids_t = torch.tensor(plan.input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(plan.positions, dtype=torch.long, device=self.device)
        if fed_ids is not None and plan.decode is None:  # every row on the chunked path: one token each, in order
            ids_t = fed_ids.to(self.device, torch.long)
        meta = None
        if plan.decode is not None:
            assert self.decode_inputs is not None
            num_decode = len(plan.decode.input_ids)
            meta = self.decode_inputs.fill_rows(plan.decode, num_decode)
            if fed_ids is not None:  # every row is a decode row here
                meta.input_ids[:num_decode].copy_(fed_ids)
            ids_t = torch.cat([ids_t, meta.input_ids.long()])
            pos_t = torch.cat([pos_t, meta.positions.long()])
        with forward_context(plan.chunks, self.kv, self.numerics, decode=meta, config=self.forward_config):
            hidden = self.model(ids_t, pos_t)
            if self.keep_hidden:
                self.last_hidden = hidden
            for span, (row, count) in enumerate(plan.prompt_rows):
                for a in range(0, count, PROMPT_LOGPROB_ROWS):
                    logits = self.model.logits(hidden[row + a : row + min(a + PROMPT_LOGPROB_ROWS, count)])
                    if prompt_logits is not None:
                        prompt_logits(span, a, logits)
            if not plan.logit_rows:
                return None
            rows = torch.tensor(plan.logit_rows, dtype=torch.long, device=self.device)
            return self.model.logits(hidden[rows])

    def _prompt_logprobs(self, logits: torch.Tensor, targets: list[int], out: PromptLogprobsCollector) -> None:
        """The logprobs of `targets` (the prompt tokens after the positions of the logits' rows), their
        ranks and the top out.num_top, added to `out`. NOTE: each row's values depend on that row alone
        (the LM head under the step's numerics, log_softmax and topk are row-local), so a P/D pair's PE
        gives a single engine's bits whatever the chunking or the batch."""
        k = out.num_top
        lp = torch.log_softmax(logits, dim=-1)
        tgt = torch.tensor(targets, dtype=torch.long, device=lp.device).unsqueeze(1)
        chosen = lp.gather(1, tgt)
        ranks = (lp > chosen).sum(-1) + 1  # vLLM's rank: 1 + how many tokens are likelier
        top_ids: list[int] = []
        top_lps: list[float] = []
        if k:
            vals, ids = torch.topk(lp, k, dim=-1)
            top_ids, top_lps = ids.flatten().tolist(), vals.flatten().tolist()
        out.add(chosen.squeeze(1).tolist(), ranks.tolist(), top_ids, top_lps)


def _first_rows(seqs: list[Sequence], decode: list[int], start: int) -> dict[int, int]:
    """Each decode sequence's first row, its rows (1 + its drafts) following one another from start."""
    out = {}
    for i in decode:
        out[i] = start
        start += 1 + len(seqs[i].draft_token_ids)
    return out


@dataclass(frozen=True)
class StepPlan:
    """One forward, as ints (what rank 0 of a tensor-parallel group broadcasts): the flattened
    chunked-path tokens and their positions, each sequence's chunk, the decode rows after them (CUDA),
    the rows whose logits are sampled and the (first row, rows) spans that want prompt logprobs."""

    input_ids: list[int]
    positions: list[int]
    chunks: list[SeqChunk]
    decode: DecodeRows | None
    logit_rows: list[int]
    prompt_rows: list[tuple[int, int]]

    def to_wire(self) -> list[Any]:
        chunks = [[c.token_start, c.num_tokens, c.start_pos, c.block_ids, c.state_slot] for c in self.chunks]
        d = self.decode
        decode = None if d is None else [d.input_ids, d.positions, d.state_slots, d.block_tables]
        return [self.input_ids, self.positions, chunks, decode, self.logit_rows, [list(r) for r in self.prompt_rows]]

    @classmethod
    def from_wire(cls, data: list[Any]) -> StepPlan:
        ids, positions, chunks, decode, logit_rows, prompt_rows = data
        return cls(
            ids,
            positions,
            [SeqChunk(*c) for c in chunks],
            None if decode is None else DecodeRows(*decode),
            logit_rows,
            [(r[0], r[1]) for r in prompt_rows],
        )
