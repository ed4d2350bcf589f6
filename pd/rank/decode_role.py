"""The CE (decode) side of a rank: reservations and the KV receiver, as messages.

A request reaches a CE rank in three steps, each one a message or a handoff:

    Reserve ─► waiting (FIFO) ─► reserved (Reserved sent) ─► handoff verified ─► imported: decodes
                  │ full: waits        │ ttl_s passes: error output          (StepOutputs as usual)
                  └─ AbortRequests frees it in any of these states ─────────────────────┘

The states, the commit accounting (admission never overcommits) and every transition belong to the
engine (engine.handoffs, engine/handoff/ledger.py); this role turns messages into transitions and
their outcomes into messages. The KV receiver (transfer.KVReceiver, port kv_port) runs in a
LoopThread; it takes an offer only for a reserved request (handoffs.begin_receive, one of the two
transitions made on its thread), and the import happens on the engine thread, before the PE gets its ack.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import zmq

from engine.errors import InvalidRequestError
from engine.faults import raise_if_fatal
from engine.handoff import SequenceExport
from engine.handoff.ledger import Phase
from engine.request import RequestOutput
from pd.config import RoleConfig
from pd.messages import AbortRequests, AddRequest, Message, Reserve, Reserved, StepOutputs
from pd.rank.loop_thread import LoopThread
from pd.rank.role import admission_error, rejection
from transfer.auth import load_token
from transfer.errors import ENGINE_ERROR, UNEXPECTED, HandoffError
from transfer.header import Buffer, HandoffHeader, allocate_payload, model_fingerprint
from transfer.receiver import KVReceiver

if TYPE_CHECKING:
    from engine.engine import LLMEngine

log = logging.getLogger(__name__)
IMPORT_FAILED = "the decode engine failed to import it (its log has why, under the request's id)"
TICK_S = 0.1  # how often reservations are checked for expiry while any is held


@dataclass
class _Import:
    export: SequenceExport
    done: asyncio.Future[None]  # on the loop thread: the receiver acks once it resolves


class DecodeRole:
    def __init__(
        self, engine: LLMEngine, ctx: zmq.Context, send: Callable[[Message], None], config: RoleConfig
    ) -> None:
        self.engine = engine
        self.handoffs = engine.handoffs
        self.send = send
        token = load_token(token_file=config.token_file or None)
        self.pool = _EnginePool(engine)
        self.lt = LoopThread(ctx, "kv-receiver")
        self.wake = self.lt.wake
        self.receiver = KVReceiver(
            token,
            engine.handoff_layout,
            self._on_handoff,
            self._on_complete,
            host=config.kv_host,
            port=config.kv_port,
            model=model_fingerprint(engine.folder),
            on_error=self._on_error,
            config=config.transfer,
        )
        try:
            self.lt.run(self.receiver.start(), 30.0)
        except BaseException:
            self.lt.stop()
            raise

    # ---- engine thread --------------------------------------------------------------------------

    def handle(self, msg: Message) -> bool:
        if isinstance(msg, Reserve):
            try:
                self.handoffs.enqueue(
                    msg.request_id, msg.num_tokens, msg.num_commit_tokens, msg.ttl_s, list(msg.token_ids) or None
                )
            except Exception as e:
                self.send(rejection(msg.request_id, admission_error(self.engine, msg.request_id, e)))
                return True
            self._grant()
            return True
        if isinstance(msg, AddRequest):  # local prefill (--fallback-local-prefill): the memory is its own now
            try:
                self.engine.validate(msg.request_id, list(msg.prompt_token_ids), msg.params)
            except Exception as e:
                self.send(rejection(msg.request_id, admission_error(self.engine, msg.request_id, e)))
                return True
            self.handoffs.take_over(msg.request_id, len(msg.prompt_token_ids) + msg.params.max_tokens)
            return False  # the loop adds it
        if isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.engine.abort(rid)  # frees it in any phase; the loop's own abort finds nothing left
            self._grant()
            return False
        return False

    def _grant(self) -> None:
        for g in self.handoffs.grant():
            if g.error is None:
                self.send(Reserved(g.request_id, g.num_held_tokens))
            else:
                self.send(rejection(g.request_id, g.error))

    def tick(self) -> None:
        for item in self.lt.drain():
            self._import(item)
        self._expire()
        self._grant()

    def _import(self, item: _Import) -> None:
        rid = item.export.request_id
        error: BaseException | None = None
        if self.handoffs.phase(rid) is not Phase.RECEIVING:
            error = HandoffError(UNEXPECTED, f"request {rid!r} was aborted or its reservation expired")
        else:
            try:
                self.engine.import_sequence(item.export)
            except Exception as e:  # refused: the PE hears it as a nack and the coordinator ends the request
                self.handoffs.refuse_import(rid)
                if isinstance(e, InvalidRequestError):  # the request's fault: a 400, saying why
                    log.warning("import of %r refused: %s", rid, e)
                    error = e
                else:
                    raise_if_fatal(e)
                    log.error("import of %r failed", rid, exc_info=e)
                    error = HandoffError(ENGINE_ERROR, IMPORT_FAILED)
        self.lt.loop.call_soon_threadsafe(_resolve, item.done, error)

    def _expire(self) -> None:
        for late in self.handoffs.expire():
            rid, ttl_s = late.request_id, late.ttl_s
            log.warning("reservation of %r expired: no handoff within %.1f s", rid, ttl_s)
            out = RequestOutput(
                rid,
                [],
                is_finished=True,
                finish_reason="error",
                error=f"no KV handoff arrived within {ttl_s:.1f} s (the reservation expired)",
            )
            self.send(StepOutputs((out,)))

    def on_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        if any(o.is_finished for o in outputs):  # their commits ended with them (engine.handoffs.end)
            self._grant()
        return outputs

    def poll_timeout_s(self) -> float:
        return TICK_S if self.handoffs.num_held or self.handoffs.num_waiting else 1.0

    def stats(self) -> dict[str, int]:
        c, h = self.receiver.counters, self.handoffs
        return {
            "num_reservations_waiting": h.num_waiting,
            "num_reservations_held": h.num_held,
            "num_committed_blocks": h.num_committed_blocks,
            "handoffs_imported_total": h.num_imported_total,
            "reservations_expired_total": h.num_expired_total,
            "handoff_bytes_received_total": c["bytes"],
            "handoffs_refused_auth_total": c["refused_auth"],
            "handoffs_refused_total": c["refused"],
            "handoffs_failed_total": c["failed"],
            # nixl: handoffs written straight into their reservation's pages; pages kept from reuse after
            # a failed one while its sender may still be writing (counted in num_committed_blocks too)
            "handoffs_in_place_total": sum(
                getattr(t, "counters", {}).get("in_place_receives", 0) for t in self.receiver.transports.values()
            ),
            "num_quarantined_blocks": h.num_quarantined_blocks,
        }

    def close(self) -> None:
        try:
            self.lt.run(self.receiver.close(), 20.0)
        except Exception as e:
            log.warning("KV receiver did not close cleanly: %r", e)
        self.lt.stop()

    # ---- loop thread (KVReceiver callbacks) -----------------------------------------------------

    def _on_handoff(self, header: HandoffHeader) -> list[Buffer] | None:
        num_tokens = len(header.prompt_token_ids) + len(header.output_token_ids)
        if not self.handoffs.begin_receive(header.request_id, num_tokens):
            return None
        try:
            # nixl: the reservation's own pages (registered once), or slices of its registered landing
            # arena; CUDA: the transports land it on the GPU
            buffers = self.receiver.receive_buffers(header, self.engine.device, self.pool)
            return buffers if buffers is not None else [*allocate_payload(header, self.engine.device)]
        except BaseException:
            self.handoffs.receive_failed(header.request_id)
            raise

    async def _on_complete(self, header: HandoffHeader, export: SequenceExport) -> None:
        self.handoffs.landed(header.request_id)  # verified: no write is landing in its memory any more
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lt.post(_Import(export, done))
        await done

    def _on_error(self, header: HandoffHeader, error: HandoffError) -> None:
        self.handoffs.receive_failed(header.request_id)  # thread-safe: the ledger holds its lock


class _EnginePool:
    """The engine's KV pool as the receiver's transports see it (transfer.transport.KVPool): a one-sided
    transport registers its memory once and writes a handoff into the reservation's own pages."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.engine.kv.pages, self.engine.kv.swa

    def target(self, header: HandoffHeader, hold_s: float) -> list[Buffer] | None:
        first, n = header.first_page, header.page_shape[0]
        got = self.engine.in_place_target(header.request_id, first, first + n, hold_s)
        if got is None:
            return None
        pages, state = got
        return [pages] + ([state] if header.has_state and state is not None else [])


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
