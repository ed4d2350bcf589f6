"""Faults of the P/D pair (SmolLM2-135M, TCP): after each one both sides' pools are back to idle and the
next request succeeds.

- a real pair (CE with a small KV pool and a queue limit of 1; the PE prefills in chunks of 128 tokens,
  so a long prompt's handoff streams): abort while the PE prefills, abort while the handoff streams,
  abort while decoding, abort while waiting for CE memory (and 429 past the queue limit), the PE killed
  while its handoff streams (an error, never a hang; the CE sees the restarted PE and serves again);
- the real PE driven directly: its lease runs out on a receiver that never acks; the caller aborts
  while the KV is in transfer;
- a second CE whose "PE" is a proxy in this process, which forwards to the real PE or misbehaves: a
  PE that dies mid-transfer, a corrupted payload (checksum), a header for another model, a PE that
  never answers (the CE's wait runs out and its reservation is released).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import math
import os
import signal
import socket
import threading
import time
from typing import Any

import aiohttp
import orjson
import pytest
import torch
from aiohttp import web
from openai import APIStatusError

from engine.checkpoints import resolve_model
from engine.codec import from_wire
from engine.core.kv_cache import layout_of
from engine.handoff import SequenceExport
from engine.models.registry import arch_from_hf, load_hf_config
from pd.messages import PrefillBody
from pd.tools.server_process import (
    PDPair,
    ServerProcess,
    free_port,
    get_json,
    rank_metrics,
    signed_headers,
    wait_idle,
)
from tests.server_fixtures import openai_client
from transfer.auth import client_handshake
from transfer.config import TransferConfig
from transfer.header import allocate_payload, make_header, model_fingerprint, payload_segments
from transfer.messages import ControlMessage, Nack, Offer, Ready
from transfer.receiver import KVReceiver
from transfer.tcp import TcpTransport, byte_view
from transfer.wire import Channel

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
ARGS = ("--model", MODEL, "--deterministic", "--max-model-len", "2048", "--max-num-seqs", "8")
LONG = "Background: " + " ".join(f"Fact {i}: the value of item {i} is {i * 7 % 13}." for i in range(105))
HI = [{"role": "user", "content": "Hi"}]


# ---- a PE stand-in: forwards to the real PE, or misbehaves ------------------------------------------


class FakePE:
    """/prefill and /health on a free port, served by a thread of this process. mode "proxy" forwards
    to the real PE; the others send a synthetic handoff of the right shape to the CE's receiver and
    break it in one way, or never answer."""

    def __init__(self, real_url: str, token: str) -> None:
        self.real_url = real_url
        self.token = token.encode()
        self.mode = "proxy"
        self.port = free_port()
        self.replies: list[ControlMessage | None] = []  # the CE receiver's answers (None: cut short)
        folder = resolve_model(MODEL)
        self.layout = layout_of(arch_from_hf(load_hf_config(folder)), 128, torch.float32)
        self.model = model_fingerprint(folder)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakePE:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/prefill", self.prefill)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": "pe"})

    async def prefill(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        mode = self.mode
        if mode == "proxy":
            auth = {"Authorization": request.headers.get("Authorization", "")}
            async with (
                aiohttp.ClientSession() as s,
                s.post(self.real_url + "/prefill", data=raw, headers=auth) as r,
            ):
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        if mode == "silent":
            await asyncio.sleep(3600)
        body = from_wire(PrefillBody, json.loads(raw))
        token = self.token
        export = self._export(body)
        header = make_header(export, self.layout, self.model)
        if mode == "corrupt":
            header = dataclasses.replace(header, checksum=header.checksum ^ 1)
        elif mode == "layout":
            header = dataclasses.replace(header, model="sha256:another-model")
        payload = b"".join(byte_view(t).numpy().tobytes() for t in payload_segments(export, self.layout))
        reply = await self._offer(body.receiver, header.encode(), payload, token, cut=mode == "die")
        self.replies.append(reply)
        if mode == "die":  # the PE process is gone: its HTTP connection drops too
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(1)
        nack = reply if isinstance(reply, Nack) else None
        return web.json_response(
            {
                "error": {
                    "message": str(nack.reason if nack else None),
                    "type": "server_error",
                    "param": None,
                    "code": nack.code if nack else None,
                }
            },
            status=502,
        )

    def _export(self, body: PrefillBody) -> SequenceExport:
        prompt = list(body.prompt_token_ids)
        lo = self.layout
        num_pages = math.ceil(len(prompt) / lo.block_size)
        pages = torch.randn((num_pages, lo.num_full_layers, 2, lo.block_size, lo.num_kv_heads, lo.head_dim))
        return SequenceExport(body.request_id, prompt, [28], len(prompt), body.params, 0, pages, None)

    async def _offer(
        self, addr: str, header: bytes, payload: bytes, token: bytes, cut: bool
    ) -> ControlMessage | None:
        host, port = addr.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        ch = Channel(sock, addr)
        try:
            await client_handshake(ch, token, "fake-pe")
            await ch.send(Offer("tcp", header))
            reply = await ch.recv()
            if not isinstance(reply, Ready):
                return reply
            if cut:
                await asyncio.get_running_loop().sock_sendall(sock, payload[: len(payload) // 2])
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )  # RST
                return None
            await asyncio.get_running_loop().sock_sendall(sock, payload)
            return await ch.recv()
        finally:
            ch.close()


# ---- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(pair, fault_ce, fake_pe, fallback_ce): a real pair; a CE whose PE is the FakePE in front of the
    real PE; a CE with --fallback-local-prefill and no PE."""
    logs = tmp_path_factory.mktemp("pd_faults")
    pair = PDPair(
        *ARGS,
        log_dir=logs,
        pe_args=("--kv-cache-gb", "0.25", "--handoff-lease-s", "20", "--max-num-batched-tokens", "128"),
        ce_args=("--kv-cache-gb", "0.1", "--max-queued-requests", "1", "--queue-timeout-s", "120"),
    )
    pair.start()
    try:
        with FakePE(pair.pe.url, pair.token) as fake:
            fault_ce = ServerProcess(
                "--role",
                "ce",
                *ARGS,
                "--kv-cache-gb",
                "0.1",
                "--prefill-url",
                fake.url,
                "--kv-port-base",
                str(free_port()),
                "--prefill-timeout-s",
                "6",
                log_path=logs / "fault_ce.log",
                env=pair.env,
            )
            fallback_ce = ServerProcess(  # its PE is nowhere: it prefills everything itself
                "--role",
                "ce",
                *ARGS,
                "--kv-cache-gb",
                "0.1",
                "--prefill-url",
                f"http://127.0.0.1:{free_port()}",
                "--kv-port-base",
                str(free_port()),
                "--fallback-local-prefill",
                log_path=logs / "fallback_ce.log",
                env=pair.env,
            )
            try:
                fault_ce.start()
                fallback_ce.start()
                pair.wait_ready()
                fault_ce.wait_ready()
                fallback_ce.wait_ready()
                yield pair, fault_ce, fake, fallback_ce
            finally:
                for s in (fallback_ce, fault_ce, pair):
                    s.terminate()  # all at once: each drains and stops its ranks in parallel
                fallback_ce.stop()
                fault_ce.stop()
    finally:
        pair.stop()


