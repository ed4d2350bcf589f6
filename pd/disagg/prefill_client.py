"""The CE coordinator's client of the PE's prefill server: POST /prefill with the cluster token, and a
health watch with backoff (the PE's state is never "failed for good": it is probed until it answers).

POST /prefill (JSON of the codec's to_wire; signed with the cluster token: pd/disagg/prefill_auth.py):

    PrefillBody {"request_id", "prompt_token_ids": [int], "params": {SamplingParams fields},
                 "receiver": "host:port", "use_prefix_cache": bool, "seed": int | null, "lease_s": float | null}
    200 -> PrefillReply {"handed_off": bool, "num_prompt_tokens", "num_cached_tokens", "prefill_s",
                         "transfer_s", "payload_bytes", "transport", "output": RequestOutput | null}
    4xx/5xx -> OpenAI's error object; code: a transfer.errors code on 502, engine_down, unauthorized...

Both sides decode strictly (pd/messages.py): a body that does not decode is a 400 naming the field, and
a 200 whose body does not decode is a failed prefill here (bad_response), never a half-read answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from engine.codec import WireError, from_wire, to_wire
from pd.disagg.membership import watch
from pd.disagg.prefill_auth import sign
from pd.http.request_log import HEADER, REQUEST_ID
from pd.http.site import client_ssl_context
from pd.lifecycle import DRAINING_CODE
from pd.messages import PrefillBody, PrefillReply
from transfer.errors import MESSAGE_CHARS, printable

log = logging.getLogger(__name__)
HEALTH_EVERY_S = 2.0
KEEPALIVE_S = 2.0  # an idle pooled connection is closed here before the PE's --timeout-keep-alive (5 s)


def _is_reset(e: BaseException) -> bool:
    """A connection that broke under a request (not a refused one): the PE closed it, or died."""
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(e, (aiohttp.ClientOSError, ConnectionError)) and not isinstance(
        e, aiohttp.ClientConnectorError
    ) and getattr(e, "errno", None) in (errno.ECONNRESET, errno.EPIPE)


class PrefillFailed(Exception):
    """The PE did not hand the sequence off. status None: no HTTP answer (unreachable or timed out)."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status


