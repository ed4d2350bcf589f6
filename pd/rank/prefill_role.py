"""The PE (prefill) side of a rank: prefill-only requests handed to a CE rank's KV receiver.

    Prefill ─► engine (prefill_only, prefix cache on) ─► parked after the first token
           ─► export ─► KVSender.send(receiver) in the LoopThread (lease: lease_s)
           ─► ack: finish_handoff (the CE owns it now)   | failure or lease over: abort (freed here)
           ─► one PrefillResult to the prefill server

Streaming (TransferConfig.streams_handoffs, --kv-stream): while a long prompt is prefilled in chunks,
after each engine step the pages it completed are gathered (engine.export_pages) and sent as parts of
a streamed handoff (KVSender.stream), opened with the first of them; when the first token is sampled
the export carries only the pages after the parts and the SWA state:

    step: chunk 1 ─► part [f, a)     step: chunk 2 ─► part [a, b)    ...   last chunk ─► export [b, n) + state
           (open on the first)             (while chunk 3 computes)                      ─► ack

The sequence's states (parked, exported, handed off, aborted) are the engine's (engine.handoffs,
engine/handoff/ledger.py): this role keeps only what it needs to answer (timings, the send in flight).
The PE keeps the sequence's KV until the CE acknowledges or the lease runs out. A first token that
already ends the request (EOS, a stop, max_tokens 1) is not handed off: its output goes back in the
PrefillResult. Nothing a PE rank computes streams to the HTTP process; it answers once per request.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import zmq

from engine.faults import raise_if_fatal
from engine.handoff import SequenceExport
from engine.request import RequestOutput
from pd.config import RoleConfig
from pd.messages import AbortRequests, Message, Prefill, PrefillResult
from pd.rank.loop_thread import LoopThread
from pd.rank.role import add_request, rejection
from transfer.auth import load_token
from transfer.errors import ENGINE_ERROR, TRANSPORT, HandoffError
from transfer.header import HandoffHeader, model_fingerprint, stream_plan
from transfer.sender import Ack, KVSender, PagesPart, StreamParts

if TYPE_CHECKING:
    from engine.engine import LLMEngine

log = logging.getLogger(__name__)
ABORTED = "aborted"
REJECTED = "rejected"
EXPORT_FAILED = "the prefill engine failed to export it (its log has why, under the request's id)"


@dataclass
class _Stream:
    """A streamed handoff in flight: the engine thread puts its parts and then the export on `parts`
    (through the loop's call_soon_threadsafe); the loop thread notes each part sent in `sent`."""

    parts: StreamParts
    next_page: int  # the first page not gathered yet
    sent: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, pages) per part sent


@dataclass
class _Job:
    msg: Prefill
    added_s: float
    skip_pages: int = 0  # the receiver holds pages [0, skip_pages): never sent
    ready_s: float = 0.0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    skipped_tokens: int = 0
    sending: concurrent.futures.Future[None] | None = None
    stream: _Stream | None = None


@dataclass
class _Sent:
    request_id: str
    ack: Ack | None
    error: HandoffError | None
    done_s: float = 0.0  # time.monotonic() when the send ended