def ask(url: str, content: str = "Hi", max_tokens: int = 4) -> str:
    r = openai_client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    return r.choices[0].message.content or ""


def idle(*ports: int) -> None:
    for port in ports:
        wait_idle(port, timeout_s=60)


class RawStream:
    """A streaming chat request on a raw connection, so the test decides when the client goes away."""

    def __init__(self, url: str, messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=300)
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True, **extra}
        self.conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        self.resp: http.client.HTTPResponse | None = None

    def response(self) -> http.client.HTTPResponse:
        if self.resp is None:
            self.resp = self.conn.getresponse()
        return self.resp

    def read_chunks(self, n: int) -> list[str]:
        lines: list[str] = []
        resp = self.response()
        assert resp.status == 200, resp.read()
        while len(lines) < n:
            line = resp.readline().decode().strip()
            if line.startswith("data: "):
                lines.append(line)
        return lines

    def close(self) -> None:
        """The client goes away (RST, like a killed process)."""
        sock = self.conn.sock
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        self.conn.close()


def wait_for(pred: Any, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---- aborts in every phase (real pair) ---------------------------------------------------------------


def pe_has_it(pair: PDPair) -> bool:
    """The PE's server has handed a /prefill to its rank (its own count, not the rank's stats)."""
    return rank_metrics(pair.pe.port).get("pdserve_num_requests_inflight", 0) > 0


def pe_streams(pair: PDPair) -> bool:
    """The PE has opened a streamed handoff (pages of the prompt sent, its prefill not done)."""
    return rank_metrics(pair.pe.port).get("pdserve_engine_num_handoffs_streaming", 0) > 0


def test_abort_while_the_handoff_streams(cluster):
    """The client goes away after the PE began sending pages of a prompt it still prefills: both sides
    free everything (the CE's reservation and the blocks it held: wait_idle) and nothing is handed off."""
    pair = cluster[0]
    time.sleep(1.5)  # an idle rank's stats are at most a heartbeat (1 s) old
    sent = rank_metrics(pair.pe.port)["pdserve_engine_handoffs_sent_total"]
    s = RawStream(pair.url, [{"role": "user", "content": "Stream. " + LONG}], 8, temperature=0)
    wait_for(lambda: pe_streams(pair), 60, "the PE to stream the handoff")
    s.close()
    idle(pair.ce.port, pair.pe.port)
    time.sleep(1.5)
    assert rank_metrics(pair.pe.port)["pdserve_engine_handoffs_sent_total"] == sent
    assert ask(pair.url)


def test_abort_while_the_pe_prefills(cluster):
    pair = cluster[0]
    time.sleep(1.5)  # an idle rank's stats are at most a heartbeat (1 s) old
    sent = rank_metrics(pair.pe.port)["pdserve_engine_handoffs_sent_total"]
    s = RawStream(pair.url, [{"role": "user", "content": LONG}], 8, temperature=0)
    wait_for(lambda: pe_has_it(pair), 60, "the PE to take the request")
    s.close()  # a ~1700-token prefill is under way on the PE
    idle(pair.ce.port, pair.pe.port)
    time.sleep(1.5)
    assert rank_metrics(pair.pe.port)["pdserve_engine_handoffs_sent_total"] == sent
    assert ask(pair.url)


def test_aborts_while_the_pe_prefills_leave_no_task_pending(cluster):
    """Found by tests/pd/api/test_fuzz_requests.py: a request cancelled while the CE waits for the PE's
    answer (DecodePath._while_prefilling) left that wait's events.get() task pending, and asyncio logged
    "Task was destroyed but it is pending!" when the garbage collector found it (now cancelled with it). Several aborts, then
    requests that let the collector run."""
    pair = cluster[0]
    assert pair.ce.log_path is not None
    offset = pair.ce.log_path.stat().st_size
    for i in range(3):  # a prompt of its own each: no prefix cache shortens the PE's prefill
        s = RawStream(pair.url, [{"role": "user", "content": f"Run {i}. {LONG}"}], 8, temperature=0)
        wait_for(lambda: pe_has_it(pair), 60, "the PE to take the request")
        s.close()
        idle(pair.ce.port, pair.pe.port)
    for _ in range(3):
        assert ask(pair.url)
    with open(pair.ce.log_path, "rb") as f:
        f.seek(offset)
        log = f.read().decode(errors="replace")
    assert "was destroyed but it is pending" not in log and "Traceback" not in log, log


def test_abort_while_decoding(cluster):
    pair = cluster[0]
    s = RawStream(pair.url, HI, 1000, temperature=0, ignore_eos=True)
    s.read_chunks(3)
    assert rank_metrics(pair.ce.port)["pdserve_num_requests_running"] == 1
    s.close()
    idle(pair.ce.port, pair.pe.port)
    assert ask(pair.url)


def test_abort_while_waiting_for_decode_memory_and_queue_limit(cluster):
    pair = cluster[0]
    # the CE pool holds 18 pages: A commits 16 of them for its whole decode, so B must wait for A,
    # and C finds the queue (limit 1) full
    a = RawStream(pair.url, HI, 1950, temperature=0, ignore_eos=True)
    a.read_chunks(2)
    b = RawStream(pair.url, HI, 600, temperature=0)
    wait_for(
        lambda: rank_metrics(pair.ce.port).get("pdserve_engine_num_reservations_waiting", 0) == 1,
        30,
        "B to wait",
    )
    with pytest.raises(APIStatusError) as e:
        ask(pair.url)
    assert e.value.status_code == 429 and "full" in e.value.message
    text = urllib_text(pair.url + "/metrics")
    assert 'pdserve_reservations_inflight{state="waiting"} 1.0' in text
    b.close()
    wait_for(
        lambda: rank_metrics(pair.ce.port).get("pdserve_engine_num_reservations_waiting", 0) == 0,
        30,
        "B to go",
    )
    a.close()
    idle(pair.ce.port, pair.pe.port)
    assert ask(pair.url)


def urllib_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_pe_killed_while_its_handoff_streams_then_back(cluster):
    pair = cluster[0]
    s = RawStream(pair.url, [{"role": "user", "content": "Again. " + LONG}], 8, temperature=0)
    wait_for(lambda: pe_streams(pair), 60, "the PE to stream the handoff")
    assert pair.pe.proc is not None
    os.killpg(pair.pe.proc.pid, signal.SIGKILL)
    resp = s.response()  # an error, not a hang
    assert resp.status in (502, 503), resp.status
    assert json.loads(resp.read())["error"]["code"] in ("prefill_unavailable", "pe_unreachable")
    s.close()
    idle(pair.ce.port)
    with pytest.raises(APIStatusError) as e:
        ask(pair.url)
    assert e.value.status_code == 503
    status, health = get_json(pair.url + "/health")
    assert status == 200 and health["status"] == "degraded" and health["prefill_engines"][0]["state"] == "down"
    pair.restart_pe()  # the CE's health check (with backoff) sees it come back
    assert ask(pair.url)
    idle(pair.ce.port, pair.pe.port)


def wait_ok(server: ServerProcess, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        status, health = get_json(server.url + "/health")
        if status == 200 and health["status"] == "ok" or time.monotonic() > deadline:
            return health
        time.sleep(0.3)


@pytest.mark.parametrize("side", ["ce", "pe"])
def test_a_killed_rank_is_restarted_and_the_pair_serves_through_it(cluster, side):
    """A rank of either side killed mid-request: that request fails (503), the server restarts the
    rank, and the pair serves through the new process (the PE reconnects to the CE rank's new KV
    receiver; the CE uses the PE's new rank)."""
    pair = cluster[0]
    ask(pair.url)  # the PE holds a kept-alive KV connection to the CE rank's receiver now
    server = pair.ce if side == "ce" else pair.pe
    old = server.rank_pids()[0]
    if side == "ce":  # mid-decode: the stream has begun, its end is an error event
        stream = RawStream(pair.url, HI, 400, temperature=0, ignore_eos=True)
        stream.read_chunks(2)
        os.kill(old, signal.SIGKILL)
        rest = stream.response().read().decode()
        assert "engine_down" in rest and "[DONE]" not in rest, rest[-500:]  # in-band error, no [DONE]
    else:  # mid-prefill: the request fails before its first token
        stream = RawStream(pair.url, [{"role": "user", "content": "Once more. " + LONG}], 8, temperature=0)
        wait_for(lambda: pe_has_it(pair), 60, "the PE to take the request")
        os.kill(old, signal.SIGKILL)
        resp = stream.response()
        assert resp.status == 503 and json.loads(resp.read())["error"]["code"] == "engine_down"
    stream.close()
    health = wait_ok(server)
    assert health["status"] == "ok" and health["ranks"][0]["num_restarts"] >= 1, health
    assert server.rank_pids()[0] != old
    pair.wait_pe_seen()
    assert ask(pair.url, "Hi again")
    assert rank_metrics(server.port)["pdserve_rank_restarts_total"] >= 1
    idle(pair.ce.port, pair.pe.port)


# ---- the real PE driven directly: lease and abort in transfer -----------------------------------------


def stalled(transport_cls: Any) -> Any:
    """A receiver's transport_cls that takes the offer and sends ready, then never finishes its pull
    (`pulling` is set when it starts)."""

    class Stall(transport_cls):  # type: ignore[misc, valid-type]
        def __init__(self, config: TransferConfig) -> None:
            super().__init__(config)
            self.pulling = asyncio.Event()

        async def pull(self, ch: Any, header: Any, extra: Any, segments: Any, **kw: Any) -> int | None:
            self.pulling.set()
            await asyncio.sleep(3600)
            return None

    return Stall


StallTransport = stalled(TcpTransport)


@contextlib.asynccontextmanager
async def stalling_receiver(pair: PDPair, stall_cls: Any = StallTransport, name: str = "tcp"):
    """A KVReceiver for the pair's model whose transport `name` is stall_cls (its pull never returns:
    `pulling` is set when it starts)."""
    folder = resolve_model(MODEL)
    layout = layout_of(arch_from_hf(load_hf_config(folder)), 128, torch.float32)
    config = TransferConfig(idle_timeout_s=600, handshake_timeout_s=30)
    stall = stall_cls(config)
    r = KVReceiver(
        pair.token.encode(),
        layout,
        lambda h: allocate_payload(h),
        lambda h, e: None,
        model=model_fingerprint(folder),
        config=config,
        transports={name: stall},
    )
    try:
        async with r:
            yield r, stall
    finally:
        stall.close()


def prefill_body(receiver: str, lease_s: float) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))
    return {
        "request_id": f"direct-{time.monotonic_ns()}",
        "prompt_token_ids": tok(LONG)["input_ids"][:600],
        "params": {"max_tokens": 8, "temperature": 0.0},
        "receiver": receiver,
        "lease_s": lease_s,
    }


