"""A second SIGTERM stops a draining server at once (pd/server.py _drain): the requests still in flight
are answered with an error (503 engine_down: their rank stopped) rather than left waiting, and the
server exits. Before, a rank's stop cancelled the task that tells its requests, and the server's HTTP
shutdown waited on their handlers: the process outlived its stop by a minute and more."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pd.tools.server_process import ServerProcess, get_json, group_alive

pytestmark = pytest.mark.slow  # a real server's start and stop (about 15 s on 2 cores)

MODEL = "smollm2-135m-instruct"


def test_a_second_sigterm_answers_the_requests_in_flight_and_exits(tmp_path: Path) -> None:
    server = ServerProcess("--model", MODEL, "--max-model-len", "1024", "--kv-cache-gb", "0.1",
                           log_path=tmp_path / "server.log")  # fmt: skip
    with server:
        outcome: dict[str, Any] = {}

        def long_chat() -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
                    "max_tokens": 900, "ignore_eos": True}  # fmt: skip
            req = urllib.request.Request(server.url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    outcome["status"] = r.status
            except urllib.error.HTTPError as e:
                outcome["status"], outcome["body"] = e.code, json.loads(e.read())
            except Exception as e:  # a hang cut by the timeout, or the connection closed unanswered
                outcome["status"] = repr(e)

        worker = threading.Thread(target=long_chat)
        worker.start()
        deadline = time.monotonic() + 60
        while get_json(server.url + "/load")[1]["server_load"] != 1:  # the chat is in
            assert time.monotonic() < deadline and worker.is_alive(), (outcome, server.log_tail())
            time.sleep(0.1)
        os.kill(server.pid, signal.SIGTERM)  # the server only, as Kubernetes sends it: a drain begins
        while "draining: 1 request(s) in flight" not in server.log_tail(100000):
            assert time.monotonic() < deadline and worker.is_alive(), (outcome, server.log_tail())
            time.sleep(0.1)
        os.kill(server.pid, signal.SIGTERM)  # the second signal: stop now
        worker.join(timeout=150)
        assert not worker.is_alive()
        assert outcome["status"] == 503 and outcome["body"]["error"]["code"] == "engine_down", outcome
        assert server.proc is not None
        pid = server.pid
        server.proc.wait(30)  # it exits by itself (before the fix: only when killed)
        deadline = time.monotonic() + 10
        while group_alive(pid):
            assert time.monotonic() < deadline, "a rank outlived its server"
            time.sleep(0.1)
        assert "stopping with 1 request(s) still in flight" in server.log_tail(100000)
