"""What a client can do to one server, and how the server holds: the API key, TLS, request ids,
duplicate ids, idle and trickling connections, slow bodies, oversized headers, a connection flood, deep
JSON, a maximal prompt rendered while another stream runs, and SIGTERM during a stream (the drain).

One real server (the default model) serves the whole module; the drain test stops it, so it runs last.
Every loop is bounded in count and time; only loopback addresses are used.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import orjson
import pytest

from pd.tools.server_process import ServerProcess, get_json, group_alive

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
API_KEY = "sk-hardening-test-key-0123"
HI = [{"role": "user", "content": "Hi"}]
MAX_BODY = 1_200_000  # the largest body this module's server takes (a "maximal prompt" fills it)


def _self_signed(folder: Path) -> tuple[str, str] | None:
    """(certificate, key) for 127.0.0.1 made by the openssl command, or None without it."""
    if shutil.which("openssl") is None:
        return None
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("hardening")
    tls = _self_signed(folder)
    tls_args = ("--ssl-certfile", tls[0], "--ssl-keyfile", tls[1]) if tls else ()
    args = ("--model", MODEL, "--max-model-len", "2048", "--kv-cache-gb", "0.25", "--max-num-seqs", "16")
    limits = ("--timeout-keep-alive", "1", "--body-timeout", "1", "--http-max-connections", "12")
    limits += ("--max-body-bytes", str(MAX_BODY))
    env = {**os.environ, "PDSERVE_API_KEY": API_KEY}
    with ServerProcess(
        *args,
        *limits,
        *tls_args,
        "--access-log",
        "--shutdown-timeout",
        "60",
        log_path=folder / "server.log",
        env=env,
        ssl_ca=tls[0] if tls else None,
    ) as s:
        yield s


def client(server: ServerProcess, api_key: str = API_KEY) -> openai.OpenAI:
    http = openai.DefaultHttpxClient(verify=server.ssl_context or True, timeout=300)
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, http_client=http)


def raw(server: ServerProcess) -> socket.socket:
    """A connection to the server (TLS-wrapped when it serves https)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if server.ssl_context is not None:
        return server.ssl_context.wrap_socket(sock, server_hostname="127.0.0.1")
    return sock


def post(server: ServerProcess, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict, dict]:
    """(status, JSON body, headers with lower-case names)."""
    req = urllib.request.Request(
        server.url + path, data=body, method="POST", headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(req, timeout=120, context=server.ssl_context) as r:
            return r.status, orjson.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read()), {k.lower(): v for k, v in e.headers.items()}


def chat_body(**extra: object) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": HI, "max_tokens": 2, **extra})


