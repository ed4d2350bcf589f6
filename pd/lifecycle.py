"""Admission and drain: how many requests are in flight, and whether new ones are still taken.

SIGTERM (or SIGINT) starts the drain: from then on `/v1/*` and `/prefill` answer 503 with
`Retry-After`, `/health` and `/health/ready` answer 503 "draining", and the server waits for the
requests in flight (streams included) to end, for at most --shutdown-timeout seconds, before it stops
its engine ranks. A second signal ends the wait at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import NoReturn

from pd.errors import ApiError

RETRY_AFTER_S = 5  # what a client drained away is told to wait before it retries elsewhere


class Admission:
    def __init__(self) -> None:
        self.num_inflight = 0
        self.draining_since: float | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def is_draining(self) -> bool:
        return self.draining_since is not None

    def admit(self) -> None:
        """Counts a request in; raises 503 (Retry-After) while draining. Pair with `done`."""
        if self.is_draining:
            raise draining_error()
        self.num_inflight += 1
        self._idle.clear()

    def done(self) -> None:
        self.num_inflight -= 1
        if self.num_inflight == 0:
            self._idle.set()

    def drain(self) -> None:
        if self.draining_since is None:
            self.draining_since = time.monotonic()

    async def wait_idle(self, timeout_s: float, interrupt: asyncio.Event | None = None) -> bool:
        """True when no request is in flight; False when timeout_s passed (or `interrupt` was set)
        first."""
        waits = {asyncio.ensure_future(self._idle.wait())}
        if interrupt is not None:
            waits.add(asyncio.ensure_future(interrupt.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._idle.is_set()


DRAINING_CODE = "shutting_down"  # the error code of a request refused while the server drains


def draining_error() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down and takes no new requests; retry on another server",
        type="server_error",
        code=DRAINING_CODE,
    )


def exit_now(code: int) -> NoReturn:
    """Ends the process without the interpreter's teardown, which takes over a second once torch is
    loaded (a server's stop waits for it, twice: its ranks, then itself). Call it only once everything
    is closed; the logs are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
