"""Drafting with a small model of the same tokenizer (`--speculative-config '{"method": "draft_model", "model":
DRAFT, "num_speculative_tokens": k}'`): any checkpoint of a family the engine serves, built by the engine's own
loader (load_draft), proposes k tokens greedily, one batched forward a token; the target verifies them
(speculator.py), so the output is the target's own.

Its KV lives in the target's pool: the draft's layers ride as extra full layers of every page
(engine/core/kv_cache.py draft_slots, KVCache.draft_cache), so position i of a sequence is at the sequence's
position i under the same block table. The pool's layout cannot hold layers of another shape as such, but
a page of the draft's is a run of bytes like any other: it takes ceil(draft page / target layer) layers of
the target's shape, viewed with the draft's strides. Pages, prefix caches, the decode cache and the P/D
handoff thus carry the draft's KV with no work of their own, and the memory plan counts it in page_bytes
(the draft's weights, loaded before it measures the device, are out of the free memory it sees; a draft
smaller than the target stays under the target's activation peak, which it measures). Both sides of a P/D
pair must run the same --speculative-config (the handoff's layout check says so otherwise).

The draft's KV mirrors the target's: after each forward (before the prefix cache stores pages, before the
verify, before a PE parks its sequence), `catch_up` runs the draft over every position the target fed that
the draft has not computed with the same token, so a PE's prefill leaves the CE the draft KV of the whole
prompt and a stored or retained page holds both models' KV. After the verify, `after_step` drafts for every
decoding sequence: its last token at position c (= its computed count) gives d1, then d_j at c + j gives
d_{j+1}, one forward for the batch each:

    a step of a sequence of tokens x[0..c], c of them computed, its drafts d1..dm (of the L proposed):
    target fed:    x[c]   d1    d2   ...   dm         (positions c .. c+m; keeps x[c], d1..da, draws b)
    draft chain:   x[c]   d1    ...   d_{L-1}         (written the step before: same tokens, same places)
    catch-up:                                dm       (only when m = L: the one the chain never fed)
    next drafts:   b at c+1+a -> d1', d1' at c+2+a -> d2', ...

So a steady decode step costs k draft forwards of one row per sequence, and a step with prefill chunks
one more (their rows). A CE-side draft prefill would spare the PE that forward and the handoff the draft's
pages, but put the forward between the CE's decode steps; here the PE pays it in its prefill step. Measured
on this CPU (one thread, SmolLM2-135M as the draft): its forward over a 512-token prompt takes 1.15 s, 17
of its 0.066 s one-row steps, a stall every CE-side prefill would cost all the CE's sequences, against
+1/8 of the handoff's bytes for SmolLM2-135M drafting for SmolLM2-1.7B (3 layers of the 1.7B's page shape
hold the 135M's 30, beside its 24).

Tokens: the draft's vocabulary must be the target's (load_draft refuses otherwise); where the configs'
vocab_size differ by padding rows, drafts are drawn from the rows both have and the draft's inputs are
clamped to its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.arch import ModelArch
from engine.config import ForwardConfig
from engine.core.kv_cache import KVCache
from engine.core.scheduler import Scheduler
from engine.core.sequence import SeqStatus, Sequence
from engine.errors import InvalidRequestError, ModelNotFoundError
from engine.layers.context import SeqChunk, forward_context
from engine.layers.numerics import Numerics
from engine.models.decoder import CausalLM

FIELD = "--speculative-config: model"


@dataclass(frozen=True)
class DraftSource:
    """Where the draft comes from and how it loads (the target's dtype, device and load format)."""

    name: str  # a folder, catalogue name or hub id, as EngineConfig.model
    download_dir: str | None
    dtype: torch.dtype
    device: torch.device
    max_positions: int
    is_dummy: bool = False
    seed: int = 0


def load_draft(source: DraftSource, target: ModelArch, target_tokenizer: Any) -> CausalLM:
    """The draft model, loaded; InvalidRequestError (one line, naming the field) when it is missing, of a
    family the engine does not serve, has sliding-window layers, or has another vocabulary than the target."""
    from engine.checkpoints import load_tokenizer, resolve_model
    from engine.checkpoints.store import hub_model_of
    from engine.models.loader import build_model
    from engine.models.registry import arch_from_hf, load_hf_config
    from engine.quantization import fp8_format

    name = source.name
    try:
        is_hub = hub_model_of(name) is not None
        folder: Path = resolve_model(name, None, source.download_dir if is_hub else None)
    except (ModelNotFoundError, OSError) as e:
        raise InvalidRequestError(f"{FIELD} {name!r} not found: {e}") from None
    hf = load_hf_config(folder)
    try:
        arch = arch_from_hf(hf)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{FIELD} {name!r}: {e}") from None
    check_vocabulary(name, arch.vocab_size, load_tokenizer(folder), target.vocab_size, target_tokenizer)
    if arch.has_sliding:
        raise InvalidRequestError(f"{FIELD} {name!r} has sliding-window layers; a draft model needs full attention")
    if not target.has_full:
        raise InvalidRequestError(f"{FIELD}: the target has no full-attention layers, whose pages a draft's KV rides in")
    return build_model(
        arch, hf, folder, source.dtype, source.device, source.max_positions, source.is_dummy, source.seed,
        fp8_format(getattr(hf, "quantization_config", None), None),
    )  # fmt: skip


def check_vocabulary(name: str, vocab_size: int, tokenizer: Any, target_vocab_size: int, target_tokenizer: Any) -> None:
    """Refuses a draft whose tokens mean something else: with tokenizers on both sides, their vocabularies
    (token -> id) must be equal (configs may pad vocab_size differently, as Qwen2.5's sizes do); without,
    the configs' vocab_size must be."""
    if tokenizer is not None and target_tokenizer is not None:
        if tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise InvalidRequestError(
                f"{FIELD} {name!r}: its tokenizer's vocabulary differs from the target's "
                f"({len(tokenizer)} vs {len(target_tokenizer)} tokens)"
            )
    elif (tokenizer is None) != (target_tokenizer is None):
        raise InvalidRequestError(f"{FIELD} {name!r}: one of the draft and the target has no tokenizer to compare")
    elif vocab_size != target_vocab_size:
        raise InvalidRequestError(
            f"{FIELD} {name!r}: vocab_size {vocab_size} differs from the target's {target_vocab_size}"
        )


class DraftDrafter:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        numerics: Numerics,
        config: ForwardConfig,
        scheduler: Scheduler,
        target_vocab_size: int,
    ) -> None:
        """kv: the draft's pool (KVCache.draft_cache of the target's); numerics: the draft's (its own probe)."""
        self.model, self.kv, self.numerics, self.config, self.scheduler = model, kv, numerics, config, scheduler
        self.device = kv.device
        self.max_input_id = model.vocab_size - 1
        self.num_vocab_rows = min(model.vocab_size, target_vocab_size)  # drafts come from the rows both have
        self._drafts: dict[str, list[int]] = {}  # request id -> its drafts for the next step
        # request id -> (position of its first chain row, rows the chain wrote): the draft KV of its last
        # token and of every draft but the last, which the next step's catch-up need not compute again
        self._chained: dict[str, tuple[int, int]] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self._drafts.pop(seq.request_id, [])[:k]

    def forget(self) -> None:
        """Drops every draft and chain record (after a failed forward: the next catch-up computes all it is fed)."""
        self._drafts.clear()
        self._chained.clear()

    @torch.inference_mode()
    def catch_up(self, seqs: list[Sequence], starts: list[int], num_new: list[int]) -> None:
        """After the target's forward, its computed counts updated (drafts not yet verified): the draft over
        every position [start, start + n) the target fed (a chunk, a decode, a verify's last token and
        drafts), except those the chain wrote with the same token. seqs, num_new: the step's batch and
        each one's fed tokens; starts: each one's computed count before the step."""
        ids: list[int] = []
        positions: list[int] = []
        chunks: list[SeqChunk] = []
        for seq, start, n in zip(seqs, starts, num_new):
            if seq.status is not SeqStatus.RUNNING:
                continue
            drafts = seq.draft_token_ids
            fed = seq.token_ids(start, start + n - len(drafts)) + drafts
            skip = 0
            chained = self._chained.pop(seq.request_id, None)
            if chained is not None and chained[0] == start:
                skip = min(len(drafts) + 1, chained[1])  # the chain fed the last token and d1..d_{L-1}
            if skip >= n:
                continue
            chunks.append(SeqChunk(len(ids), n - skip, start + skip, seq.block_ids, seq.state_slot))
            ids += fed[skip:]
            positions += range(start + skip, start + n)
        self._chained.clear()
        if chunks:
            self._forward(chunks, ids, positions, [])

    @torch.inference_mode()
    def after_step(self, seqs: list[Sequence], num_drafts: int) -> None:
        """After the verify: num_drafts greedy drafts for every decoding sequence of the step (0: none), its
        last token first (its draft KV is all there before it: catch_up), then each draft in turn."""
        self._drafts.clear()
        if not num_drafts:
            return
        drafting = [
            s for s in seqs
            if s.status is SeqStatus.RUNNING and s.num_uncomputed == 1 and not s.is_prefill_only
        ]  # fmt: skip
        drafting = [s for s in drafting if self.scheduler.grow_all([s], 0)]
        if not drafting:
            return
        fed = [s.token_ids(s.num_computed, s.num_tokens)[0] for s in drafting]
        drafts: list[list[int]] = [[] for _ in drafting]
        going = list(range(len(drafting)))
        for j in range(num_drafts):
            # row j sits at position c + j (past the sequence's tokens for j >= 1): it needs a page there
            going = [g for g in going if j == 0 or self.scheduler.grow_all([drafting[g]], j)]
            if not going:
                break
            chunks = []
            for n, g in enumerate(going):
                seq = drafting[g]
                chunks.append(SeqChunk(n, 1, seq.num_computed + j, seq.block_ids, seq.state_slot))
            tokens = self._forward(chunks, [fed[g] for g in going], [c.start_pos for c in chunks], list(range(len(going))))
            for g, t in zip(going, tokens):
                drafts[g].append(t)
                fed[g] = t
        for seq, d in zip(drafting, drafts):
            self._drafts[seq.request_id] = d
            self._chained[seq.request_id] = (seq.num_computed, len(d))

    def _forward(self, chunks: list[SeqChunk], ids: list[int], positions: list[int], draw: list[int]) -> list[int]:
        """The draft model over the chunks' rows (its KV written); the greedy tokens of rows `draw`."""
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device).clamp_(max=self.max_input_id)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        with forward_context(chunks, self.kv, self.numerics, config=self.config):
            hidden = self.model(ids_t, pos_t)
            if not draw:
                return []
            logits = self.model.logits(hidden[torch.tensor(draw, device=self.device)])
            return logits[:, : self.num_vocab_rows].argmax(-1).tolist()