async def test_bad_prefill_body_is_a_400_naming_the_field(cluster):
    pair = cluster[0]
    good = prefill_body("127.0.0.1:1", 3.0)
    async with aiohttp.ClientSession() as s:
        for body, param in (
            ({**good, "params": {"max_tokens": 8, "top_k": True}}, "params.top_k"),  # a bool for an int
            ({**good, "prompt_token_ids": "1 2 3"}, "prompt_token_ids"),  # a string for a list
            ({**good, "lease": 3.0}, "lease"),  # an unknown field
            ({k: v for k, v in good.items() if k != "receiver"}, "receiver"),  # a missing field
            ({**good, "seed": -1}, "seed"),  # values the engine must never compute with
            ({**good, "params": {"max_tokens": 8, "seed": 2**64 - 1}}, "params.seed"),
            ({**good, "params": {"max_tokens": 8, "stop_token_ids": [-5]}}, "params.stop_token_ids"),
            ({**good, "params": {"max_tokens": 8, "logprobs": 21}}, "params.top_logprobs"),
            # past the PE's own --max-body-bytes (4 MiB) yet within what a CE may forward: read, not a 413
            ({**good, "prompt_token_ids": "1 " * (5 << 19)}, "prompt_token_ids"),
        ):
            data = orjson.dumps(body)
            async with s.post(pair.pe.url + "/prefill", data=data, headers=signed_headers(pair.token, data)) as resp:
                got = await resp.json()
            assert resp.status == 400 and got["error"]["param"] == param, got
    await asyncio.to_thread(idle, pair.pe.port)


