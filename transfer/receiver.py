"""KVReceiver: the CE rank's end of the handoff. One TCP listener; a sender's connection is
authenticated once and then carries its handoffs one after another (wire.py).

Limits on the port, for peers that do not hold the token (TransferConfig):

    limit                          flag                   a new connection past it
    connections held at once       --kv-max-connections   closes the oldest unauthenticated one; if all
                                                          are authenticated, is itself closed unread
    unauthenticated at once        half of that (>= 1)    closes the oldest unauthenticated one
    Hello sent to Auth received    --auth-timeout-s       (the peer is nacked and closed)
    auth_ok to the first offer     --handshake-timeout-s  (closed)
    between offers                 --keepalive-s          (closed)

Refused connections, closed unauthenticated ones and failed authentications are each logged at most
every LOG_EVERY_S; text a peer sent (its sender id, a request id, a nack's reason) reaches a log line
only through errors.printable().

For each connection: authenticate (else refuse and log); for each offer on it: read the offer, refuse a header that does not
match this engine, ask the CE whether it expects the request and where the payload goes (on_handoff),
receive into those buffers, verify the checksum, and only then hand the sequence over (on_complete).
The sender is told ack (on_complete returned) or nack with the reason. A payload that is cut short,
late or corrupt is never handed over: the CE hears about it through on_error instead.

A streamed handoff (an `open` instead of an offer: the sender is still prefilling, wire.py) is asked for
in on_handoff by its open's header, takes its pages in parts, each verified as it lands, and ends with an
offer of the rest, handled as above; what on_complete gets is the whole sequence, as from one offer.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import inspect
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch

from engine.handoff import KVLayout, SequenceExport
from transfer.auth import server_handshake
from transfer.checksum import payload_checksum
from transfer.config import MAX_TCP_STREAMS, TransferConfig
from transfer.errors import (
    AUTH,
    BAD_HEADER,
    CHECKSUM,
    INCOMPLETE,
    MESSAGE_CHARS,
    PROTOCOL,
    REJECTED,
    TIMEOUT,
    TRANSPORT,
    UNEXPECTED,
    HandoffError,
    printable,
)
from transfer.header import (
    Buffer,
    HandoffHeader,
    PackedIds,
    check_final,
    check_layout,
    check_segments,
    to_export,
)
from transfer.messages import (
    AuthOk,
    ControlMessage,
    HandoffAck,
    Ids,
    Join,
    KeepAlive,
    Offer,
    Open,
    Part,
    Ready,
    Streams,
    Sum,
)
from transfer.transport import KVPool, Transport, make_transport
from transfer.wire import Channel

log = logging.getLogger(__name__)
LOG_EVERY_S = 10.0  # each kind of refusal a flood can cause is logged at most this often

# on_handoff: the buffers to receive into (transfer.handoff.allocate_payload shapes; KVReceiver.
# receive_buffers gives them in the offer's transport's own memory where it has some), or None to refuse.
OnHandoff = Callable[[HandoffHeader], "Awaitable[list[Buffer] | None] | list[Buffer] | None"]
# on_complete: takes a verified sequence (e.g. engine.import_sequence); raising refuses it (nack).
OnComplete = Callable[[HandoffHeader, SequenceExport], "Awaitable[None] | None"]
# on_error: a handoff on_handoff accepted has failed; nothing was delivered (release the reservation).
OnError = Callable[[HandoffHeader, HandoffError], "Awaitable[None] | None"]


# the transport of the offer whose on_handoff runs (each connection is a task: its own context)
_OFFERED: contextvars.ContextVar[Transport | None] = contextvars.ContextVar("offered_transport", default=None)


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


class _Throttled:
    """One kind of warning, logged at most once per LOG_EVERY_S: a flood of peers cannot fill the log.
    A line that is logged says how many were not since the last one."""

    def __init__(self) -> None:
        self._logged_s = -LOG_EVERY_S
        self._held = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._logged_s < LOG_EVERY_S:
            self._held += 1
            return
        if self._held:
            msg += f" ({self._held} more not logged since the last such line)"
        self._logged_s, self._held = now, 0
        log.warning(msg, *args)


@dataclass
class _Joined:
    """A data connection waiting for, then held by, the control connection it joined."""

    ch: Channel
    claimed: asyncio.Future[None]  # its control connection took it
    released: asyncio.Future[None]  # its control connection ended


class KVReceiver:
    def __init__(
        self,
        token: bytes,
        layout: KVLayout,
        on_handoff: OnHandoff,
        on_complete: OnComplete,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "",
        on_error: OnError | None = None,
        config: TransferConfig | None = None,
        transports: dict[str, Transport] | None = None,
    ) -> None:
        """token: the cluster secret (transfer.auth.load_token). host: the address to bind (loopback by
        default; a CE that takes handoffs from another host binds its cluster-facing address).
        port 0 picks a free port (see .port). transports: prebuilt transports by name (tests)."""
        if not token:
            raise ValueError("a KV receiver needs the cluster token")
        self.token = token
        self.layout = layout
        self.model = model
        self.host = host
        self.port = port
        self.config = config or TransferConfig()
        self.on_handoff = on_handoff
        self.on_complete = on_complete
        self.on_error = on_error
        self._transports: dict[str, Transport] = dict(transports or {})
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()  # every connection's task until it ends
        # the connections held, by state; a closed (evicted) one leaves these at once, _conns when it ends
        self._unauthenticated: dict[asyncio.Task[None], str] = {}  # peer by task, oldest first
        self._authenticated: set[asyncio.Task[None]] = set()
        # a slow peer without the token may hold at most this many slots: the rest stay for the PEs
        self.max_unauthenticated = max(1, self.config.max_connections // 2)
        # data connections by their control connection's key and their index, until claimed
        self._joins: dict[bytes, dict[int, _Joined]] = {}
        self._joined = asyncio.Condition()  # notified as one joins
        self._refusals = _Throttled()
        self._evictions = _Throttled()
        self._auth_failures = _Throttled()
        self.counters = {
            "handoffs": 0,
            "bytes": 0,
            "refused_auth": 0,  # peers that failed or did not finish authentication in time
            "refused": 0,
            "failed": 0,
            "refused_connections": 0,  # closed unread: --kv-max-connections authenticated ones held
            "evicted_unauthenticated": 0,  # closed unauthenticated to make room for a new connection
        }

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def transports(self) -> dict[str, Transport]:
        """The transports made so far (on a handoff's first offer over each), by name."""
        return dict(self._transports)

    def receive_buffers(
        self, header: HandoffHeader, device: torch.device | str, pool: KVPool | None = None
    ) -> list[Buffer] | None:
        """For on_handoff: buffers on device for header's payload in memory the offer's transport has
        prepared once (nixl: the reservation's own pages in pool, registered once, or its registered
        landing arena), or None where it has none (or none free now, or this is called outside an
        on_handoff): then on_handoff allocates them (transfer.handoff.allocate_payload)."""
        transport = _OFFERED.get()
        return transport.receive_buffers(header, torch.device(device), pool) if transport is not None else None

    async def start(self) -> KVReceiver:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._accept_task = asyncio.create_task(self._accept_loop())
        log.info("KV receiver on %s (transports %s)", self.address, ",".join(self.config.accept_transports))
        return self

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            with suppress(asyncio.CancelledError):
                await self._accept_task
        if self._listener is not None:
            self._listener.close()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.wait(self._conns, timeout=15.0)
        for tr in self._transports.values():
            tr.close()

    async def __aenter__(self) -> KVReceiver:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def num_connections(self) -> int:
        """Connections held now (evicted ones that are still closing not counted)."""
        return len(self._authenticated) + len(self._unauthenticated)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, addr = await loop.sock_accept(self._listener)
            except OSError as e:  # e.g. out of file descriptors: keep serving
                log.warning("accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            peer = f"{addr[0]}:{addr[1]}"
            if not self._make_room(peer):
                conn.close()
                self.counters["refused_connections"] += 1
                self._refusals.warning(
                    "refused KV connection from %s: %d connections open (the limit, --kv-max-connections)",
                    peer,
                    self.num_connections,
                )
                continue
            task = asyncio.create_task(self._serve(conn, peer))
            self._conns.add(task)
            self._unauthenticated[task] = peer
            task.add_done_callback(functools.partial(self._ended, sock=conn))
            # NOTE: sock_accept returns without yielding while connections are queued: yield here so
            # that a flood of them does not starve the connections already served (and their closing).
            await asyncio.sleep(0)

    def _make_room(self, peer: str) -> bool:
        """Whether a new connection from peer may be served. Under the limits, yes; when unauthenticated
        connections hold their share, or the cap is reached, the oldest unauthenticated one is closed for
        it (so a slow peer without the token cannot keep a PE out); refused only when every connection
        held is authenticated."""
        full = self.num_connections >= self.config.max_connections
        if not full and len(self._unauthenticated) < self.max_unauthenticated:
            return True
        if not self._unauthenticated:
            return False
        self._evictions.warning(
            "closed unauthenticated KV connection from %s for one from %s: %d connections open, %d of them"
            " unauthenticated (the limits: --kv-max-connections, half of it unauthenticated)",
            next(iter(self._unauthenticated.values())),
            peer,
            self.num_connections,
            len(self._unauthenticated),
        )
        oldest = next(iter(self._unauthenticated))
        del self._unauthenticated[oldest]
        oldest.cancel()  # its _serve closes the socket; it never authenticated: nothing to release
        self.counters["evicted_unauthenticated"] += 1
        return True

    def _ended(self, task: asyncio.Task[None], sock: socket.socket) -> None:
        self._conns.discard(task)
        self._unauthenticated.pop(task, None)
        self._authenticated.discard(task)
        sock.close()  # already closed by _serve, unless the task was cancelled before it began

    def _transport(self, name: str) -> Transport:
        if name not in self.config.accept_transports:
            raise HandoffError(
                TRANSPORT,
                f"transport {name!r} is not enabled on this receiver {self.config.accept_transports}",
            )
        if name not in self._transports:
            self._transports[name] = make_transport(name, self.config)
        return self._transports[name]

    # ---- a connection: authenticate once, then one handoff after another ----------------------

    async def _serve(self, sock: socket.socket, peer: str) -> None:
        ch = Channel(sock, peer)
        joined: list[_Joined] = []
        try:
            await self._authenticate(ch)
            msg = await self._next(ch, self.config.handshake_timeout_s)  # it comes right after auth_ok
            if isinstance(msg, Join):
                await self._serve_data(ch, msg)
                return
            if isinstance(msg, Streams):
                joined = await self._claim(ch, msg)
                msg = await self._next(ch, self.config.handshake_timeout_s)
            while msg is not None and await self._handle(ch, msg):
                msg = await self._next(ch, self.config.keepalive_s)
        except HandoffError as e:
            await ch.nack(e)
        except ConnectionError as e:  # the peer reset the connection (a PE dropping an aborted send)
            log.warning("KV connection from %s lost: %s", peer, printable(repr(e), MESSAGE_CHARS))
        except Exception:
            log.exception("KV connection from %s failed", peer)
            await ch.nack(HandoffError(PROTOCOL, "internal error on the receiver"))
        finally:
            ch.close()  # its data connections too; their tasks end now
            for transport in self._transports.values():
                transport.channel_closed(ch)
            for j in joined:
                if not j.released.done():
                    j.released.set_result(None)

    # ---- data connections (tcp striping): joined to a control connection by its key -----------

    async def _serve_data(self, ch: Channel, join: Join) -> None:
        """Holds a data connection until its control connection claims it (within
        handshake_timeout_s) and then until that one ends; reads nothing from it."""
        if not (isinstance(join.key, bytes) and 0 < len(join.key) <= 64 and 0 <= join.index < MAX_TCP_STREAMS):
            raise HandoffError(PROTOCOL, "malformed join")
        loop = asyncio.get_running_loop()
        entry = _Joined(ch, loop.create_future(), loop.create_future())
        waiting = self._joins.setdefault(join.key, {})
        if join.index in waiting:
            raise HandoffError(PROTOCOL, f"data connection {join.index} joined twice")
        waiting[join.index] = entry
        async with self._joined:
            self._joined.notify_all()
        try:
            await asyncio.wait_for(asyncio.shield(entry.claimed), self.config.handshake_timeout_s)
        except asyncio.TimeoutError:
            raise HandoffError(TIMEOUT, "no control connection claimed this data connection") from None
        finally:
            if not entry.claimed.done():
                entry.claimed.cancel()
            if self._joins.get(join.key, {}).get(join.index) is entry:
                del self._joins[join.key][join.index]
                if not self._joins[join.key]:
                    del self._joins[join.key]
        await entry.released

    async def _claim(self, ch: Channel, msg: Streams) -> list[_Joined]:
        """The data connections that joined with msg's key, attached to ch (Channel.data) in order."""
        if not 1 <= msg.count < MAX_TCP_STREAMS:
            raise HandoffError(PROTOCOL, f"{msg.count} data connections (at most {MAX_TCP_STREAMS - 1})")

        def arrived() -> bool:
            return len(self._joins.get(msg.key, {})) >= msg.count

        try:
            async with self._joined:
                await asyncio.wait_for(self._joined.wait_for(arrived), self.config.handshake_timeout_s)
        except asyncio.TimeoutError:
            raise HandoffError(
                TIMEOUT, f"{len(self._joins.get(msg.key, {}))} of {msg.count} data connections joined"
            ) from None
        waiting = self._joins.pop(msg.key)
        if sorted(waiting) != list(range(msg.count)):
            err = HandoffError(PROTOCOL, f"data connections {sorted(waiting)} joined, 0..{msg.count - 1} announced")
            for j in waiting.values():
                j.claimed.set_exception(err)  # each is nacked and closed
            raise err
        joined = [waiting[i] for i in range(msg.count)]
        for j in joined:
            j.claimed.set_result(None)
        ch.data = [j.ch for j in joined]
        return joined

    async def _next(self, ch: Channel, timeout_s: float) -> ControlMessage | None:
        """The next message, or None if the sender closed the connection or sent nothing for timeout_s."""
        try:
            return await asyncio.wait_for(ch.recv_or_eof(), timeout_s)
        except asyncio.TimeoutError:
            return None
        except HandoffError as e:
            if e.code == PROTOCOL:  # a malformed message
                self.counters["refused"] += 1
                log.warning("refused handoff offer from %s: %s", ch.peer, printable(e, MESSAGE_CHARS))
            raise

    async def _authenticate(self, ch: Channel) -> None:
        try:
            sender, proof = await asyncio.wait_for(
                server_handshake(ch, self.token), self.config.auth_timeout_s
            )
        except (HandoffError, asyncio.TimeoutError) as e:
            self.counters["refused_auth"] += 1
            reason = (
                printable(e.message, MESSAGE_CHARS)
                if isinstance(e, HandoffError)
                else f"no authentication within {self.config.auth_timeout_s:g} s (--auth-timeout-s)"
            )
            self._auth_failures.warning("refused unauthenticated KV peer %s: %s", ch.peer, reason)
            raise HandoffError(AUTH, f"not authenticated: {reason}") from None
        log.debug("KV peer %s authenticated as %s", ch.peer, printable(sender))
        task = asyncio.current_task()
        assert task is not None
        # NOTE: an evicted connection's task is cancelled, but wait_for (Python < 3.12) can lose a
        # cancellation that comes as the handshake finishes: such a connection must not go on.
        if self._unauthenticated.pop(task, None) is None:
            raise HandoffError(AUTH, "closed to make room for another connection")
        self._authenticated.add(task)
        await ch.send(AuthOk(proof, self.model, self.layout.fields()))

    async def _handle(self, ch: Channel, msg: ControlMessage) -> bool:
        """One handoff, from its offer msg (or a streamed one's open); raises HandoffError (the caller
        nacks and closes) if the handoff fails."""
        streamed = isinstance(msg, Open)
        try:
            offer = Offer(msg.transport, msg.header) if isinstance(msg, Open) else ch.expected(msg, Offer)
        except HandoffError as e:
            if e.code == PROTOCOL:  # not an offer
                self.counters["refused"] += 1
                log.warning("refused handoff offer from %s: %s", ch.peer, printable(e, MESSAGE_CHARS))
            raise
        header, transport, extra, segments, phases = await self._take(ch, offer, streamed)
        try:
            if streamed:
                ack = await self._stream(ch, header, transport, segments, phases)
            else:
                ack = await self._receive(ch, header, transport, extra, segments, phases)
        except BaseException as e:  # incl. cancellation (shutdown): the reservation must be released
            await self._failed(ch, header, e)
            raise
        self.counters["handoffs"] += 1
        self.counters["bytes"] += header.payload_bytes
        await ch.send(ack)
        return True

    async def _take(
        self, ch: Channel, offer: Offer, streamed: bool
    ) -> tuple[HandoffHeader, Transport, dict[str, Any], list[Buffer], dict[str, float]]:
        """An offer's (or a streamed handoff's open's) header, transport and fields, and the buffers
        on_handoff gives for it (the reservation taken), with the seconds each took; a refusal is
        counted and logged before it is raised."""
        t0 = time.perf_counter()
        try:
            header, transport, extra = self._read_offer(offer)
            if streamed and not transport.capabilities.streams:
                raise HandoffError(TRANSPORT, f"transport {transport.name!r} does not carry streamed handoffs")
            t_offer = time.perf_counter()
            segments = await self._ask(header, transport)
            if segments is None:
                raise HandoffError(UNEXPECTED, f"request {header.request_id!r} is not expected here")
        except HandoffError as refused:
            self.counters["refused"] += 1
            what = "streamed handoff" if streamed else "handoff offer"
            log.warning("refused %s from %s: %s", what, ch.peer, printable(refused, MESSAGE_CHARS))
            raise
        return header, transport, extra, segments, {"decode": t_offer - t0, "on_handoff": time.perf_counter() - t_offer}

    async def _ask(self, header: HandoffHeader, transport: Transport) -> list[Buffer] | None:
        """on_handoff(header), able to take its buffers from transport's memory (receive_buffers)."""
        offered = _OFFERED.set(transport)
        try:
            segments: list[Buffer] | None = await _call(self.on_handoff, header)
            return segments
        finally:
            _OFFERED.reset(offered)

    async def _failed(self, ch: Channel, header: HandoffHeader, e: BaseException) -> None:
        """An accepted handoff failed (e): counted, logged, and on_error told (nothing was delivered)."""
        if isinstance(e, HandoffError):
            err = e
        elif isinstance(e, asyncio.CancelledError):
            err = HandoffError(TIMEOUT, "the receiver shut down mid-handoff")
        else:
            err = HandoffError(PROTOCOL, f"receiver failed: {e!r}")
        self.counters["failed"] += 1
        log.warning(
            "handoff %s from %s failed: %s",
            printable(header.request_id),
            ch.peer,
            printable(err, MESSAGE_CHARS),
        )
        if self.on_error is not None:
            with suppress(Exception):
                await _call(self.on_error, header, err)

    # ---- a streamed handoff (--kv-stream on the sender; wire.py's open and part) --------------

    async def _stream(
        self,
        ch: Channel,
        plan: HandoffHeader,
        transport: Transport,
        segments: list[Buffer],
        phases: dict[str, float],
    ) -> HandoffAck:
        """A streamed handoff after its open (plan: the open's header; segments: buffers for the whole
        payload, the reservation taken by it): the parts, each verified as it lands, then the final
        offer's payload into what they left of segments, verified as any offer's before the whole is
        delivered:

            segments[0]  | part | part | ... | the final offer's pages |   segments[1]: the state (final)
                         ^ plan.first_page    ^ final header's first_page = plan.first_page + streamed
        """
        check_segments(plan, segments)
        await self._read_ids(ch, plan)
        pages = segments[0]
        if transport.writes_parts:
            opened = await transport.open_stream(ch, plan, pages)
            try:
                await ch.send(Ready(opened))
                msg, done, parts_s = await self._parts(ch, plan, transport, pages)
            except BaseException:
                transport.end_stream(pages, clean=False)  # NOTE: a write may still be landing
                raise
            transport.end_stream(pages, clean=True)  # every part's write had ended before its message
        else:
            await ch.send(Ready({}))
            msg, done, parts_s = await self._parts(ch, plan, transport, pages)
        offer = ch.expected(msg, Offer)
        header, final_transport, extra = self._read_offer(offer)
        if final_transport is not transport:
            raise HandoffError(PROTOCOL, f"request {plan.request_id!r}: opened over {transport.name}, ends over {final_transport.name}")
        check_final(plan, header, done)
        phases["parts"] = parts_s
        return await self._receive(ch, header, transport, extra, [pages[done:], *segments[1:]], phases, (plan, segments))

    async def _parts(
        self, ch: Channel, plan: HandoffHeader, transport: Transport, pages: Buffer
    ) -> tuple[ControlMessage, int, float]:
        """A stream's parts into pages, each verified, up to the first other message: that message, the
        pages received and the seconds spent on them."""
        done, parts_s = 0, 0.0
        while True:
            try:
                msg = await asyncio.wait_for(ch.recv_or_eof(), self.config.keepalive_s)
            except asyncio.TimeoutError:
                raise HandoffError(
                    TIMEOUT, f"request {plan.request_id!r}: nothing streamed for {self.config.keepalive_s:g} s"
                ) from None
            if msg is None:
                raise HandoffError(INCOMPLETE, f"request {plan.request_id!r}: the sender closed the stream")
            if isinstance(msg, KeepAlive):  # the sender's prefill goes on
                continue
            if not isinstance(msg, Part):
                break
            t = time.perf_counter()
            n = msg.num_pages
            if msg.first_page != plan.first_page + done or n < 1 or done + n >= plan.num_pages:
                raise HandoffError(
                    PROTOCOL,
                    f"request {plan.request_id!r}: a part of pages [{msg.first_page}, {msg.first_page + n}) after"
                    f" {done} of {plan.num_pages} pages from page {plan.first_page} (the last always goes at the end)",
                )
            view = pages[done : done + n]
            got = None  # writes_parts: the bytes are there already
            if not transport.writes_parts:
                await transport.accept(ch, plan, msg.extra, [view])
                got = await transport.pull(ch, plan, msg.extra, [view])
            if got is None:  # hash where the bytes are
                got = await asyncio.get_running_loop().run_in_executor(transport.executor, payload_checksum, [view])
            if got != msg.checksum:
                raise HandoffError(
                    CHECKSUM, f"request {plan.request_id!r}: pages [{msg.first_page}, {msg.first_page + n}):"
                    f" checksum {got:#x} != the sender's {msg.checksum:#x}",
                )
            done += n
            parts_s += time.perf_counter() - t
        return msg, done, parts_s

    async def _read_ids(self, ch: Channel, header: HandoffHeader) -> None:
        """The prompt's token ids, when the header announced them instead of carrying them."""
        ids = header.prompt_token_ids
        if not isinstance(ids, PackedIds) or not ids.pending:
            return
        try:
            msg = await asyncio.wait_for(ch.expect(Ids), self.config.handshake_timeout_s)
            ids.fill(msg.ids)
        except asyncio.TimeoutError:
            raise HandoffError(
                TIMEOUT, f"request {header.request_id!r}: no token ids after the offer"
            ) from None
        except (TypeError, ValueError) as e:
            raise HandoffError(BAD_HEADER, f"request {header.request_id!r}: {e}") from None

    async def _read_sum(self, ch: Channel, header: HandoffHeader) -> int:
        """The payload's checksum: the header's, or the `sum` message's when the header says it follows."""
        if not header.checksum_follows:
            return header.checksum
        rid = header.request_id
        try:
            msg = await asyncio.wait_for(ch.expect(Sum), self.config.handshake_timeout_s)
        except asyncio.TimeoutError:
            raise HandoffError(TIMEOUT, f"request {rid!r}: no checksum after the offer") from None
        if msg.request_id != rid or not 0 <= msg.checksum < 1 << 64:
            raise HandoffError(
                PROTOCOL, f"request {rid!r}: a checksum for {printable(repr(msg.request_id))} or out of range"
            )
        return msg.checksum

    def _read_offer(self, offer: Offer) -> tuple[HandoffHeader, Transport, dict[str, Any]]:
        """The offer's header, if it is for this engine, and the transport it asks for."""
        header = HandoffHeader.decode(offer.header)
        check_layout(header, self.layout, self.model)
        return header, self._transport(offer.transport), offer.extra

    async def _receive(
        self,
        ch: Channel,
        header: HandoffHeader,
        transport: Transport,
        extra: dict[str, Any],
        segments: list[Buffer],
        phases: dict[str, float],
        streamed: tuple[HandoffHeader, list[Buffer]] | None = None,
    ) -> HandoffAck:
        """Receive, verify, deliver; returns the ack (with where the receiver's time went, phases).
        Nothing reaches on_complete unverified. streamed: a streamed handoff's open header and whole
        buffers (segments are then what its parts left of them): what is delivered is the whole."""
        rid = header.request_id
        t_accept = time.perf_counter()
        check_segments(header, segments)
        reply = await transport.accept(ch, header, extra, segments)
        t0 = time.perf_counter()
        phases["accept"] = t0 - t_accept
        want = header.checksum
        try:
            if not transport.reads_in_place:  # the payload comes after ready, on this socket for tcp
                await self._read_ids(ch, header)
                want = await self._read_sum(ch, header)
                await ch.send(Ready(reply))
            pulling = asyncio.ensure_future(transport.pull(ch, header, extra, segments, phases=phases))
        except BaseException:
            transport.abandon(segments)
            raise
        try:
            await asyncio.sleep(0)  # the pull starts: ipc launches its copy before anything below
            if transport.reads_in_place:  # the sender waits for nothing before the payload
                await ch.send(Ready(reply))
                await self._read_ids(ch, header)
                want = await self._read_sum(ch, header)
            export = to_export(header, segments)  # token ids unpacked while the payload moves
            checksum = await pulling
        finally:
            if not pulling.done():
                pulling.cancel()
                with suppress(BaseException):
                    await pulling
        recv_s = time.perf_counter() - t0
        if checksum is None:  # hash where the bytes are (the GPU for CUDA buffers)
            checksum = await asyncio.get_running_loop().run_in_executor(
                transport.executor, payload_checksum, segments
            )
        verify_s = time.perf_counter() - t0 - recv_s
        if checksum != want:
            raise HandoffError(CHECKSUM, f"request {rid!r}: payload checksum {checksum:#x} != the sender's {want:#x}")
        if streamed is not None:
            plan, whole = streamed
            if header.prompt_token_ids != plan.prompt_token_ids:
                raise HandoffError(BAD_HEADER, f"request {rid!r}: the final offer's prompt differs from the open's")
            export = dataclasses.replace(export, first_page=plan.first_page, pages=whole[0])
        t_complete = time.perf_counter()
        try:
            await _call(self.on_complete, header, export)
        except HandoffError:
            raise
        except Exception as e:
            raise HandoffError(REJECTED, f"request {rid!r} refused after transfer: {e!r}") from e
        phases["complete"] = time.perf_counter() - t_complete
        return HandoffAck(rid, header.payload_bytes, recv_s, verify_s, phases)
