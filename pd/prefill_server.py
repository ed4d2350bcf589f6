"""The PE's HTTP side (`python -m pd.server --role pe`, port 8889): POST /prefill, /health, /metrics.

/prefill (body PrefillBody, answer PrefillReply: pd/messages.py, pd/prefill_client.py) takes only
callers that present the cluster token as `Authorization: Bearer <token>`; others get 401 and are
logged. The request goes to a PE rank (affinity on the prompt's first tokens, so a conversation's turns
meet their cached prefix); the answer comes once the CE has acknowledged the handoff (or it failed). A
caller that goes away (the CE's client disconnected, an abort) cancels the handler, which aborts the
rank's request in whatever phase it is: queued, prefilling, or in transfer.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from aiohttp import web

from engine.codec import WireError, from_wire, to_wire
from pd.coordinator import Coordinator
from pd.errors import ApiError, bad_request
from pd.http_io import json_response, read_json
from pd.messages import Prefill, PrefillBody, PrefillReply, PrefillResult, RequestRejected
from pd.rank_client import RankDown, RankEvent

log = logging.getLogger("pd.prefill_server")
TOKEN = web.AppKey("cluster_token", bytes)
AFFINITY_TOKENS = 1024


def _unauthorized() -> ApiError:
    return ApiError(
        401,
        "this endpoint needs the cluster token (Authorization: Bearer ...)",
        type="authentication_error",
        code="unauthorized",
    )


def check_token(request: web.Request, token: bytes) -> None:
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token):
        log.warning("refused unauthenticated %s %s from %s", request.method, request.path, request.remote)
        raise _unauthorized()


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
    try:
        check_token(request, request.app[TOKEN])
    except ApiError:
        metrics.unauthenticated.inc()
        raise
    msg = parse_prefill(await read_json(request, co.cfg.max_body_bytes), co.cfg.handoff_lease_s)
    rank = co.pick_rank(",".join(map(str, msg.prompt_token_ids[:AFFINITY_TOKENS])))
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
        raise bad_request(ev.message, ev.param)
    if not isinstance(ev, PrefillResult):
        raise ApiError(500, f"unexpected rank event {type(ev).__name__}", type="server_error")
    transport = ev.transport or co.cfg.transfer.transport
    if ev.is_handed_off:
        metrics.handoffs.labels(transport).inc()
        metrics.handoff_bytes.labels(transport).inc(ev.payload_bytes)
        metrics.handoff_s.labels(transport).observe(ev.transfer_s)
        metrics.ttft_phase_s.labels("prefill").observe(ev.prefill_s)
        metrics.ttft_phase_s.labels("transfer").observe(ev.transfer_s)
    elif ev.output is None:
        metrics.handoff_failures.labels(transport, ev.code or "unknown").inc()
        if ev.code == "rejected":
            raise bad_request(ev.message)
        if ev.code == "engine_error":  # this request failed in the PE's engine; the rank serves on
            raise ApiError(500, f"prefill failed: {ev.message}", type="server_error", code="engine_error")
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
    )
    return json_response(to_wire(reply))