def test_tiny_temperature_does_not_take_the_pe_down(cluster):
    """The PE samples the first token: temperature 1e-300 made its rank die (multinomial on inf/NaN)
    and every later request get a 503. It is greedy now; both sides keep serving."""
    pair = cluster[0]
    client = openai_client(pair.url)
    for temperature in (1e-300, 1e-40):
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=temperature)
        assert r.choices[0].finish_reason in ("stop", "length")
    ask(pair.url)
    idle(pair.ce.port, pair.pe.port)


def test_a_grammar_quoting_a_cuda_error_leaves_both_sides_up(cluster):
    """A grammar refused for allowing no first token, and one that fails on the CE a token after the
    handoff: their library errors quote "CUDA error" from the grammar, which once ended the PE's or the
    CE's rank (issue 29). Each request fails alone; neither side's ranks are restarted."""
    pair = cluster[0]
    pids = (pair.pe.rank_pids(), pair.ce.rank_pids())
    client = openai_client(pair.url)
    with pytest.raises(APIStatusError) as e:
        client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=8,
            extra_body={"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]CUDA error"}},
        )
    assert e.value.status_code == 400
    with pytest.raises(APIStatusError):
        client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=8,
            extra_body={"structured_outputs": {"grammar": 'start: "a" x\nx: /[^\\x00-\\U0010FFFF]CUDA error/'}},
        )
    assert (pair.pe.rank_pids(), pair.ce.rank_pids()) == pids
    ask(pair.url)
    idle(pair.ce.port, pair.pe.port)


