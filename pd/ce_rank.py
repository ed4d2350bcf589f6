"""The CE (decode) side of a rank: reservations and the KV receiver.

A request reaches a CE rank in three steps, each one a message or a handoff:

    Reserve ─► pending (FIFO) ─► held (Reserved sent) ─► handoff verified ─► imported: decodes
                  │ full: waits        │ ttl_s passes: error output          (StepOutputs as usual)
                  └─ AbortRequests frees it in any of these states ─────────────────────┘

Admission never overcommits: a reservation is granted only when the engine can hold the sequence now
(engine.reserve) and its whole decode (prompt + max_tokens, `commits`) fits next to every other
request's, so no admitted sequence is ever preempted (which would mean a prefill on the CE).
The KV receiver (transfer.KVReceiver, port kv_port) runs in a LoopThread; it accepts a handoff only
for a held reservation, and the import happens here, on the engine thread, before the PE gets its ack.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from engine.errors import InvalidRequestError
from engine.request import RequestOutput
from pd.loop_thread import LoopThread
from pd.messages import AbortRequests, AddRequest, Message, RequestRejected, Reserve, Reserved, StepOutputs
from transfer.auth import load_token
from transfer.config import TransferConfig
from transfer.errors import HandoffError
from transfer.handoff import HandoffHeader, allocate_payload, model_fingerprint
from transfer.receiver import KVReceiver

log = logging.getLogger("pd.ce_rank")
TICK_S = 0.1  # how often reservations are checked for expiry while any is held


@dataclass
class _Held:
    """A granted reservation waiting for its handoff."""

    num_tokens: int
    ttl_s: float
    deadline_s: float
    is_receiving: bool = False  # the receiver took its offer: expiry waits for the outcome


@dataclass
class _Import:
    export: Any  # SequenceExport
    done: asyncio.Future[None]  # on the loop thread: the receiver acks once it resolves


@dataclass
class _Failed:
    request_id: str
    error: HandoffError


class DecodeRole:
    def __init__(self, engine: Any, ctx: zmq.Context, send: Any, config: dict[str, Any]) -> None:
        self.engine = engine
        self.send = send
        self.total_blocks: int = engine.blocks.num_blocks
        self.commits: dict[str, int] = {}  # request id -> blocks its whole decode may take
        self.pending: deque[Reserve] = deque()
        self.held: dict[str, _Held] = {}  # NOTE: shared with the loop thread: self.lock
        self.lock = threading.Lock()
        self.num_imported = 0
        self.num_expired = 0
        token_file = config.get("token_file")
        token = load_token(token_file=token_file) if token_file else load_token()
        self.lt = LoopThread(ctx, "kv-receiver")
        self.wake = self.lt.wake
        transfer = TransferConfig(
            handshake_timeout_s=float(config.get("handshake_timeout_s", 10.0)),
            idle_timeout_s=float(config.get("idle_timeout_s", 30.0)),
        )
        self.receiver = KVReceiver(
            token,
            engine.layout,
            self._on_handoff,
            self._on_complete,
            host=str(config.get("kv_host", "127.0.0.1")),
            port=int(config["kv_port"]),
            model=model_fingerprint(engine.folder),
            on_error=self._on_error,
            config=transfer,
        )
        try:
            self.lt.run(self.receiver.start(), 30.0)
        except BaseException:
            self.lt.stop()
            raise

    # ---- engine thread --------------------------------------------------------------------------

    def _blocks(self, num_tokens: int) -> int:
        return int(self.engine.scheduler.blocks_for(num_tokens + 1))

    def handle(self, msg: Message) -> bool:
        if isinstance(msg, Reserve):
            self._reserve(msg)
            return True
        if isinstance(msg, AddRequest):  # local prefill (--fallback-local-prefill): the memory is its own now
            with self.lock:
                held = self.held.pop(msg.request_id, None)
            if held is not None:
                self.engine.unreserve(msg.request_id)
            if msg.request_id not in self.commits:
                self.commits[msg.request_id] = self._blocks(len(msg.prompt_token_ids) + msg.params.max_tokens)
            return False
        if isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self._forget(rid)
            self._grant()
            return False  # the loop's engine.abort frees the reservation or the sequence
        return False

    def _reserve(self, msg: Reserve) -> None:
        rid = msg.request_id
        need = self._blocks(msg.num_commit_tokens)
        if need > self.total_blocks:
            self.send(
                RequestRejected(
                    rid,
                    f"{msg.num_commit_tokens} tokens need more KV memory than this engine has "
                    f"({self.total_blocks} pages)",
                    "max_tokens",
                )
            )
            return
        if rid in self.commits or any(p.request_id == rid for p in self.pending):
            self.send(RequestRejected(rid, f"request id {rid!r} is already in use", "request_id"))
            return
        self.pending.append(msg)
        self._grant()

    def _grant(self) -> None:
        """Grants waiting reservations in arrival order while memory allows (never overcommits)."""
        while self.pending:
            msg = self.pending[0]
            need = self._blocks(msg.num_commit_tokens)
            if sum(self.commits.values()) + need > self.total_blocks:
                return
            try:
                if not self.engine.reserve(msg.request_id, msg.num_tokens):
                    return
            except InvalidRequestError as e:
                self.pending.popleft()
                self.send(RequestRejected(msg.request_id, str(e), e.param))
                continue
            self.pending.popleft()
            self.commits[msg.request_id] = need
            with self.lock:
                self.held[msg.request_id] = _Held(msg.num_tokens, msg.ttl_s, time.monotonic() + msg.ttl_s)
            self.send(Reserved(msg.request_id))

    def _forget(self, rid: str) -> None:
        if any(p.request_id == rid for p in self.pending):
            self.pending = deque(p for p in self.pending if p.request_id != rid)
        with self.lock:
            self.held.pop(rid, None)
        self.commits.pop(rid, None)

    def tick(self) -> None:
        for item in self.lt.drain():
            if isinstance(item, _Import):
                self._import(item)
            elif isinstance(item, _Failed):
                with self.lock:
                    held = self.held.get(item.request_id)
                    if held is not None:
                        held.is_receiving = False
        self._expire()
        self._grant()

    def _import(self, item: _Import) -> None:
        rid = item.export.request_id
        with self.lock:
            held = self.held.pop(rid, None)
        error: BaseException | None = None
        if held is None:
            error = HandoffError("unexpected", f"request {rid!r} was aborted or its reservation expired")
        else:
            try:
                self.engine.import_sequence(item.export)
                self.num_imported += 1
            except Exception as e:  # refused: the PE hears it as a nack and the coordinator ends the request
                log.warning("import of %r failed: %r", rid, e)
                self.engine.unreserve(rid)
                self.commits.pop(rid, None)
                error = e
        self.lt.loop.call_soon_threadsafe(_resolve, item.done, error)

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            late = [rid for rid, h in self.held.items() if not h.is_receiving and now > h.deadline_s]
            ttl = {rid: self.held.pop(rid).ttl_s for rid in late}
        for rid in late:
            self.engine.unreserve(rid)
            self.commits.pop(rid, None)
            self.num_expired += 1
            log.warning("reservation of %r expired: no handoff within %.1f s", rid, ttl[rid])
            out = RequestOutput(
                rid,
                [],
                is_finished=True,
                finish_reason="error",
                error=f"no KV handoff arrived within {ttl[rid]:.1f} s (the reservation expired)",
            )
            self.send(StepOutputs((out,)))

    def on_outputs(self, outputs: list[Any]) -> list[Any]:
        finished = [o.request_id for o in outputs if o.is_finished]
        for rid in finished:
            self.commits.pop(rid, None)
        if finished:
            self._grant()
        return outputs

    def poll_timeout_s(self) -> float:
        return TICK_S if self.held or self.pending else 1.0

    def stats(self) -> dict[str, Any]:
        c = self.receiver.counters
        return {
            "num_reservations_waiting": len(self.pending),
            "num_reservations_held": len(self.held),
            "num_committed_blocks": sum(self.commits.values()),
            "handoffs_imported_total": self.num_imported,
            "reservations_expired_total": self.num_expired,
            "handoff_bytes_received_total": c["bytes"],
            "handoffs_refused_auth_total": c["refused_auth"],
            "handoffs_refused_total": c["refused"],
            "handoffs_failed_total": c["failed"],
        }

    def close(self) -> None:
        try:
            self.lt.run(self.receiver.close(), 20.0)
        except Exception as e:
            log.warning("KV receiver did not close cleanly: %r", e)
        self.lt.stop()

    # ---- loop thread (KVReceiver callbacks) -----------------------------------------------------

    def _on_handoff(self, header: HandoffHeader) -> list[torch.Tensor] | None:
        rid = header.request_id
        num_tokens = len(header.prompt_token_ids) + len(header.output_token_ids)
        with self.lock:
            held = self.held.get(rid)
            if held is None or held.is_receiving:
                return None
            if num_tokens > held.num_tokens:
                log.warning("handoff %r brings %d tokens, %d reserved", rid, num_tokens, held.num_tokens)
                return None
            held.is_receiving = True
        return allocate_payload(header, self.engine.device)  # CUDA: the transports land it on the GPU

    async def _on_complete(self, header: HandoffHeader, export: Any) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lt.post(_Import(export, done))
        await done

    def _on_error(self, header: HandoffHeader, error: HandoffError) -> None:
        self.lt.post(_Failed(header.request_id, error))


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
