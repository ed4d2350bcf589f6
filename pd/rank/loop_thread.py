"""LoopThread: an asyncio loop in a daemon thread of a rank process (the KV sender or receiver runs
there), and the doorbell through which it hands news to the engine thread.

    engine thread                           loop thread
    ─────────────                           ───────────
    lt.submit(coro) ──────────────────────► runs coro
    poll(lt.wake) ◄── doorbell (inproc) ─── lt.post(item): item into lt.news, ring
    lt.news.get_nowait() ...

The engine is only ever touched on the engine thread: the loop thread posts, the engine thread acts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import zmq

T = TypeVar("T")


class LoopThread:
    def __init__(self, ctx: zmq.Context, name: str) -> None:
        self._addr = f"inproc://pd-wake-{uuid.uuid4().hex}"
        self.wake = ctx.socket(zmq.PULL)  # owned by the engine thread
        self.wake.bind(self._addr)
        self.news: queue.Queue[Any] = queue.Queue()
        self.loop = asyncio.new_event_loop()
        self._ctx = ctx
        self._ring: zmq.Socket | None = None  # owned by the loop thread
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._ring = self._ctx.socket(zmq.PUSH)
        self._ring.setsockopt(zmq.LINGER, 0)
        self._ring.connect(self._addr)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            self._ring.close(linger=0)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Runs coro on the loop (from any thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Runs coro on the loop and waits for its result (engine thread, start-up and shutdown only)."""
        return self.submit(coro).result(timeout_s)

    def post(self, item: Any) -> None:
        """Queues item for the engine thread and wakes it (from any thread)."""
        self.loop.call_soon_threadsafe(self._post, item)

    def _post(self, item: Any) -> None:
        self.news.put(item)
        assert self._ring is not None
        with contextlib.suppress(zmq.Again):  # doorbells pending already: the engine thread drains all
            self._ring.send(b"", zmq.NOBLOCK)

    def drain(self) -> list[Any]:
        """What the loop thread posted since the last drain (engine thread)."""
        items = []
        while True:
            try:
                items.append(self.news.get_nowait())
            except queue.Empty:
                return items

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
        self.wake.close(linger=0)
