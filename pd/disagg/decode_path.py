"""The CE coordinator's path for one engine request in P/D mode (what Generation runs per choice).

    reserve on the CE rank ──► POST /prefill to the PE ──► the CE rank streams the decode
    (waits while the CE is     (token ids, sampling,        (its first output re-reports the
     full; 429 past the queue   request id, the rank's       PE's first token; cached tokens
     limit, 503 past the        KV receiver)                 are the PE's)
     queue timeout)

Every failure before the first token reaches the client as an ApiError (PhaseError event), never as
a hang: the CE's reservation is dropped (AbortRequests) and, with --fallback-local-prefill, a failed
or unreachable PE makes the CE prefill the request itself. Cancelling the task (the client went away)
cancels the POST, so the PE aborts too; Generation aborts the CE side.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from engine.request import RequestOutput, SamplingParams
from pd.config import ServerConfig
from pd.disagg.metrics import ClusterMetrics
from pd.disagg.prefill_client import PrefillFailed
from pd.disagg.prefill_pool import PrefillPool
from pd.errors import ApiError, bad_request, internal, rejected
from pd.messages import PrefillBody, PrefillReply, RequestRejected, Reserved
from pd.rank.client import RankClient, RankDown, RankEvent
from transfer.errors import MESSAGE_CHARS, printable

log = logging.getLogger(__name__)
RESERVATION_MARGIN_S = 5.0  # a reservation outlives the coordinator's wait for /prefill by this much


@dataclass(frozen=True)
class PhaseError:
    """The request failed before its decode began; `error` is what the client gets."""

    error: ApiError


class PDRequest(Protocol):
    """One engine request (generation.SubRequest)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def use_prefix_cache(self) -> bool: ...


@dataclass
class _Progress:
    """What the CE rank said while the prefill ran: events held back for after the PE's answer, and
    whether decode outputs were passed on."""

    held: list[tuple[str, RankEvent]] = field(default_factory=list)
    is_decoding: bool = False

    @property
    def began(self) -> bool:
        """The CE rank has spoken: it imported the KV (it decodes) or ended the request."""
        return self.is_decoding or bool(self.held)


def _may_fail_over(e: PrefillFailed) -> bool:
    """Whether a failed prefill may go to another PE: no answer (refused, reset, the PE died, timed out)
    or a 5xx other than 502. A 502 is a handoff that began and failed (fail as before); a 4xx is the
    request's own fault; a 200 that did not decode may have handed the KV off. The CE imports only KV
    it verified, and a reservation whose handoff broke off is reserved again, so a second PE's handoff
    lands in it; one the CE imported already shows as decoding (progress.began)."""
    return e.status is None or (e.status >= 500 and e.status != 502)


def _retrieved(task: asyncio.Task[PrefillReply]) -> None:
    """Marks a finished prefill's exception as read: a request cancelled (the client went away) just as its
    prefill failed leaves nobody to read it, and asyncio would log "Task exception was never retrieved"."""
    if not task.cancelled():
        task.exception()


def _prefill_error(e: PrefillFailed) -> ApiError:
    msg = f"prefill failed: {e.message}"
    if e.status is None:
        if e.code == "prefill_timeout":
            return ApiError(504, msg, type="server_error", code="prefill_timeout")
        return ApiError(503, msg, type="server_error", code="prefill_unavailable")
    if e.status == 400:
        return bad_request(e.message, code=e.code)
    if e.status == 413:
        return ApiError(413, e.message, code=e.code)
    return ApiError(
        502 if e.status < 500 or e.status == 502 else e.status, msg, type="server_error", code=e.code
    )


