"""The PE's HTTP side (`python -m pd.server --role pe`, port 8889): POST /prefill, /health, /metrics.

/prefill (body PrefillBody, answer PrefillReply: pd/messages.py, pd/disagg/prefill_client.py) takes only
requests signed with the cluster token (pd/disagg/prefill_auth.py: an HMAC over the method, path, time,
a nonce and the body; the token itself never crosses the wire); others, replays included, get 401 and
are logged. A request id already in flight gets 409. The request goes to a PE rank (affinity on the prompt's first tokens, so a conversation's turns
meet their cached prefix); the answer comes once the CE has acknowledged the handoff (or it failed). A
caller that goes away (the CE's client disconnected, an abort) cancels the handler, which aborts the
rank's request in whatever phase it is: queued, prefilling, or in transfer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from engine.codec import WireError, from_wire, to_wire
from pd.disagg.prefill_auth import AuthFailed, Verifier
from pd.errors import ApiError, bad_request, rejected
from pd.frontend.coordinator import Coordinator
from pd.http.io import json_response, parse_json, read_body
from pd.messages import Prefill, PrefillBody, PrefillReply, PrefillResult, RequestRejected
from pd.rank.client import RankDown, RankEvent
from transfer.errors import ENGINE_ERROR

log = logging.getLogger(__name__)
VERIFIER = web.AppKey("prefill_verifier", Verifier)
AFFINITY_TOKENS = 1024


def check_signature(request: web.Request, verifier: Verifier, body: bytes) -> None:
    """401 unless the request is signed with the cluster token, fresh and not replayed."""
    try:
        verifier.verify(request.method, request.path, request.headers.get("Authorization"), body)
    except AuthFailed as e:
        log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, e)
        raise ApiError(
            401,
            "this endpoint needs a request signed with the cluster token (pd/disagg/prefill_auth.py)",
            type="authentication_error",
            code="unauthorized",
        ) from None


def parse_prefill(body: Any, default_lease_s: float) -> Prefill:
    """The PE rank's message for a /prefill body; a body that does not decode (an unknown or missing
    field, a wrong type, a value out of range) is a 400 whose `param` is the field's path."""
    try:
        return from_wire(PrefillBody, body).prefill(default_lease_s)
    except WireError as e:
        raise bad_request(f"invalid /prefill body: {e}", e.field or None) from None


async def prefill(co: Coordinator, request: web.Request) -> web.Response:
    metrics = co.cluster_metrics
    assert metrics is not None
    body = await read_body(request, co.cfg.prefill_max_body_bytes, co.cfg.body_timeout_s)
    try:
        check_signature(request, request.app[VERIFIER], body)
    except ApiError:
        metrics.unauthenticated.inc()
        raise
    msg = parse_prefill(parse_json(body), co.cfg.handoff_lease_s)
    with co.claim(msg.request_id):
        return await _prefill(co, msg)


async def _prefill(co: Coordinator, msg: Prefill) -> web.Response:
    metrics = co.cluster_metrics
    assert metrics is not None
    prompt = list(msg.prompt_token_ids)
    with co.pick_rank(",".join(map(str, prompt[:AFFINITY_TOKENS])), prompt) as rank:
        events: asyncio.Queue[tuple[str, RankEvent]] = asyncio.Queue()
        await rank.prefill(msg, events)
        try:
            _, ev = await events.get()
        except asyncio.CancelledError:  # the caller went away: free the request on the rank, in any phase
            await asyncio.shield(rank.abort([msg.request_id]))
            raise
    if isinstance(ev, RankDown):
        raise ApiError(503, ev.message, type="server_error", code="engine_down")
    if isinstance(ev, RequestRejected):
        raise rejected(ev)
    if not isinstance(ev, PrefillResult):
        raise ApiError(500, f"unexpected rank event {type(ev).__name__}", type="server_error")
    transport = ev.transport or co.cfg.transfer.transport
    if ev.is_handed_off:
        metrics.handoffs.labels(transport).inc()
        metrics.handoff_bytes.labels(transport).inc(ev.payload_bytes)
        metrics.handoff_skipped_tokens.labels(transport).inc(ev.skipped_tokens)
        metrics.handoff_s.labels(transport).observe(ev.transfer_s)
        metrics.observe_phase("prefill", ev.prefill_s)
        metrics.observe_phase("transfer", ev.transfer_s)
        metrics.observe_phase("transfer_after_prefill", ev.transfer_after_prefill_s)
        metrics.handoff_streamed_pages.labels(transport).inc(ev.streamed_pages)
        metrics.handoff_early_pages.labels(transport).inc(ev.early_pages)
    elif ev.output is None:
        metrics.handoff_failures.labels(transport, ev.code or "unknown").inc()
        if ev.code == "rejected":
            raise bad_request(ev.message)
        if ev.code == ENGINE_ERROR:  # an engine (the PE's, or the CE's import) failed this request alone
            raise ApiError(500, ev.message, type="server_error", code=ENGINE_ERROR)
        raise ApiError(502, f"handoff failed: {ev.message}", type="server_error", code=ev.code)
    reply = PrefillReply(
        ev.is_handed_off,
        ev.num_prompt_tokens,
        ev.num_cached_tokens,
        ev.prefill_s,
        ev.transfer_s,
        ev.payload_bytes,
        transport,
        ev.output,
        ev.skipped_tokens,
        ev.transfer_after_prefill_s,
        ev.streamed_pages,
        ev.early_pages,
    )
    return json_response(to_wire(reply))