async def test_pe_lease_expires_on_a_receiver_that_never_acks(cluster):
    pair = cluster[0]
    async with stalling_receiver(pair) as (r, stall):
        data = orjson.dumps(prefill_body(r.address, 3.0))
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(pair.pe.url + "/prefill", data=data, headers=signed_headers(pair.token, data)) as resp:
                body = await resp.json()
            assert stall.pulling.is_set()
            assert resp.status == 502 and body["error"]["code"] == "timeout", body
            assert time.monotonic() - t0 < 120
    await asyncio.to_thread(idle, pair.pe.port)
    assert rank_metrics(pair.pe.port)["pdserve_engine_handoff_failures_total"] >= 1


async def test_abort_while_the_kv_is_in_transfer(cluster):
    pair = cluster[0]
    async with stalling_receiver(pair) as (r, stall):
        data = orjson.dumps(prefill_body(r.address, 600.0))
        async with aiohttp.ClientSession() as s:
            post = asyncio.create_task(
                s.post(pair.pe.url + "/prefill", data=data, headers=signed_headers(pair.token, data))
            )
            await asyncio.wait_for(stall.pulling.wait(), 120)

            def in_transfer() -> bool:  # the rank's metrics are as old as its last heartbeat
                m = rank_metrics(pair.pe.port)
                return m["pdserve_engine_num_handoffs_inflight"] == 1 and m["pdserve_kv_free_blocks"] < m["pdserve_kv_total_blocks"]

            await asyncio.to_thread(wait_for, in_transfer, 30, "the PE's metrics to show the handoff in flight")
            post.cancel()  # the caller goes away mid-transfer
            with contextlib.suppress(asyncio.CancelledError):
                await post
        await asyncio.to_thread(idle, pair.pe.port)  # the PE freed the sequence without an ack


