"""LLMEngine's P/D facade: a sequence's export on the PE and its import on the CE, the pages of a streamed
export, and where an import may land in place. The memory work is engine/handoff/pages.py's (HandoffIO), the
phases are the ledger's (engine/handoff/ledger.py); the engine hears of a sequence imported or handed off
through two callbacks, for its detokenizers and outputs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.sequence import Sequence
from engine.handoff import Alloc, PoolPages, SequenceExport
from engine.handoff.ledger import HandoffLedger
from engine.handoff.pages import HandoffIO
from engine.request import SamplingParams


class HandoffFacade:
    def __init__(
        self,
        ledger: HandoffLedger,
        io: HandoffIO,
        validate: Callable[[str, list[int], SamplingParams], None],
        on_imported: Callable[[Sequence, SequenceExport], None],
        on_handed_off: Callable[[str], None],
    ) -> None:
        """validate: the engine's check of a request (an import is one); on_imported(seq, exp): a sequence
        admitted into decode; on_handed_off(request_id): an exported sequence now lives elsewhere."""
        self.ledger = ledger
        self.io = io
        self.validate = validate
        self.on_imported = on_imported
        self.on_handed_off = on_handed_off

    def export_sequence(
        self,
        request_id: str,
        device: str | torch.device | None = "cpu",
        alloc: Alloc | None = None,
        skip_pages: int = 0,
        pages_in_place: bool = False,
    ) -> SequenceExport:
        """A prefilled sequence's state (every token but the last is in the cache). device=None
        keeps the gathered pages on the engine's device (NCCL/IPC transports send from there).
        alloc(shape, dtype, device): where the gathered tensors go (e.g. a slice of the ipc
        transport's exported arena), or None for new memory; used only with device=None and
        without --tp (a group's merged heads are new memory).
        skip_pages: pages the receiver holds already (its reservation's held tokens / block_size):
        only pages [skip_pages, n_pages) are gathered (SequenceExport.first_page).
        pages_in_place: with device=None and without --tp, the pages are not gathered: the export names
        them in the pool (PoolPages; a transport that reads them there, ipc), held unchanged until
        finish_handoff or an abort."""
        return self.io.export(request_id, device, alloc, skip_pages, pages_in_place)

    def in_place_target(
        self, request_id: str, first_page: int, num_pages: int, hold_s: float
    ) -> tuple[PoolPages, torch.Tensor | None] | None:
        """Any thread: where a receiving handoff may land in place, the reservation's own pages and SWA
        slot, or None (engine/handoff/pages.py's in_place_target)."""
        return self.io.in_place_target(request_id, first_page, num_pages, hold_s)

    def export_pages(
        self, request_id: str, first_page: int, alloc: Alloc | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A sequence's pages from first_page on that its prefill has completed, while later chunks are
        still to run (a streamed handoff's parts): (pages, their checksum sum or None), or None when no
        new page is complete. Pages stay on the engine's device (gathered into alloc's memory where it
        gives some, as for export_sequence); the page of the last prompt token is left to export_sequence."""
        return self.io.export_pages(request_id, first_page, alloc)

    def finish_handoff(self, request_id: str) -> None:
        """The exported sequence now lives elsewhere: free it here without a further output."""
        if self.ledger.hand_off(request_id) is not None:
            self.on_handed_off(request_id)

    def import_sequence(self, exp: SequenceExport) -> None:
        """Admits an exported sequence straight into decode, into the memory of its reservation
        (the ledger) if it has one. Raises if it does not match this engine or does not fit.

        exp.first_page > 0: pages [0, first_page) are not in exp; the reservation must hold them (its
        decode cache hit, tokens verified) and exp.pages are written after them. A full handoff
        (first_page 0) into a reservation that held pages releases those (they stay cached) and
        writes every page into fresh ones: an indexed page is never overwritten."""
        self.validate(exp.request_id, exp.prompt_token_ids, exp.params)
        self.on_imported(self.io.import_(exp), exp)