class DecodePath:
    def __init__(self, cfg: ServerConfig, pool: PrefillPool, metrics: ClusterMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.num_waiting = 0  # reservations asked for, not granted yet
        self.num_held = 0  # reservations granted, handoff not arrived yet

    def _gauge(self) -> None:
        self.metrics.reservations.labels("waiting").set(self.num_waiting)
        self.metrics.reservations.labels("held").set(self.num_held)

    async def run(
        self,
        rank: RankClient,
        req: PDRequest,
        out: asyncio.Queue[tuple[str, object]],
        arrival_s: float,
        key: str | None = None,
    ) -> None:
        """Runs one request to its end, putting its events on `out` as Generation expects them. key:
        the conversation's (PE choice: pd/disagg/prefill_pool.py)."""
        rid = req.request_id
        events: asyncio.Queue[tuple[str, RankEvent]] = asyncio.Queue()
        try:
            held_tokens = await self._reserve(rank, req, events)
            self.metrics.observe_phase("queue", time.monotonic() - arrival_s)
            left = len(req.prompt_token_ids) - held_tokens
            if self.cfg.local_prefill_max_tokens and left <= self.cfg.local_prefill_max_tokens:
                # little left after what this CE holds: its engine computes the rest from its own pages
                self.metrics.local_prefills.labels("short").inc()
                await rank.submit(rid, req.prompt_token_ids, req.params, events, req.use_prefix_cache)
                await self._forward(events, out, None, held=[])
                return
            self.num_held += 1
            self._gauge()
            failure: PrefillFailed | None = None
            progress = _Progress()
            prefill = asyncio.create_task(self._prefill(rank, req, key, progress, held_tokens))
            prefill.add_done_callback(_retrieved)  # its failure is read below, unless this task is cancelled
            try:
                await self._while_prefilling(prefill, events, out, progress)
                res = prefill.result()
            except PrefillFailed as e:
                failure = e
            finally:
                if not prefill.done():  # this task was cancelled (the client went away): so is the POST
                    prefill.cancel()
                held, is_decoding = progress.held, progress.is_decoding
                self.num_held -= 1
                self._gauge()
            if failure is not None and is_decoding:
                # NOTE: the CE only decodes from KV it verified, so its tokens stand whatever the PE says.
                log.warning(
                    "prefill of %s reported %s after the CE began decoding it",
                    rid,
                    printable(failure, MESSAGE_CHARS),
                )
                self.metrics.handoff_failures.labels(self.cfg.transfer.transport, failure.code).inc()
                await self._forward(events, out, None, held=held)
                return
            if failure is not None:
                self.metrics.handoff_failures.labels(self.cfg.transfer.transport, failure.code).inc()
                # NOTE: a 200 we cannot read may have handed the KV off: the request is not prefilled twice.
                if not self.cfg.fallback_local_prefill or failure.status in (200, 400):
                    raise _prefill_error(failure)
                log.warning(
                    "prefill of %s failed (%s); prefilling it on the CE",
                    rid,
                    printable(failure, MESSAGE_CHARS),
                )
                self.metrics.local_prefills.labels("fallback").inc()
                await rank.submit(rid, req.prompt_token_ids, req.params, events, req.use_prefix_cache)
                await self._forward(events, out, None, held=held)
                return
            if res.output is not None:  # the first token ended the request: nothing to decode
                await rank.abort([rid])
                res.output.num_cached_tokens = res.num_cached_tokens
                out.put_nowait((rid, res.output))
                return
            acked_s = time.monotonic()
            m, t = self.metrics, res.transport
            m.observe_phase("prefill", res.prefill_s)
            m.observe_phase("transfer", res.transfer_s)
            m.observe_phase("transfer_after_prefill", res.transfer_after_prefill_s)
            m.handoff_streamed_pages.labels(t).inc(res.streamed_pages)
            m.handoff_early_pages.labels(t).inc(res.early_pages)
            m.handoffs.labels(t).inc()
            m.handoff_bytes.labels(t).inc(res.payload_bytes)
            m.handoff_skipped_tokens.labels(t).inc(res.skipped_tokens)
            m.handoff_s.labels(t).observe(res.transfer_s)
            await self._forward(events, out, res.num_cached_tokens, None if is_decoding else acked_s, held)
        except ApiError as e:
            await rank.abort([rid])
            out.put_nowait((rid, PhaseError(e)))

    async def _reserve(
        self, rank: RankClient, req: PDRequest, events: asyncio.Queue[tuple[str, RankEvent]]
    ) -> int:
        """Holds CE memory for the request; returns how many leading prompt tokens the rank's decode
        cache holds already (the PE sends the pages from there on)."""
        if self.num_waiting >= self.cfg.max_queued_requests:
            raise ApiError(
                429,
                f"the decode engines are full and {self.num_waiting} requests are already waiting "
                "for memory; retry later",
                type="server_error",
                code="queue_full",
            )
        num_prompt = len(req.prompt_token_ids)
        max_tokens = req.params.max_tokens
        attempts = 2 if len(self.pool) > 1 else 1  # a failed first prefill is retried on another PE
        ttl_s = attempts * self.cfg.prefill_timeout_s + RESERVATION_MARGIN_S
        self.num_waiting += 1
        self._gauge()
        try:
            ids = tuple(req.prompt_token_ids) if self.cfg.engine.uses_decode_cache else ()
            await rank.reserve(req.request_id, num_prompt + 1, num_prompt + max_tokens, ttl_s, events, ids)
            try:
                _, ev = await asyncio.wait_for(events.get(), self.cfg.queue_timeout_s)
            except asyncio.TimeoutError:
                raise ApiError(
                    503,
                    f"no decode memory became free within {self.cfg.queue_timeout_s:g} s; retry later",
                    type="server_error",
                    code="queue_timeout",
                ) from None
        finally:
            self.num_waiting -= 1
            self._gauge()
        if isinstance(ev, Reserved):
            return ev.num_held_tokens
        if isinstance(ev, RankDown):
            raise ApiError(503, ev.message, type="server_error", code="engine_down")
        if isinstance(ev, RequestRejected):
            raise rejected(ev)
        error = ev.error if isinstance(ev, RequestOutput) else None
        raise internal(error or f"unexpected event while reserving: {type(ev).__name__}")

    async def _prefill(
        self, rank: RankClient, req: PDRequest, key: str | None, progress: _Progress, held_tokens: int = 0
    ) -> PrefillReply:
        """The PE's answer: from the conversation's PE, or once from the next in its order when the
        first failed before the handoff could have reached the CE (see _may_fail_over)."""
        body = PrefillBody(
            request_id=req.request_id,
            prompt_token_ids=tuple(req.prompt_token_ids),
            params=req.params,
            receiver=self.cfg.kv_address(rank.index),
            use_prefix_cache=req.use_prefix_cache,
            seed=None,  # the PE uses the request's seed, or draws one that travels with the KV
            lease_s=self.cfg.handoff_lease_s,
            receiver_held_tokens=held_tokens,
        )
        prompt = list(req.prompt_token_ids)
        choice = self.pool.choose(key, token_ids=prompt)
        if choice is None:
            raise PrefillFailed("prefill_unavailable", "no prefill engine is known (see --prefill-url)")
        client, reason = choice
        try:
            with self.pool.attempt(client, reason, token_ids=prompt):
                return await client.prefill(body, self.cfg.prefill_max_body_bytes)
        except PrefillFailed as e:
            if not _may_fail_over(e) or progress.began:
                raise
            second = self.pool.choose(key, exclude=frozenset({client.url}), token_ids=prompt)
            if second is None:
                raise
            log.warning(
                "prefill of %s at %s failed (%s); retrying it at %s",
                req.request_id,
                client.url,
                printable(e, MESSAGE_CHARS),
                second[0].url,
            )
            self.metrics.handoff_failures.labels(self.cfg.transfer.transport, e.code).inc()
        with self.pool.attempt(second[0], "failover", token_ids=prompt):
            return await second[0].prefill(body, self.cfg.prefill_max_body_bytes)

    async def _while_prefilling(
        self,
        prefill: asyncio.Task[PrefillReply],
        events: asyncio.Queue[tuple[str, RankEvent]],
        out: asyncio.Queue[tuple[str, object]],
        progress: _Progress,
    ) -> None:
        """Until the PE answers /prefill, passes on the CE rank's decode outputs: the CE decodes as soon
        as it has verified the KV, and the PE's answer can come later (its server busy with the next
        prefill), so waiting for it would hold the first tokens back. A finished output (it needs the
        PE's cached count) and any other event wait for the answer. `progress` says which events were
        held back and whether decode outputs were passed on."""
        held = progress.held
        while not prefill.done():
            get = asyncio.ensure_future(events.get())
            try:
                await asyncio.wait({prefill, get}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the client left: no get may outlive this task, pending
                get.cancel()
                raise
            if not get.done():
                get.cancel()  # a cancelled get takes nothing off the queue
                continue
            rid, ev = get.result()
            if isinstance(ev, RequestOutput) and not ev.is_finished and not held:
                out.put_nowait((rid, ev))
                progress.is_decoding = True
            else:
                held.append((rid, ev))

    async def _forward(
        self,
        events: asyncio.Queue[tuple[str, RankEvent]],
        out: asyncio.Queue[tuple[str, object]],
        num_cached_tokens: int | None,
        acked_s: float | None = None,
        held: list[tuple[str, RankEvent]] | None = None,
    ) -> None:
        """Passes the CE rank's events on (`held` ones first) until the request's last one, with the PE's
        cached count."""
        pending = list(held or [])
        while True:
            rid, ev = pending.pop(0) if pending else await events.get()
            if isinstance(ev, RequestOutput):
                if num_cached_tokens is not None:
                    ev.num_cached_tokens = num_cached_tokens
                if acked_s is not None and ev.new_token_ids:
                    self.metrics.observe_phase("first_decode", time.monotonic() - acked_s)
                    acked_s = None
                out.put_nowait((rid, ev))
                if ev.is_finished:
                    return
            elif isinstance(ev, (RankDown, RequestRejected)):
                out.put_nowait((rid, ev))
                return