class PrefillClient:
    def __init__(
        self,
        url: str,
        token: bytes,
        timeout_s: float,
        connect_timeout_s: float = 5.0,
        on_state: Callable[[bool], None] | None = None,
        ssl_ca_certs: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.on_state = on_state  # told True/False when the PE comes up or goes down
        self._token = token
        self._ssl = client_ssl_context(ssl_ca_certs)  # used for an https URL only
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.state = "unknown"  # unknown | up | down | draining
        self.error: str | None = None  # why it is not up
        self.last_error: str | None = None  # the last failed prefill's, kept after it is up again
        self.num_inflight = 0  # /prefill requests in flight (pd/disagg/prefill_pool.py counts them)
        self.inflight_tokens = 0.0  # the work of their prompts (the kv-aware choice's load term)
        self.kv_events: list[dict[str, Any]] = []  # its ranks' KV event streams, as its /health last said
        self.source = self.url  # the --prefill-url entry it comes from (a dns+ name, or itself)
        self.retired = False  # gone from its dns+ name
        self.changed_s = time.monotonic()
        self._session: aiohttp.ClientSession | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._poke = asyncio.Event()

    @property
    def is_up(self) -> bool:
        return self.state == "up"

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S),
            json_serialize=lambda o: orjson.dumps(o).decode(),
        )
        self._watch_task = asyncio.create_task(watch(self._check, self._poke, HEALTH_EVERY_S))

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        if self._session is not None:
            await self._session.close()

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"url": self.url, "state": self.state, "inflight": self.num_inflight}
        if self.source != self.url:
            d["source"] = self.source
        if self.error:
            d["error"] = self.error
        if self.last_error:
            d["last_error"] = self.last_error
        return d

    async def prefill(self, body: PrefillBody, max_body_bytes: int | None = None) -> PrefillReply:
        """Raises PrefillFailed for anything but a completed handoff (or a request the PE finished);
        status 413, sending nothing, when the encoded body is over max_body_bytes."""
        assert self._session is not None
        data = orjson.dumps(to_wire(body))
        if max_body_bytes is not None and len(data) > max_body_bytes:
            raise PrefillFailed(
                "request_too_large",
                f"the request is {len(data)} bytes as a /prefill body, more than a prefill engine takes "
                f"({max_body_bytes})",
                status=413,
            )
        for attempt in range(2):
            headers = {  # signed anew each attempt: a signature's nonce is good once
                "Authorization": sign(self._token, "POST", "/prefill", data),
                "Content-Type": "application/json",
                HEADER: REQUEST_ID.get(),
            }
            try:
                async with self._session.post(
                    self.url + "/prefill", data=data, headers=headers, timeout=self.timeout, ssl=self._ssl
                ) as r:
                    raw = await r.read()
                    status = r.status
                break
            except asyncio.TimeoutError:
                self.last_error = "prefill_timeout"
                raise PrefillFailed(
                    "prefill_timeout",
                    f"the prefill engine at {self.url} did not answer within {self.timeout.total} s",
                ) from None
            except (aiohttp.ClientError, OSError) as e:
                if attempt == 0 and _is_reset(e):
                    # A pooled connection the PE closed (idle) just as it was reused: once more, anew.
                    # A PE that did read the request dropped it with the connection (its handler is
                    # cancelled), and a dead PE refuses the new connection.
                    log.info("connection to %s was reset (%s); sending again", self.url, type(e).__name__)
                    continue
                self.last_error = f"{type(e).__name__}: {e}"
                self._set("down", self.last_error)
                raise PrefillFailed(
                    "pe_unreachable", f"the prefill engine at {self.url} is unreachable: {e}"
                ) from None
        if status < 500:
            self._set("up", None)
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise PrefillFailed(
                "bad_response", f"the prefill engine answered {status} with no JSON", status
            ) from None
        if status != 200:
            err = answer.get("error", {}) if isinstance(answer, dict) else {}
            err = err if isinstance(err, dict) else {}
            failed = PrefillFailed(
                printable(err.get("code") or "prefill_failed", 64),
                printable(err.get("message") or raw[:200], MESSAGE_CHARS),
                status,
            )
            if status >= 500:
                self.last_error = f"{status} {failed.code}"
            if failed.code == DRAINING_CODE:  # left out at once; its probe sees it back
                self._set("draining", failed.message)
            raise failed
        try:
            return from_wire(PrefillReply, answer)
        except WireError as e:
            raise PrefillFailed(
                "bad_response", f"the prefill engine's answer does not decode: {e}", status
            ) from None

    def _set(self, state: str, error: str | None) -> None:
        changed = state != self.state
        self.state, self.error = state, error  # NOTE: before on_state, which reads the pool's states
        if changed:
            (log.info if state == "up" else log.warning)(
                "prefill engine %s is %s%s",
                self.url,
                state,
                f": {printable(error, MESSAGE_CHARS)}" if error else "",
            )
            self.changed_s = time.monotonic()
            if self.on_state is not None:
                self.on_state(state == "up")
            if state != "up":
                self._poke.set()  # probe again soon (with backoff) rather than at the next period

    async def _probe(self) -> tuple[str, str | None]:
        """(up | down | draining, why not up) from the PE's /health."""
        assert self._session is not None
        try:
            async with self._session.get(
                self.url + "/health", timeout=aiohttp.ClientTimeout(total=5.0), ssl=self._ssl
            ) as r:
                body = await r.read()
                if r.status == 200:
                    with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                        self.kv_events = list(orjson.loads(body).get("kv_events") or [])
                    return "up", None
                with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                    if orjson.loads(body).get("status") == "draining":
                        return "draining", "the prefill engine is shutting down"
                return "down", f"/health answered {r.status}: {body[:200]!r}"
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            return "down", f"{type(e).__name__}: {e}"

    async def _check(self) -> bool:
        """Probes /health (pd/disagg/membership.py watch: every HEALTH_EVERY_S while up, with backoff while
        not)."""
        self._set(*await self._probe())
        return self.is_up
