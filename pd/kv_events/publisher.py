"""A rank's KV event publisher: ZeroMQ PUB (topic, sequence number, payload) and a ROUTER replay socket
that resends buffered batches from a sequence number (pd/kv_events/wire.py), on a thread of its own so
the engine's loop only hands it a list.

Ports: the configured endpoint's port + the rank (vLLM offsets by the data-parallel rank). The sockets
bind (vLLM connects unless the host is a wildcard; a publisher here always binds). On a loopback
address anything on the host may subscribe; any other address needs the cluster token: the sockets are
ZeroMQ CURVE servers whose key pair is derived from the token (curve_keys), so a subscriber that cannot
derive the server's public key from the token cannot complete the handshake and gets nothing.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import queue
import threading
from collections import deque

import zmq
from zmq.utils import z85

from engine.config import KVEventsConfig
from engine.core.kv_events import KVEvent
from pd.kv_events.wire import END_SEQ, encode_batch, seq_bytes

log = logging.getLogger(__name__)
_KEY_CONTEXT = b"pdserve-kv-events-curve-v1\x00"


def offset_endpoint(endpoint: str, rank: int) -> str:
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


def endpoint_host(endpoint: str) -> str:
    return endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")


def is_loopback(endpoint: str) -> bool:
    host = endpoint_host(endpoint)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", a name, an interface
        return False


def curve_keys(token: bytes) -> tuple[bytes, bytes]:
    """(public, secret), Z85: the publishers' CURVE key pair, a function of the cluster token only."""
    secret = z85.encode(hashlib.sha256(_KEY_CONTEXT + token).digest())
    return zmq.curve_public(secret), secret


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, rank: int, token: bytes | None, ctx: zmq.Context | None = None) -> None:
        """token: the cluster token (needed where an endpoint is not loopback: ValueError without it)."""
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.replay_endpoint = None if config.replay_endpoint is None else offset_endpoint(config.replay_endpoint, rank)
        self.rank = rank
        self._topic = config.topic.encode()
        self._ctx = ctx or zmq.Context.instance()
        exposed = [e for e in (self.endpoint, self.replay_endpoint) if e is not None and not is_loopback(e)]
        if exposed and token is None:
            raise ValueError(
                f"--kv-events-config: {exposed[0]} is not a loopback address and the stream carries prompt "
                "tokens: set the cluster token (PDSERVE_CLUSTER_TOKEN) so that only its holders can subscribe"
            )
        keys = None if token is None or not exposed else curve_keys(token)
        self._pub = self._socket(zmq.PUB, self.endpoint, keys)
        self._pub.set_hwm(config.hwm)
        self._replay = None if self.replay_endpoint is None else self._socket(zmq.ROUTER, self.replay_endpoint, keys)
        self._queue: queue.Queue[list[KVEvent] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self.num_dropped = 0  # batches the full queue refused (a consumer then sees a gap and replays)
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{rank}", daemon=True)
        self._thread.start()
        log.info("rank %d publishes KV events on %s (replay %s)", rank, self.endpoint, self.replay_endpoint)

    def _socket(self, kind: int, endpoint: str, keys: tuple[bytes, bytes] | None) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            s.curve_server = True
            s.curve_publickey, s.curve_secretkey = keys
        try:
            s.bind(endpoint)
        except zmq.ZMQError as e:
            s.close()
            raise ValueError(f"--kv-events-config: cannot bind {endpoint}: {e}") from None
        return s

    def publish(self, events: list[KVEvent]) -> None:
        """Hands a batch to the thread (never blocks the engine: a full queue drops it, counted)."""
        if not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.num_dropped += 1

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = encode_batch(events, self.rank)
            self._pub.send_multipart((self._topic, seq_bytes(self._seq), payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV event replay: a request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq_bytes(seq), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