class PrefillRole:
    def __init__(
        self, engine: LLMEngine, ctx: zmq.Context, send: Callable[[Message], None], config: RoleConfig
    ) -> None:
        self.engine = engine
        self.send = send
        token = load_token(token_file=config.token_file or None)
        self.sender = KVSender(
            token, engine.handoff_layout, model=model_fingerprint(engine.folder), config=config.transfer
        )
        # ipc, nixl: the export is gathered straight into the transport's arena (exported or registered
        # once; hashed on the way)
        self.export_alloc = self.sender.export_allocator
        # ipc: the pages are not gathered at all; the CE copies them out of this engine's pool (exported
        # once), which holds them unchanged until the ack (finish_handoff)
        self.pages_in_place = self.sender.exports_pages_in_place
        self.lt = LoopThread(ctx, "kv-sender")
        self.wake = self.lt.wake
        self.jobs: dict[str, _Job] = {}
        self.counters = {
            "handoffs_sent_total": 0,
            "handoff_failures_total": 0,
            "handoff_bytes_sent_total": 0,
            "handoffs_streamed_total": 0,  # acknowledged handoffs that sent parts during the prefill
            "handoff_pages_streamed_total": 0,  # pages those parts carried
            "handoff_pages_sent_before_prefill_end_total": 0,  # of them, pages gone before the prefill ended
        }
        self.is_streaming = config.transfer.streams_handoffs

    # ---- engine thread --------------------------------------------------------------------------

    def handle(self, msg: Message) -> bool:
        if isinstance(msg, Prefill):
            error = add_request(self.engine, msg, prefill_only=True, seed=msg.seed)
            if error is None:
                # the page of the last prompt token always travels (never an empty page segment)
                bs = self.engine.layout.block_size
                skip = min(msg.receiver_held_tokens // bs, (len(msg.prompt_token_ids) - 1) // bs)
                self.jobs[msg.request_id] = _Job(msg, time.monotonic(), skip)
            else:
                refusal = rejection(msg.request_id, error)  # a 400 for the request's fault, else a generic 500
                code = ENGINE_ERROR if refusal.is_internal else REJECTED
                self.send(PrefillResult(msg.request_id, False, code=code, message=refusal.message))
            return True
        if isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                job = self.jobs.pop(rid, None)
                if job is not None and job.sending is not None:
                    job.sending.cancel()  # closes the connection: the CE drops the partial payload
            return False  # the loop's engine.abort frees the sequence in whatever phase it is
        return False

    def on_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for o in outputs:
            job = self.jobs.get(o.request_id)
            if job is None:
                continue
            if o.is_handoff_ready:
                job.ready_s = time.monotonic()
                job.num_prompt_tokens, job.num_cached_tokens = o.num_prompt_tokens, o.num_cached_tokens
                st = job.stream
                try:
                    # NOTE: the export stays where the KV is (device=None), whatever the transport: on a
                    # GPU, tcp then stages it through pinned buffers in the sender's thread and the
                    # checksum runs on the device, instead of a whole-sequence copy to pageable host
                    # memory on the engine thread (which stalls decode).
                    export = self.engine.export_sequence(
                        o.request_id,
                        device=None,
                        alloc=self.export_alloc if st is None else None,
                        skip_pages=job.skip_pages if st is None else st.next_page,
                        pages_in_place=self.pages_in_place and st is None,
                    )
                    job.skipped_tokens = job.skip_pages * self.engine.layout.block_size
                except Exception as e:
                    raise_if_fatal(e)
                    log.error("export of %r failed", o.request_id, exc_info=e)
                    self._fail(job, HandoffError(ENGINE_ERROR, EXPORT_FAILED))
                    continue
                if st is None:
                    job.sending = self.lt.submit(self._send_one(job.msg, export))
                else:  # the rest of a streamed handoff
                    self.lt.loop.call_soon_threadsafe(st.parts.put, export)
            elif o.is_finished:
                del self.jobs[o.request_id]
                if job.sending is not None:  # a stream opened during the prefill: closed, the CE drops it
                    job.sending.cancel()
                if o.finish_reason == "abort":
                    self.send(PrefillResult(o.request_id, False, code=ABORTED, message=o.error or "aborted"))
                elif o.finish_reason == "error":
                    code = REJECTED if o.is_request_fault else ENGINE_ERROR  # a 400, or a 500
                    self.send(PrefillResult(o.request_id, False, code=code, message=o.error or "engine error"))
                else:  # the first token ended it: no handoff, the output itself goes back
                    self.send(
                        PrefillResult(
                            o.request_id,
                            False,
                            num_prompt_tokens=o.num_prompt_tokens,
                            num_cached_tokens=o.num_cached_tokens,
                            prefill_s=time.monotonic() - job.added_s,
                            output=o,
                        )
                    )
        if self.is_streaming:
            for job in list(self.jobs.values()):
                # NOTE: a request of one token ends here (its output goes back, no handoff): nothing to stream
                if not job.ready_s and job.msg.params.max_tokens > 1:
                    self._stream_pages(job)
        return []

    def _stream_pages(self, job: _Job) -> None:
        """Sends the pages job's prefill has completed since the last call, opening its streamed
        handoff with the first of them."""
        rid, st = job.msg.request_id, job.stream
        first = job.skip_pages if st is None else st.next_page
        try:
            got = self.engine.export_pages(rid, first, self.export_alloc)  # nixl: its registered arena
        except Exception as e:
            raise_if_fatal(e)
            log.error("export of %r's pages failed", rid, exc_info=e)
            self._fail(job, HandoffError(ENGINE_ERROR, EXPORT_FAILED))
            return
        if got is None:
            return
        pages, pages_sum = got
        written = None
        if pages.is_cuda:  # NOTE: the sender's copy out waits for the gather (queued on this stream)
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(pages.device))
        if st is None:
            msg = job.msg
            plan = stream_plan(
                rid, msg.prompt_token_ids, msg.params, msg.seed or 0, self.engine.handoff_layout, self.sender.model, first
            )
            st = job.stream = _Stream(StreamParts(), first)
            job.sending = self.lt.submit(self._stream_one(msg, plan, st))
        st.next_page = first + pages.shape[0]
        self.lt.loop.call_soon_threadsafe(st.parts.put, PagesPart(first, pages, pages_sum, written))

    def tick(self) -> None:
        for sent in self.lt.drain():
            job = self.jobs.pop(sent.request_id, None)
            if job is None:
                continue  # aborted meanwhile: already freed
            if sent.ack is not None:
                self.engine.finish_handoff(sent.request_id)
                self.counters["handoffs_sent_total"] += 1
                self.counters["handoff_bytes_sent_total"] += sent.ack.payload_bytes
                early = sum(n for t, n in job.stream.sent if t <= job.ready_s) if job.stream else 0
                if sent.ack.num_streamed_pages:
                    self.counters["handoffs_streamed_total"] += 1
                    self.counters["handoff_pages_streamed_total"] += sent.ack.num_streamed_pages
                    self.counters["handoff_pages_sent_before_prefill_end_total"] += early
                self.send(
                    PrefillResult(
                        sent.request_id,
                        True,
                        num_prompt_tokens=job.num_prompt_tokens,
                        num_cached_tokens=job.num_cached_tokens,
                        prefill_s=job.ready_s - job.added_s,
                        transfer_s=sent.ack.elapsed_s,
                        payload_bytes=sent.ack.payload_bytes,
                        transport=sent.ack.transport,
                        skipped_tokens=job.skipped_tokens,
                        transfer_after_prefill_s=sent.done_s - job.ready_s,
                        streamed_pages=sent.ack.num_streamed_pages,
                        early_pages=early,
                    )
                )
            else:
                assert sent.error is not None
                self.jobs[sent.request_id] = job
                self._fail(job, sent.error)

    def _fail(self, job: _Job, error: HandoffError) -> None:
        rid = job.msg.request_id
        log.warning("handoff of %r to %s failed: %s", rid, job.msg.receiver, error)
        self.jobs.pop(rid, None)
        if job.sending is not None:  # a stream still open (its prefill's export failed)
            job.sending.cancel()
        self.engine.abort(rid)  # its final "abort" output is dropped: the job is gone
        self.counters["handoff_failures_total"] += 1
        self.send(
            PrefillResult(
                rid,
                False,
                num_prompt_tokens=job.num_prompt_tokens,
                num_cached_tokens=job.num_cached_tokens,
                prefill_s=job.ready_s - job.added_s if job.ready_s else 0.0,
                transport=self.sender.transport.name,
                code=error.code,
                message=error.message,
            )
        )

    def poll_timeout_s(self) -> float:
        return 1.0

    def stats(self) -> dict[str, int]:
        num_streaming = sum(1 for job in self.jobs.values() if job.stream is not None)
        return {
            **self.counters,
            "num_handoffs_inflight": self.engine.handoffs.num_exported,
            "num_handoffs_streaming": num_streaming,  # streamed handoffs opened, not acknowledged yet
        }

    def close(self) -> None:
        for job in self.jobs.values():
            if job.sending is not None:
                job.sending.cancel()
        self.sender.close()
        self.lt.stop()

    # ---- loop thread ----------------------------------------------------------------------------

    async def _send_one(self, msg: Prefill, export: SequenceExport) -> None:
        await self._post_sent(msg.request_id, self.sender.send(msg.receiver, export, timeout_s=msg.lease_s))

    async def _stream_one(self, msg: Prefill, plan: HandoffHeader, st: _Stream) -> None:
        def on_part(num_pages: int) -> None:
            st.sent.append((time.monotonic(), num_pages))

        sending = self.sender.stream(msg.receiver, plan, st.parts, timeout_s=msg.lease_s, on_part=on_part)
        await self._post_sent(msg.request_id, sending)

    async def _post_sent(self, request_id: str, sending: Awaitable[Ack]) -> None:
        """Awaits a handoff and posts its end to the loop thread: the ack, or the error (any other
        exception as a HandoffError(TRANSPORT))."""
        try:
            ack = await sending
        except HandoffError as e:
            self.lt.post(_Sent(request_id, None, e))
        except Exception as e:
            self.lt.post(_Sent(request_id, None, HandoffError(TRANSPORT, repr(e))))
        else:
            self.lt.post(_Sent(request_id, ack, None, time.monotonic()))
