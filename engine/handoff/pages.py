"""A sequence's memory across the P/D handoff, beside the ledger that owns its phases
(engine/handoff/ledger.py):

    export   PE: a prefilled sequence's pages, SWA state and sampling state gathered into a
             SequenceExport (engine/handoff/__init__.py); the ledger marks it EXPORTED
    import   CE: an export checked against this engine's layout, made a decoding sequence in the
             memory of its reservation (or fresh memory), its pages and state written there

LLMEngine's export_sequence / import_sequence are the callers' door; the engine keeps what an import
means for the request (its checks against the model, its detokenizer, an output if it has ended).

In a tensor-parallel group (rank 0 calls these) the pages and state move through engine/handoff/kv_shards.py:
an export carries, and an import expects, every KV head of the model (`layout`), whatever the group's size."""

from __future__ import annotations

import time

import torch

from engine.core.grammar import GrammarCompiler
from engine.core.kv_cache import KVCache
from engine.core.prompt_logprobs import PromptLogprobsCollector
from engine.core.scheduler import Scheduler
from engine.core.sequence import SeqStatus, Sequence
from engine.errors import InvalidRequestError
from engine.handoff import Alloc, PoolPages, SequenceExport
from engine.handoff.kv_shards import KVShards
from engine.handoff.ledger import HandoffLedger


