"""Each stage of a request raises an exception the code does not expect, in turn, on a single server and
on both roles of a P/D pair (SmolLM2-135M): that request fails with a 500 whose message says nothing of
the exception (the server's log has it, under the request's id), whole or in-band in its stream; no rank
restarts; the next request succeeds; every pool is back to idle.

The faults come from tests/fault_injection/sitecustomize.py, on the servers' PYTHONPATH: a request whose
X-Request-Id is `fault-<stage>-<n>` raises at that stage (it says which function each stage wraps).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import APIError, APIStatusError

from pd.tools.server_process import PDPair, ServerProcess, wait_idle
from tests.server_fixtures import openai_client

pytestmark = pytest.mark.slow

HOOKS = Path(__file__).resolve().parents[1] / "fault_injection"
ARGS = ("--model", "smollm2-135m-instruct", "--max-model-len", "1024", "--kv-cache-gb", "0.25", "--max-num-seqs", "8")
ASK = [{"role": "user", "content": "Name three colours."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
SINGLE_STAGES = (
    "admission", "mask-first", "mask-later", "sample-first", "sample-later", "feed-later", "detok-first", "detok-later",
    "toolparse",
)
PAIR_STAGES = (*SINGLE_STAGES, "reserve", "export", "import")
_ids = itertools.count()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("faults")
    path = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p)
    single = ServerProcess(*ARGS, log_path=logs / "single.log", env={**os.environ, "PYTHONPATH": path})
    pair = PDPair(*ARGS, log_dir=logs)
    for side in (pair.pe, pair.ce):
        side.env = {**(side.env or os.environ), "PYTHONPATH": path}
    try:
        single.start()
        pair.start()
        single.wait_ready()
        pair.wait_ready()
        yield {"single": single, "pe": pair.pe, "ce": pair.ce}
    finally:
        pair.terminate()
        single.terminate()
        pair.stop()
        single.stop()


def _call(url: str, request_id: str, stream: bool, tools: bool, logprobs: bool = False) -> tuple[int, str]:
    """(status, text): the HTTP status, or 200 and the error of a stream that failed in-band."""
    client = openai_client(url, timeout_s=120)
    kw = dict(model="smollm2-135m-instruct", messages=ASK, max_tokens=4, temperature=0, extra_headers={"X-Request-Id": request_id})
    if tools:
        kw["tools"] = TOOLS
    if logprobs:
        kw["logprobs"] = True
    try:
        if not stream:
            r = client.chat.completions.create(**kw)
            return 200, r.choices[0].message.content or ""
        text = ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return 200, text
    except APIStatusError as e:
        return e.status_code, e.message
    except APIError as e:  # an error event inside a stream that began with 200
        return 200, f"in-band: {e.message}"


def _pids(servers: dict[str, ServerProcess], names: tuple[str, ...]) -> dict[str, dict[int, int]]:
    return {n: servers[n].rank_pids() for n in names}


def _cases() -> list[tuple[str, str, bool]]:
    """Every stage, whole; streamed too where a stream can have begun (a later token, the tool calls'
    parse at its end), so the error goes in-band."""
    cases = [("single", s, False) for s in SINGLE_STAGES] + [("pair", s, False) for s in PAIR_STAGES]
    return cases + [(w, s, True) for w, s, _ in cases if s.endswith("-later") or s == "toolparse"]


@pytest.mark.parametrize("where, stage, stream", _cases(), ids=lambda v: {True: "stream", False: "whole"}.get(v, v))
def test_an_unexpected_exception_fails_its_request_alone(servers, where: str, stage: str, stream: bool) -> None:
    names = ("single",) if where == "single" else ("pe", "ce")
    url = servers[names[-1]].url
    before = _pids(servers, names)
    rid = f"fault-{stage}-{next(_ids)}"
    # NOTE: a greedy request's later tokens are fed on the device by launch-ahead (the default), which
    # neither processes nor draws them on the host: asking for logprobs keeps them on the host's path
    host_path = stage in ("mask-later", "sample-later")
    status, text = _call(url, rid, stream, tools=stage == "toolparse", logprobs=host_path)
    assert (status, text.startswith("in-band")) in ((500, False), (200, True)), (status, text)
    assert "injected" not in text.lower()  # a generic message: nothing of the exception
    assert _pids(servers, names) == before  # no rank restarted
    assert _call(url, f"next-{next(_ids)}", stream, tools=False)[0] == 200
    for n in names:
        wait_idle(servers[n].port, timeout_s=30)  # nothing left in the pools
    # logged: a line naming the request, and the exception with its traceback
    lines = "".join(servers[n].log_path.read_text(errors="replace") for n in names).splitlines()  # type: ignore[union-attr]
    assert any(rid in line and "InjectedFault" not in line for line in lines)
    assert any(line.startswith("Traceback") for line in lines)
    assert any("InjectedFault: injected fault" in line and rid in line for line in lines)