def read_all(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (bounded by timeout_s), and when it closed."""
    sock.settimeout(timeout_s)
    t0, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError, ssl.SSLError):
        pass
    return data, time.monotonic() - t0




def test_api_key_required_on_v1_only(server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, body, _ = post(server, "/v1/chat/completions", chat_body(), headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    r = client(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert r.choices[0].message.content is not None
    assert post(server, "/v1/chat/completions", chat_body(), auth)[0] == 200
    # /invocations generates as /v1/* does, /tokenizer_info tells what /tokenize does: keyed too
    assert post(server, "/invocations", chat_body(), {})[0] == 401
    assert post(server, "/invocations", chat_body(), auth)[0] == 200
    assert get_json(server.url + "/tokenizer_info", context=server.ssl_context)[0] == 401
    for path in ("/health", "/health/live", "/health/ready", "/metrics", "/load"):  # probes need no key
        with urllib.request.urlopen(server.url + path, timeout=10, context=server.ssl_context) as r:
            assert r.status == 200, path
    status, health = get_json(server.url + "/health", context=server.ssl_context)
    assert "pid" not in str(health) and "/" not in str(health["ranks"])  # no pids, no paths


def test_header_bytes_that_are_not_utf8_are_a_4xx(server):
    body = chat_body()
    auth = f"Authorization: Bearer {API_KEY}\r\n".encode()
    for header, expected in (
        (b"Authorization: Bearer \xff\xfe\x80\r\n", 401),
        (auth + b"X-Request-Id: \xff\xfe\x80\r\n", 400),
        (auth + b"X-Anything: \xff\xfe\x80\r\n", 200),
    ):
        sock = raw(server)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + header
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        data, _ = read_all(sock, 30)
        assert int(data.split(b" ", 2)[1]) == expected, data[:300]


def test_request_id_taken_or_made_and_logged(server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    status, body, headers = post(
        server, "/v1/chat/completions", chat_body(), {**auth, "X-Request-Id": "trace-42.a"}
    )
    assert status == 200 and headers["x-request-id"] == "trace-42.a" and body["id"] == "chatcmpl-trace-42.a"
    status, body, headers = post(server, "/v1/chat/completions", chat_body(), auth)
    assert status == 200 and len(headers["x-request-id"]) == 32
    for bad in ("has space", "x" * 129, "semi;colon"):
        status, body, _ = post(server, "/v1/chat/completions", chat_body(), {**auth, "X-Request-Id": bad})
        assert status == 400 and body["error"]["code"] == "invalid_request_id", body
    deadline = time.monotonic() + 10
    while "trace-42.a" not in server.log_tail(200000):  # the access log line carries the id
        assert time.monotonic() < deadline
        time.sleep(0.2)
    line = next(x for x in server.log_tail(200000).splitlines() if "trace-42.a" in x and "pd.server.access" in x)
    assert "POST /v1/chat/completions" in line and " 200 " in line


def test_duplicate_request_id_in_flight_is_a_409(server):
    c = client(server)
    stream = c.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=40,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": "dup-1"},
    )
    next(iter(stream))  # the first is in flight
    with pytest.raises(openai.ConflictError) as e:
        c.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2, extra_headers={"X-Request-Id": "dup-1"}
        )
    assert e.value.body["code"] == "duplicate_request_id"
    assert sum(1 for _ in stream) > 0
    r = c.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, extra_headers={"X-Request-Id": "dup-1"}
    )
    assert r.id == "chatcmpl-dup-1"  # free again once the first ended


def test_idle_and_trickling_connections_are_closed(server):
    idle = raw(server)
    data, waited = read_all(idle, 15)
    assert data == b"" and waited < 5, waited  # --timeout-keep-alive 1
    trickle = raw(server)
    t0 = time.monotonic()
    closed = False
    for ch in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
        try:
            trickle.sendall(bytes([ch]))
        except OSError:
            closed = True
            break
        time.sleep(0.2)
        if time.monotonic() - t0 > 8:
            break
    if not closed:
        data, _ = read_all(trickle, 5)
        closed = data == b""
    assert closed and time.monotonic() - t0 < 12


def test_slow_body_is_a_408_and_large_headers_a_431(server):
    sock = raw(server)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: 1000\r\n\r\n".encode()
        + b'{"model": '
    )
    data, waited = read_all(sock, 15)
    assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data and waited < 6, data[:300]
    for headers in ({"X-Big": "a" * 10000}, {f"X-H{i}": "1" for i in range(200)}):
        status, body, _ = post(server, "/v1/chat/completions", chat_body(), headers)
        assert status == 431 and body["error"]["code"] == "request_header_fields_too_large", body
    status, body, _ = post(
        server, "/v1/chat/completions", b"x" * (5 << 20), {"Authorization": f"Bearer {API_KEY}"}
    )
    assert status == 413


def test_connection_flood_gets_503_and_the_server_serves_after(server):
    held = [raw(server) for _ in range(12)]
    try:
        time.sleep(0.2)
        extra = raw(server)
        data, _ = read_all(extra, 5)
        assert data.startswith(b"HTTP/1.1 503") and b"too_many_connections" in data, data[:300]
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    assert client(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices


def test_deep_json_is_a_400(server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    deep = "[" * 200 + "]" * 200
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": ' + deep + "}"}}
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}]
    for body in (
        orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 2}),
        b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "extra": ' + deep.encode() + b"}",
        b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    ):
        status, got, _ = post(server, "/v1/chat/completions", body, auth)
        assert status == 400, got
    assert client(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices


def test_a_maximal_prompt_does_not_stall_the_event_loop(server):
    """A maximal prompt (a body of --max-body-bytes) is rendered and tokenized on the render threads: the
    event loop keeps answering meanwhile (the longest /health round trip during the big prompts stays
    far below the time one big prompt takes alone, which is what it would be if the loop did the work),
    and a stream running meanwhile keeps going.

    The stream's own gaps are reported, not bounded: on a host with no more cores than a CPU rank's
    threads, any CPU work slows the rank's decode steps (a fresh CI clone saw a gap as long as a render
    while /health stayed fast); the render threads run below the ranks' priority to keep that short."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    text = "word " * ((MAX_BODY - 200) // 5)  # ~240k tokens, refused after tokenization (context 2048)
    big = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2})
    assert MAX_BODY - 1000 < len(big) <= MAX_BODY
    alone_s = 0.0
    for _ in range(2):
        t0 = time.monotonic()
        status, body, _ = post(server, "/v1/chat/completions", big, auth)
        alone_s = max(alone_s, time.monotonic() - t0)
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"

    gaps: list[float] = []
    probes: list[float] = []  # /health round trips that began while a big prompt was in flight
    started, rendering, done = threading.Event(), threading.Event(), threading.Event()

    def stream() -> None:
        last = None
        chunks = client(server).chat.completions.create(
            model=MODEL, messages=HI, max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in chunks:
            now = time.monotonic()
            if last is not None and started.is_set():
                gaps.append(now - last)
            last = now
            started.set()
            if done.is_set():
                break
        chunks.close()  # the server aborts the rest

    def probe() -> None:
        while not done.is_set() and len(probes) < 500:
            during = rendering.is_set()
            t0 = time.monotonic()
            status, _ = get_json(server.url + "/health", 30.0, server.ssl_context)
            if during and status == 200:
                probes.append(time.monotonic() - t0)
            time.sleep(0.02)

    threads = [threading.Thread(target=stream), threading.Thread(target=probe)]
    threads[0].start()
    assert started.wait(60)
    threads[1].start()
    time.sleep(0.3)
    rendering.set()
    for _ in range(2):
        assert post(server, "/v1/chat/completions", big, auth)[0] == 400
    rendering.clear()
    done.set()
    for t in threads:
        t.join(120)
    assert gaps, "the stream gave no tokens while the big prompts were rendered"
    assert len(probes) >= 3, probes
    print(
        f"big prompt alone {alone_s:.2f} s; meanwhile /health max {max(probes) * 1000:.0f} ms "
        f"(n={len(probes)}), stream gaps max {max(gaps) * 1000:.0f} ms (n={len(gaps)})"
    )
    # On the event loop, a probe sent as a render begins would wait for all of it (about alone_s).
    assert max(probes) < 0.4 * alone_s, (alone_s, probes)


def test_sigterm_drains_streams_in_flight_then_exits(server):
    """Runs last: it stops the module's server."""
    c = client(server)
    stream = c.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=60, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it)
    os.kill(server.pid, signal.SIGTERM)  # the server only: what deploy/*.sh stop and Kubernetes send
    deadline = time.monotonic() + 10
    while get_json(server.url + "/health", context=server.ssl_context)[1].get("status") != "draining":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    status, body = get_json(server.url + "/health/ready", context=server.ssl_context)
    assert status == 503 and body["reason"] == "draining"
    assert get_json(server.url + "/health/live", context=server.ssl_context)[0] == 200
    with pytest.raises(openai.InternalServerError) as e:
        c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
    chunks = list(it)  # the stream in flight completes
    assert chunks[-1].choices[0].finish_reason == "length"
    assert server.proc is not None
    pid = server.pid
    assert server.proc.wait(60) == 0  # then the server exits by itself, its ranks with it
    deadline = time.monotonic() + 10
    while group_alive(pid):
        assert time.monotonic() < deadline, "a rank outlived its server"
        time.sleep(0.1)
    log = server.log_tail(200000)
    assert "draining: 1 request(s) in flight" in log and "drained" in log