class HandoffIO:
    """Export and import of a sequence's memory in this engine's KV cache (kv), or in its tensor-parallel
    group's (shards: kv is then rank 0's share of the heads)."""

    def __init__(
        self,
        ledger: HandoffLedger,
        scheduler: Scheduler,
        kv: KVCache,
        grammars: GrammarCompiler,
        *,
        retains_at_end: bool,
        shards: KVShards | None = None,
    ) -> None:
        self.ledger = ledger
        self.scheduler = scheduler
        self.kv = kv
        self.shards = shards
        self.layout = shards.layout if shards is not None else kv.layout  # what a handoff carries
        self.grammars = grammars
        self.retains_at_end = retains_at_end  # a CE with a decode cache: an import's pages stay cached

    def export(
        self,
        request_id: str,
        device: str | torch.device | None,
        alloc: Alloc | None,
        skip_pages: int,
        pages_in_place: bool = False,
    ) -> SequenceExport:
        """LLMEngine.export_sequence: a parked or running sequence between steps, every token but the
        last computed; its memory stays held (EXPORTED) until the ledger hands it off or aborts it.
        pages_in_place (with device=None, without --tp): the export's pages are the sequence's own pages
        in the pool (PoolPages, no gather), which stay unchanged while it is held."""
        seq = self.ledger.parked(request_id) or self.scheduler.find(request_id)
        if seq is None or seq.status not in (SeqStatus.RUNNING, SeqStatus.PARKED) or seq.num_uncomputed != 1:
            raise InvalidRequestError(f"request {request_id!r} is not a prefilled sequence between steps")
        kv = self.kv
        n_pages = kv.layout.num_pages(seq.num_computed)
        if not 0 <= skip_pages * kv.layout.block_size <= seq.num_computed:
            raise InvalidRequestError(f"cannot skip {skip_pages} pages of {seq.num_computed} computed tokens")
        block_ids = seq.block_ids[skip_pages:n_pages]
        pages: torch.Tensor | PoolPages
        pages_sum: torch.Tensor | None = None
        if self.shards is not None:  # the group's heads, merged on rank 0 (alloc's memory is not used)
            pages, state = self.shards.read(block_ids, seq.state_slot)
        else:
            if pages_in_place and device is None and block_ids:
                pages, pages_sum = kv.pages_in_place(block_ids, with_checksum=True)
            else:
                out = None
                if alloc is not None and device is None and block_ids:
                    out = alloc((len(block_ids), *kv.pages.shape[1:]), kv.pages.dtype, kv.device)
                # on CUDA the gather also hashes the pages (the handoff's checksum, at no extra pass)
                pages, pages_sum = kv.read_pages(block_ids, out=out, with_checksum=True)
            state = kv.read_state(seq.state_slot) if seq.state_slot >= 0 else None
        if state is not None and alloc is not None and device is None and self.shards is None:
            st = alloc(tuple(state.shape), state.dtype, state.device)
            state = st.copy_(state) if st is not None else state
        if device is not None:
            assert isinstance(pages, torch.Tensor)  # in place only with device=None
            pages = pages.to(device)
            state = state.to(device) if state is not None else None
        self.ledger.export(request_id)
        return SequenceExport(
            request_id, list(seq.prompt_token_ids), list(seq.output_token_ids), seq.num_computed,
            seq.params, seq.seed, pages, state, list(seq.output_logprobs), seq.num_cached_prompt, pages_sum,
            first_page=skip_pages,
            prompt_logprobs=seq.prompt_logprobs.result() if seq.prompt_logprobs is not None else None,
        )

    def export_pages(
        self, request_id: str, first_page: int, alloc: Alloc | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """LLMEngine.export_pages: copies of a prefilling sequence's computed pages from first_page on,
        short of the page of its last prompt token (that one, and everything after, goes with export()),
        and their checksum sum where the gather computes it (CUDA); None when there are none yet. alloc:
        where to gather them (a transport's registered memory), as for export.

        NOTE: a page is copied only once every position of it is computed: no later chunk writes it. On
        CUDA the gather is queued on the engine's stream behind the forwards that wrote the pages; a
        reader on another stream waits on an event recorded after this call."""
        seq = self.ledger.parked(request_id) or self.scheduler.find(request_id)
        if seq is None:
            raise InvalidRequestError(f"request {request_id!r} is not a sequence of this engine")
        bs = self.kv.layout.block_size
        last = min(seq.num_computed, seq.num_prompt_tokens - 1) // bs
        if last <= first_page or not self.layout.has_pages:
            return None
        block_ids = seq.block_ids[first_page:last]
        if self.shards is not None:  # the group's heads, merged on rank 0
            return self.shards.read(block_ids, -1)[0], None
        kv = self.kv
        out = alloc((len(block_ids), *kv.pages.shape[1:]), kv.pages.dtype, kv.device) if alloc is not None else None
        return kv.read_pages(block_ids, out=out, with_checksum=True)

    def in_place_target(
        self, request_id: str, first_page: int, num_pages: int, hold_s: float
    ) -> tuple[PoolPages, torch.Tensor | None] | None:
        """Where a receiving handoff's pages [first_page, num_pages) and SWA state may be written in place
        (any thread): the reservation's own pages of this engine's pool and its state slot, or None
        (a tensor-parallel group re-shards what it receives; a full handoff over held pages writes fresh
        ones; not receiving). hold_s: how long the sender may go on writing after a failure."""
        if self.shards is not None:
            return None
        got = self.ledger.land_in_place(request_id, first_page, num_pages, hold_s)
        if got is None:
            return None
        block_ids, slot = got
        return PoolPages(self.kv.pages, block_ids), self.kv.swa[slot] if slot >= 0 else None

    def _landed(self, exp: SequenceExport) -> tuple[tuple[int, ...], int]:
        """The blocks and slot exp's pages and state were received into in place (in_place_target's);
        raises InvalidRequestError where they are not this engine's pool."""
        pages, kv = exp.pages, self.kv
        assert isinstance(pages, PoolPages)
        slot = -1
        if exp.state is not None:
            offset = exp.state.data_ptr() - kv.swa.data_ptr()
            slot_bytes = kv.swa[0].numel() * kv.swa.element_size() if kv.swa.numel() else 0
            if not slot_bytes or offset % slot_bytes or not 0 <= offset // slot_bytes < kv.swa.shape[0]:
                raise InvalidRequestError("a handoff's state received in place lies outside this engine's pool")
            slot = offset // slot_bytes
        if pages.pool is not kv.pages or self.shards is not None:
            raise InvalidRequestError("a handoff's pages received in place lie outside this engine's pool")
        return pages.block_ids, slot

    def import_(self, exp: SequenceExport) -> Sequence:
        """The imported sequence, decoding in memory the ledger gave it, its pages and state written.
        Raises, holding nothing, if exp does not match this engine's layout or the write fails
        (LLMEngine.import_sequence: the full handoff and first_page rules)."""
        num_tokens = len(exp.prompt_token_ids) + len(exp.output_token_ids)
        if exp.num_computed != num_tokens - 1:
            raise InvalidRequestError("an imported sequence must have every token but the last computed")
        kv, lo = self.kv, self.layout
        n_pages = lo.num_pages(exp.num_computed)
        if not 0 <= exp.first_page <= n_pages:
            raise InvalidRequestError(f"first page {exp.first_page} out of [0, {n_pages}]")
        want_pages = lo.page_shape(n_pages - exp.first_page)
        if tuple(exp.pages.shape) != want_pages:
            raise InvalidRequestError(f"page tensor shape {tuple(exp.pages.shape)} != expected {want_pages}")
        if lo.has_state:
            want_state = lo.state_shape()
            if exp.state is None or tuple(exp.state.shape) != want_state:
                raise InvalidRequestError(f"SWA state shape does not match {want_state}")
        seq = Sequence(exp.request_id, list(exp.prompt_token_ids), exp.params, exp.seed, time.monotonic())
        seq.output_token_ids = list(exp.output_token_ids)
        seq.output_logprobs = list(exp.output_logprobs)
        if exp.params.prompt_logprobs is not None:  # the exporter's, reported with the first output here
            plp, want = exp.prompt_logprobs, (len(exp.prompt_token_ids) - 1, exp.params.prompt_logprobs)
            if plp is None or (plp.num_positions, plp.num_top) != want:
                raise InvalidRequestError("the handoff lacks the prompt logprobs its parameters ask for")
            seq.prompt_logprobs = PromptLogprobsCollector.of(plp)
        seq.num_computed = exp.num_computed
        seq.num_cached_prompt = exp.num_cached_tokens
        seq.is_retained_at_end = self.retains_at_end
        if exp.params.structured is not None:  # the grammar's state: the handed-over tokens, replayed
            seq.matcher = self.grammars.matcher(exp.params.structured, list(exp.output_token_ids))
        if isinstance(exp.pages, PoolPages):  # received in place: the pages and state are written
            self.ledger.import_(seq, exp.first_page, self._landed(exp))
            return seq
        self.ledger.import_(seq, exp.first_page)
        try:
            if self.shards is not None:
                self.shards.write(seq.block_ids[exp.first_page : n_pages], seq.state_slot, exp.pages, exp.state)
            else:
                if n_pages > exp.first_page:
                    kv.write_pages(seq.block_ids[exp.first_page : n_pages], exp.pages)
                if exp.state is not None:
                    kv.write_state(seq.state_slot, exp.state.to(kv.device, lo.dtype))
        except BaseException:
            self.ledger.abort(seq.request_id)
            self.scheduler.finish(seq, "abort")
            raise
        return seq
