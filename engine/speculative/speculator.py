"""Speculative decoding's bookkeeping: who drafts how many tokens this step, the lossless acceptance
rule, and the rollback of what a rejected draft wrote.

One step of a decoding sequence with T tokens (T - 1 computed) and drafts d1..dm:

    chunk fed:   x[T-1]  d1   d2  ...  dm          positions T-1 .. T-1+m (one chunk, one forward)
    logit rows:  row 0   row 1 ...     row m       row j is the target's distribution of token T+j,
                                                   given x[T-1] and d1..dj as its inputs

Acceptance: the target draws token T+j from row j exactly as a plain step would (same processed
logits: penalties and grammar see the output so far; same seed and output index), and the draft's
next token is kept only when it is that very token. So the output is, token for token, the target's
own: greedy and seeded sampling alike give what they give without speculation. For a proposer whose
draft is a point (prompt lookup, a greedy MTP or draft model: q(d) = 1) this is rejection sampling:
d is accepted with probability p(d) = min(1, p(d)/q(d)), and on a rejection the token drawn is
distributed as p without d, renormalized, which is (p - q)+ normalized; every sequence then gains the
accepted drafts plus one token of the target's.

Rollback after a draws: the sequence's computed count covers x[T-1] and d1..da; the pages past its
tokens + 1 go back to the pool; the sliding-window rings, where a draft's K/V overwrote the entry of
a position still inside the window, get their saved entries back (pages need none: a position's
slot is written again before anything reads it)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import SpeculativeConfig
from engine.core.kv_cache import KVCache
from engine.core.scheduler import Scheduler
from engine.core.sequence import SeqStatus, Sequence
from engine.faults import raise_if_fatal
from engine.speculative.draft_model import DraftDrafter
from engine.speculative.mtp import MtpDrafter
from engine.speculative.ngram import Haystack
from engine.speculative.switch import SpeculationSwitch

log = logging.getLogger(__name__)

# draws row j of each given sequence and appends its token (ending it where it ends); returns the sequences
# that took one (a row that failed ended its sequence with an error)
DrawAndAppend = Callable[[list[Sequence], list[int]], list[Sequence]]


@dataclass
class _Rings:
    """A sequence's ring entries its drafts overwrite (saved before the forward)."""

    slot: int
    indices: torch.Tensor  # [m] ring index of draft position T + j
    saved: torch.Tensor  # [num_swa_layers, 2, m, kv_heads, head_dim]


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        scheduler: Scheduler,
        kv: KVCache,
        max_model_len: int,
        mtp: MtpDrafter | None = None,
        draft_model: DraftDrafter | None = None,
    ) -> None:
        """mtp, draft_model: the drafter of method mtp or draft_model (its drafts made after each step); neither:
        prompt lookup."""
        self.config = config
        self.mtp = mtp
        self.draft_model = draft_model
        self.scheduler = scheduler
        self.kv = kv
        self.max_model_len = max_model_len
        # a draft longer than the window would overwrite its own ring entries
        window = kv.layout.window if kv.layout.num_swa_layers else 0
        self.max_drafts = (
            min(config.num_speculative_tokens, window - 1) if window else config.num_speculative_tokens
        )
        self._rings: dict[str, _Rings] = {}
        self._haystacks: dict[str, tuple[Sequence, Haystack]] = {}  # prompt lookup's, per running sequence
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens
        # where drafting does not pay for the batch, it stops (engine/speculative/switch.py; "auto_disable")
        self.switch = SpeculationSwitch() if config.auto_disable else None

    def _speculates(self, num_running: int) -> bool:
        """Whether the next step drafts: not above disable_by_batch_size, else as the switch measures."""
        cap = self.config.disable_by_batch_size
        if cap is not None and num_running > cap:
            return False
        return self.switch is None or self.switch.choose(num_running)

    # ---- before the forward -------------------------------------------------------------------

    def draft(self, seqs: list[Sequence], num_new: list[int], budget_tokens: int) -> list[int]:
        """Drafts for the decoding sequences of a scheduled batch (each sequence's draft_token_ids), within
        budget_tokens more tokens this step and the pages the pool can give; returns the batch's new token
        counts (1 + m for a sequence with m drafts)."""
        num_running = len(self.scheduler.running)
        chosen = None if self.switch is None else self.switch.chosen()  # the previous step's after_step chose
        cap = self.config.disable_by_batch_size
        drafts = (chosen if chosen is not None else self._speculates(num_running)) and (cap is None or num_running <= cap)
        if self.switch is not None:
            self.switch.start(all(n == 1 and s.output_token_ids for s, n in zip(seqs, num_new)))
        if not drafts:
            return num_new
        out = list(num_new)
        if len(self._haystacks) > 2 * len(self.scheduler.running) + 16:  # ended sequences' go
            running = {s.request_id for s in self.scheduler.running}
            self._haystacks = {rid: e for rid, e in self._haystacks.items() if rid in running}
        for i, (seq, n) in enumerate(zip(seqs, num_new)):
            if budget_tokens < 1:
                break
            if n != 1 or seq.num_uncomputed != 1 or not seq.output_token_ids or seq.is_prefill_only:
                continue  # a prefill, or a PE's sequence that parks after its first token
            room = min(
                self.max_drafts,
                budget_tokens,
                seq.params.max_tokens - len(seq.output_token_ids) - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            if room < 1:
                continue
            draft = self._propose(seq, room)
            if (
                draft and seq.matcher is not None
            ):  # a token the grammar forbids is rejected before the forward
                draft = draft[: seq.matcher.num_valid(draft)]
            if not draft or not self.scheduler.grow_all([seq], len(draft)):
                continue
            seq.draft_token_ids = draft
            out[i] = 1 + len(draft)
            budget_tokens -= len(draft)
            self._save_rings(seq)
        return out

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        if self.mtp is not None:
            return self.mtp.propose(seq, k)
        if self.draft_model is not None:
            return self.draft_model.propose(seq, k)
        c = self.config
        entry = self._haystacks.get(seq.request_id)
        if entry is None or entry[0] is not seq:
            entry = self._haystacks[seq.request_id] = (seq, Haystack())
        hay = entry[1]
        have, p = len(hay.tokens), seq.num_prompt_tokens
        if have < p:
            hay.extend(seq.prompt_token_ids[have:])
            have = p
        hay.extend(seq.output_token_ids[have - p :])
        return hay.draft(c.prompt_lookup_min, c.prompt_lookup_max, k)

    def _save_rings(self, seq: Sequence) -> None:
        if not self.kv.layout.num_swa_layers or seq.state_slot < 0:
            return
        m, window = len(seq.draft_token_ids), self.kv.layout.window
        first = seq.num_tokens  # the position of d1
        idx = torch.tensor([(first + j) % window for j in range(m)], dtype=torch.long, device=self.kv.device)
        saved = self.kv.swa[seq.state_slot].index_select(2, idx)
        self._rings[seq.request_id] = _Rings(seq.state_slot, idx, saved)

    # ---- after the forward --------------------------------------------------------------------

    def complete(
        self, seqs: list[Sequence], sampled: list[int], num_rows: list[int], draw_and_append: DrawAndAppend
    ) -> list[Sequence]:
        """A step's sampling with speculation: seqs[i] for i in sampled has 1 + len(its drafts) logit rows,
        in that order (num_rows: every sampled sequence's, live or not); the live ones are verified (verify),
        the others' drafts dropped."""
        live, rows, at = [], [], 0
        for i, n in zip(sampled, num_rows):
            if seqs[i].status is SeqStatus.RUNNING:
                live.append(seqs[i])
                rows.append(at)
            at += n
        self.drop([seqs[i] for i in sampled if seqs[i].status is not SeqStatus.RUNNING])
        return self.verify(live, rows, draw_and_append)

    def verify(self, seqs: list[Sequence], rows: list[int], draw_and_append: DrawAndAppend) -> list[Sequence]:
        """seqs: the batch's sampled sequences, seqs[i]'s logit rows from rows[i] (1 + its drafts; its
        computed count already covers its last token). Draws position by position, a sequence going on
        while its drafts are the tokens drawn, then rolls back what its rejected drafts wrote; returns the
        sequences that got at least one token."""
        emitted: dict[int, Sequence] = {}
        accepted = [0] * len(seqs)
        going = list(range(len(seqs)))
        j = 0
        while going:
            took = {id(s) for s in draw_and_append([seqs[i] for i in going], [rows[i] + j for i in going])}
            if self.switch is not None:
                self.switch.emitted(len(took))
            nxt = []
            for i in going:
                seq = seqs[i]
                if id(seq) not in took:
                    continue
                emitted.setdefault(i, seq)
                draft = seq.draft_token_ids
                if j < len(draft) and seq.output_token_ids[-1] == draft[j]:
                    accepted[i] += 1
                    if seq.status is SeqStatus.RUNNING:
                        seq.num_computed += 1  # its K/V (this forward's) is now the sequence's
                        nxt.append(i)
            going = nxt
            j += 1
        for seq, n in zip(seqs, accepted):
            self._settle(seq, n)
        return [emitted[i] for i in sorted(emitted)]

    def _settle(self, seq: Sequence, accepted: int) -> None:
        """Counts a sequence's draft and rolls back what its rejected tail wrote."""
        draft = seq.draft_token_ids
        rings = self._rings.pop(seq.request_id, None)
        if not draft:
            return
        seq.draft_token_ids = []
        self.num_drafts += 1
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_position[j] += 1
        if seq.status is not SeqStatus.RUNNING:
            return  # finished: its memory is freed already
        keep = self.scheduler.blocks_for(seq.num_tokens + 1)
        if len(seq.block_ids) > keep:
            self.scheduler.blocks.free(seq.block_ids[keep:])
            del seq.block_ids[keep:]
        if rings is not None and accepted < len(draft):
            self.kv.swa[rings.slot].index_copy_(2, rings.indices[accepted:], rings.saved[:, :, accepted:])

    def after_forward(self, seqs: list[Sequence], starts: list[int], num_new: list[int]) -> None:
        """After a step's forward, its computed counts updated, before anything reads its pages (the prefix
        cache's store, the verify, a park): the draft model's catch-up (draft_model; nothing for the others).
        starts: each sequence's computed count before the step; num_new: the tokens it fed."""
        draft = self.draft_model
        if draft is not None:
            self._drafting(lambda: draft.catch_up(seqs, starts, num_new))

    def after_step(
        self, seqs: list[Sequence], starts: list[int], hidden: torch.Tensor | None, first_rows: dict[int, int]
    ) -> None:
        """After a step's tokens are appended (its drafts settled): the MTP drafter's catch-up and drafts for
        the next step (mtp), the draft model's drafts (draft_model; nothing for prompt lookup, which drafts
        from the tokens alone). starts: each sequence's computed count before the step; hidden, first_rows:
        the step's forward's (the runner's)."""
        num_running = len(self.scheduler.running)
        if not num_running and self.switch is not None:
            self.switch.idle()
        num_drafts = self.max_drafts if num_running and self._speculates(num_running) else 0
        draft, mtp = self.draft_model, self.mtp
        if draft is not None:
            self._drafting(lambda: draft.after_step(seqs, num_drafts))
        if mtp is not None and hidden is not None:
            self._drafting(lambda: mtp.after_step(seqs, starts, hidden, first_rows, num_drafts))

    def _drafting(self, work: Callable[[], None]) -> None:
        """A drafter's forward. Its failure (not a fatal one) costs drafts, never tokens: logged, and the
        sequences go on without drafts until the drafter's next step (its KV of this step's positions may be
        stale: worse drafts, which the verify rejects)."""
        try:
            work()
        except Exception as e:
            raise_if_fatal(e)
            log.error("the drafter failed; the step's sequences go on without its drafts", exc_info=e)
            for drafter in (self.draft_model, self.mtp):
                if drafter is not None:
                    drafter.forget()

    def drop(self, seqs: list[Sequence]) -> None:
        """A batch that never reached verify (its forward failed): drafts forgotten, rings restored."""
        for seq in seqs:
            rings = self._rings.pop(seq.request_id, None)
            if rings is not None and seq.status is SeqStatus.RUNNING:
                self.kv.swa[rings.slot].index_copy_(2, rings.indices, rings.saved)
            seq.draft_token_ids = []