# ---- a misbehaving PE in front of a second CE ------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, status, code",
    [
        ("die", 503, "prefill_unavailable"),  # mid-transfer: the payload is cut and the PE's connection drops
        ("corrupt", 502, "checksum"),
        ("layout", 502, "layout"),
        ("silent", 504, "prefill_timeout"),  # nothing arrives: the CE stops waiting, frees the reservation
    ],
)
def test_broken_handoffs_are_refused(cluster, mode, status, code):
    pair, fault_ce, fake = cluster[:3]
    assert ask(fault_ce.url)  # the proxy works: a real handoff from the real PE
    before = rank_metrics(fault_ce.port)
    fake.mode = mode
    try:
        with pytest.raises(APIStatusError) as e:
            openai_client(fault_ce.url, 60).chat.completions.create(
                model=MODEL, messages=HI, max_tokens=4, temperature=0
            )
    finally:
        fake.mode = "proxy"
    assert (e.value.status_code, e.value.code) == (status, code)
    idle(fault_ce.port, pair.pe.port)
    counter = {"die": "failed", "corrupt": "failed", "layout": "refused"}.get(mode)
    if counter is not None:  # the receiver counted it (stats reach /metrics within a heartbeat)
        key = f"pdserve_engine_handoffs_{counter}_total"
        wait_for(lambda: rank_metrics(fault_ce.port)[key] > before[key], 10, key)
    imported = "pdserve_engine_handoffs_imported_total"
    assert rank_metrics(fault_ce.port)[imported] == before[imported]  # nothing broken was ever decoded
    assert ask(fault_ce.url)


def test_abort_while_waiting_for_the_pe(cluster):
    pair, fault_ce, fake = cluster[:3]
    fake.mode = "silent"
    try:
        s = RawStream(fault_ce.url, HI, 4, temperature=0)
        wait_for(
            lambda: rank_metrics(fault_ce.port).get("pdserve_engine_num_reservations_held", 0) == 1,
            30,
            "the reservation",
        )
        s.close()
        idle(fault_ce.port)
    finally:
        fake.mode = "proxy"
    assert ask(fault_ce.url)


def test_fallback_local_prefill(cluster):
    pair, fallback_ce = cluster[0], cluster[3]
    status, health = get_json(fallback_ce.url + "/health")
    assert status == 200 and health["prefill_engines"][0]["state"] == "down" and health["status"] == "ok"
    question = "What is two plus two?"
    assert ask(fallback_ce.url, question, 6) == ask(pair.url, question, 6)  # same tokens, prefilled on the CE
    assert 'pdserve_local_prefills_total{reason="fallback"} 1.0' in urllib_text(fallback_ce.url + "/metrics")
    idle(fallback_ce.port, pair.ce.port, pair.pe.port)
