"""A fuzzer over the request space (issue 29): hypothesis draws chat and completion bodies that combine
structured outputs, penalties, logit_bias, min_tokens, stop strings and ids, n, logprobs, tools and
tool_choice and streaming, valid and spoiled (tests/pd/api/request_space.py), and raw bodies that are
barely JSON, and sends them to live servers of a tiny random model with SmolLM2's tokenizer: one with
SmolLM2's own chat template (tools go through the fallback prompt), one with Qwen2.5's (it renders
tools itself) and --reasoning-parser qwen3, and a P/D pair (the CE forwards every prefill to the PE).

Every answer: below 500; a 4xx is OpenAI's error object; a 200 is well formed (n choices, known finish
reasons, logprobs as asked, a constrained output that stopped by itself is whole, a stream that ends
with [DONE] and carries no error, unless its grammar dead-ends after the stream began: then its last
event is that 400 in-band). Every request leaves the engine ranks as they were (same processes,
all up); after a run the ranks are idle with every KV block free, and the servers' logs have no
traceback or lost task. Some streams are read with the openai client, some requests go at once (they
share batches), and some are dropped by the client half-way.

CI runs a bounded, derandomized number of examples. More, locally (pytest-timeout's 600 s is per test):
    PDSERVE_FUZZ_EXAMPLES=1000 PDSERVE_FUZZ_SEED=7 python -m pytest --timeout 0 tests/pd/api/test_fuzz_requests.py
PDSERVE_FUZZ_SHRINK=1 shrinks a failing example.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

from pd.tools.server_process import PDPair, ServerProcess, get_json, wait_idle
from tests.pd.api.request_space import (
    RAW_BODIES,
    VOCAB_SIZE,
    chat_bodies,
    completion_bodies,
    valid_chat_body,
    valid_completion_body,
)
from tests.pd.chat.test_toolcalls import QWEN25_TEMPLATE
from tests.server_fixtures import openai_client
from tests.tiny_models import make_servable

pytestmark = pytest.mark.slow

MODEL = "fuzz"
REQUEST_TIMEOUT_S = 120.0  # an answer slower than this is a hang
STATUSES: Counter[str] = Counter()  # how far the examples got: printed after each run (pytest -s)
# what the log of a server that only answered and refused requests never has
BAD_LOG_LINES = (
    "Traceback",
    "Task exception was never retrieved",
    "was destroyed but it is pending",
    "CRITICAL",
)
SERVER_FLAGS = (
    "--served-model-name", MODEL, "--max-model-len", "512", "--kv-cache-gb", "0.05", "--max-num-seqs", "32",
)  # fmt: skip


def num_examples(default: int) -> int:
    return int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", default))


def fuzz_settings(default_examples: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Reproducible in CI (derandomized, no example database); PDSERVE_FUZZ_SEED draws other examples.
    A failing example is reported as drawn: shrinking it against a live server can outlast the test's
    timeout. PDSERVE_FUZZ_SHRINK=1 shrinks it."""
    seed_env = os.environ.get("PDSERVE_FUZZ_SEED")
    phases = list(Phase) if os.environ.get("PDSERVE_FUZZ_SHRINK") == "1" else [Phase.explicit, Phase.generate]
    chosen = settings(
        max_examples=num_examples(default_examples),
        deadline=None,
        derandomize=seed_env is None,
        database=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
    )

    def apply(fn: Callable[..., None]) -> Callable[..., None]:
        fn = chosen(fn)
        return seed(int(seed_env))(fn) if seed_env is not None else fn

    return apply


# ---- the servers --------------------------------------------------------------------------------


@dataclass
class Target:
    """What a fuzz run talks to: one server, or a P/D pair (servers[0], the CE, takes the requests and
    hands each prefill to the PE, servers[1])."""

    servers: tuple[ServerProcess, ...]

    @property
    def is_pair(self) -> bool:
        return len(self.servers) > 1

    @property
    def port(self) -> int:
        return self.servers[0].port

    def ranks_up(self, timeout_s: float = 120.0) -> dict[tuple[int, int], int]:
        """(server, rank) -> pid once every server's /health is ok (a restarted rank takes a while)."""
        deadline = time.monotonic() + timeout_s
        for s in self.servers:
            while (health := get_json(s.url + "/health"))[1].get("status") != "ok":
                assert time.monotonic() < deadline, health
                time.sleep(0.5)
        return {(i, rank): pid for i, s in enumerate(self.servers) for rank, pid in s.rank_pids().items()}

    def log_tail(self) -> str:
        return "\n".join(s.log_tail() for s in self.servers)


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.checkpoints import resolve_model

    folder = make_servable(
        "llama", tmp_path_factory.mktemp("tiny-llama"), resolve_model("smollm2-135m-instruct")
    )
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == VOCAB_SIZE
    return folder


@pytest.fixture(scope="module", params=["fallback-tools", "template-tools", "pd-pair"])
def target(
    request: pytest.FixtureRequest, tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    """fallback-tools: SmolLM2's template (no tools: the fallback prompt); template-tools: Qwen2.5's
    template, which renders tools and calls itself, with the qwen3 reasoning parser; pd-pair: a CE
    and its PE, SmolLM2's template."""
    tmp = tmp_path_factory.mktemp(request.param)
    args: tuple[str, ...] = ("--model", str(tiny_chat_model), *SERVER_FLAGS)
    if request.param == "template-tools":
        (tmp / "template.jinja").write_text(QWEN25_TEMPLATE)
        args += ("--chat-template", str(tmp / "template.jinja"), "--reasoning-parser", "qwen3")
    if request.param == "pd-pair":
        with PDPair(*args, log_dir=tmp) as pair:
            yield Target((pair.ce, pair.pe))
    else:
        with ServerProcess(*args, log_path=tmp / "server.log") as s:
            yield Target((s,))


# ---- sending --------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    content_type: str
    data: bytes


def post(port: int, path: str, body: bytes, drop_after_bytes: int | None = None) -> Answer | None:
    """One POST on a fresh connection; None when the client drops it after drop_after_bytes bytes of
    the answer (0: right after sending). No answer within REQUEST_TIMEOUT_S fails the test."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        if drop_after_bytes == 0:
            return None
        try:
            resp = conn.getresponse()
            if drop_after_bytes is not None:
                resp.read(drop_after_bytes)
                return None
            return Answer(resp.status, resp.getheader("Content-Type", ""), resp.read())
        except TimeoutError:
            pytest.fail(f"no answer in {REQUEST_TIMEOUT_S} s to {path} {body[:2000]!r}")
    finally:
        conn.close()


def sse_events(data: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body, parsed ("[DONE]" stays a string); every event is `data: ...`."""
    events: list[Any] = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---- what an answer must look like -----------------------------------------------------------------


def check_error(answer: Answer) -> None:
    assert answer.status < 500, f"{answer.status}: {answer.data[:2000]!r}"
    assert 400 <= answer.status, answer
    assert answer.content_type == "application/json", answer
    body = json.loads(answer.data)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"] == "invalid_request_error", body
    assert err["param"] is None or isinstance(err["param"], str), body


def expected_max_tokens(body: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    value = None
    for key in keys:
        value = body.get(key) or value
    return value


def check_logprob(entry: dict[str, Any], top: int) -> None:
    assert isinstance(entry["token"], str) and isinstance(entry["logprob"], float), entry
    assert -9999.0 <= entry["logprob"] <= 1e-4, entry
    assert entry["bytes"] == list(entry["token"].encode()), entry
    assert len(entry["top_logprobs"]) == top, entry
    for t in entry["top_logprobs"]:
        assert isinstance(t["logprob"], float) and -9999.0 <= t["logprob"] <= 1e-4, entry


CHAT_FINISH = ("stop", "length", "tool_calls")


def ends_whole(body: dict[str, Any], finish_reason: str | None) -> bool:
    """An answer that ended by itself: no length limit, stop string or stop id cut it short. (A named
    tool_choice's arguments are the constrained text itself: cut short, they are not JSON yet.)"""
    return finish_reason in ("stop", "tool_calls") and not body.get("stop") and not body.get("stop_token_ids")


def check_chat_message(body: dict[str, Any], choice: dict[str, Any]) -> None:
    message = choice["message"]
    assert message["role"] == "assistant", choice
    assert message["content"] is None or isinstance(message["content"], str), choice
    for call in message.get("tool_calls") or []:
        assert call["type"] == "function" and isinstance(call["id"], str), call
        assert isinstance(call["function"]["name"], str) and isinstance(call["function"]["arguments"], str), (
            call
        )
        if ends_whole(body, choice["finish_reason"]):
            json.loads(call["function"]["arguments"])
    if choice["finish_reason"] == "tool_calls":
        assert message.get("tool_calls"), choice


def constraint(body: dict[str, Any]) -> tuple[str, Any] | None:
    """The body's structured output when its text can be checked here: ("json", None) or ("choice", list)."""
    rf = body.get("response_format") or {}
    so = body.get("structured_outputs") or {}
    if (
        rf.get("type") in ("json_object", "json_schema")
        or {"json", "json_object"} & set(so)
        or "guided_json" in body
    ):
        return "json", None
    choice = so.get("choice", body.get("guided_choice"))
    return None if choice is None else ("choice", choice)


def check_constrained(body: dict[str, Any], text: str, finish_reason: str | None) -> None:
    """A constrained output that ended by itself ("stop", with no stop string or id to cut it short, no
    tool call to take it) is whole: JSON that parses, one of the choices."""
    c = constraint(body)
    if (
        c is None
        or finish_reason != "stop"
        or body.get("stop")
        or body.get("stop_token_ids")
        or body.get("tools")
    ):
        return
    if c[0] == "json":
        json.loads(text)
    else:
        assert text in c[1], (text, c)


def check_chat(body: dict[str, Any], answer: Answer) -> None:
    n = body.get("n") or 1
    max_tokens = expected_max_tokens(body, ("max_tokens", "max_completion_tokens"))
    top = body.get("top_logprobs") or 0
    r = json.loads(answer.data)
    assert r["object"] == "chat.completion" and r["model"] == MODEL, r
    assert [c["index"] for c in r["choices"]] == list(range(n)), r
    num_lps = 0
    for c in r["choices"]:
        assert c["finish_reason"] in CHAT_FINISH, c
        check_chat_message(body, c)
        if not c["message"].get("reasoning_content") and not body.get("echo"):
            check_constrained(body, c["message"]["content"] or "", c["finish_reason"])
        if body.get("logprobs"):
            content = c["logprobs"]["content"]
            num_lps += len(content)
            assert max_tokens is None or len(content) <= max_tokens, c
            for entry in content:
                check_logprob(entry, top)
        else:
            assert c["logprobs"] is None, c
    u = r["usage"]
    check_prompt_logprobs(r["prompt_logprobs"], body.get("prompt_logprobs"), u["prompt_tokens"])
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
    assert max_tokens is None or u["completion_tokens"] <= n * max_tokens, r
    if body.get("logprobs"):
        assert num_lps == u["completion_tokens"], r


def check_prompt_logprobs(plp: Any, num_top: int | None, num_prompt_tokens: int | None) -> None:
    """vLLM's prompt_logprobs: null unless asked for; else null, then {token id: {logprob, rank,
    decoded_token}} per prompt token, the prompt's token first, with the top num_top."""
    if num_top is None:
        assert plp is None, plp
        return
    assert isinstance(plp, list) and plp[0] is None, plp
    assert num_prompt_tokens is None or len(plp) == num_prompt_tokens, (len(plp), num_prompt_tokens)
    for entry in plp[1:]:
        assert len(entry) in (num_top, num_top + 1) and all(k.isdigit() for k in entry), entry
        for v in entry.values():
            assert set(v) == {"logprob", "rank", "decoded_token"} and v["logprob"] <= 0.0 and v["rank"] >= 1, entry


def check_stream_usage(body: dict[str, Any], chunks: list[Any]) -> list[Any]:
    """The chunks but a usage-only last one: usage null in each with include_usage, or with
    continuous_usage_stats too each choice's tokens so far (never fewer than its chunk before); none
    without; the last one's total at least every choice's last."""
    options = body.get("stream_options") or {}
    if options.get("include_usage") is not True:
        assert all("usage" not in ch for ch in chunks), chunks
        return chunks
    *chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 0, last
    if options.get("continuous_usage_stats") is not True:
        assert all(ch["usage"] is None for ch in chunks), chunks
        return chunks
    so_far: dict[int, int] = {}
    for ch in chunks:
        u = ch["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], ch
        for c in ch["choices"]:
            assert u["completion_tokens"] >= so_far.get(c["index"], 0), (ch, so_far)
            so_far[c["index"]] = u["completion_tokens"]
    assert sum(so_far.values()) <= last["usage"]["completion_tokens"], (so_far, last)
    return chunks


def stream_body(body: dict[str, Any], events: list[Any]) -> list[Any] | None:
    """A stream's chunks before [DONE]; None when it ended early on an in-band error, which may only be
    the request's own: a grammar that dead-ends once tokens are out (a 400 in OpenAI's shape, last)."""
    assert events, events
    if events[-1] != "[DONE]":
        err = events[-1]["error"]
        assert err["type"] == "invalid_request_error" and err["message"].startswith("the output's grammar"), err
        assert any(k.startswith("guided_") or k in ("structured_outputs", "response_format") for k in body), body
        assert "[DONE]" not in events and all("error" not in ch for ch in events[:-1]), events[-3:]
        return None
    assert "[DONE]" not in events[:-1], events[-3:]
    for ch in events[:-1]:
        assert "error" not in ch, ch
    return events[:-1]


def check_chat_stream(body: dict[str, Any], events: list[Any]) -> None:
    n = body.get("n") or 1
    chunks = stream_body(body, events)
    if chunks is None:
        return
    chunks = check_stream_usage(body, chunks)
    finished: dict[int, str] = {}
    texts = [""] * n
    has_reasoning = [False] * n
    arguments: dict[tuple[int, int], str] = {}  # (choice, call) -> its arguments, put together
    for ch in chunks:
        assert ch["object"] == "chat.completion.chunk" and ch["model"] == MODEL, ch
        for c in ch["choices"]:
            i = c["index"]
            assert 0 <= i < n and i not in finished, (ch, finished)
            assert set(c["delta"]) <= {"role", "content", "reasoning_content", "tool_calls"}, c
            texts[i] += c["delta"].get("content") or ""
            has_reasoning[i] |= bool(c["delta"].get("reasoning_content"))
            for call in c["delta"].get("tool_calls") or []:
                arguments[(i, call["index"])] = arguments.get((i, call["index"]), "") + call["function"]["arguments"]
            if body.get("logprobs") and c["logprobs"] is not None:
                for entry in c["logprobs"]["content"]:
                    check_logprob(entry, body.get("top_logprobs") or 0)
            if c["finish_reason"] is not None:
                assert c["finish_reason"] in CHAT_FINISH, c
                finished[i] = c["finish_reason"]
    assert sorted(finished) == list(range(n)), finished
    for (i, _), text in arguments.items():
        if ends_whole(body, finished[i]):
            json.loads(text)
    for i in range(n):
        if not has_reasoning[i] and not body.get("echo"):
            check_constrained(body, texts[i], finished[i])


def num_prompts(prompt: Any) -> int:
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return 1
    return len(prompt)


def check_completion(body: dict[str, Any], answer: Answer) -> None:
    k = num_prompts(body["prompt"]) * (body.get("n") or 1)
    max_tokens = body.get("max_tokens") or 16
    top = body.get("logprobs")
    r = json.loads(answer.data)
    assert r["object"] == "text_completion" and r["model"] == MODEL, r
    assert [c["index"] for c in r["choices"]] == list(range(k)), r
    echo_lps = body.get("echo") and top is not None
    # vLLM's: echo with logprobs computes the prompt's (with `logprobs` unless prompt_logprobs is given)
    num_prompt_top = body.get("prompt_logprobs", top if echo_lps else None)
    for c in r["choices"]:
        assert c["finish_reason"] in ("stop", "length") and isinstance(c["text"], str), c
        if body.get("echo") and isinstance(body["prompt"], str):
            assert c["text"].startswith(body["prompt"]), c
            if body.get("max_tokens") == 0:
                assert c["text"] == body["prompt"], c
        if not body.get("echo"):
            check_constrained(body, c["text"], c["finish_reason"])
        check_prompt_logprobs(c["prompt_logprobs"], num_prompt_top, None)
        lp = c["logprobs"]
        if top is None:
            assert lp is None, c
            continue
        num = len(lp["tokens"])
        assert [len(lp[key]) for key in lp] == [num] * 4, c
        tops, tokens = lp["top_logprobs"], lp["tokens"]
        if echo_lps:  # the prompt's tokens first (the first one's logprob and top_logprobs null)
            num_prompt = len(c["prompt_logprobs"])
            assert num - num_prompt <= max_tokens and lp["token_logprobs"][0] is None and tops[0] is None, c
            tops, tokens = tops[1:], tokens[1:]
        else:
            assert num <= max_tokens, c
        # the sampled token's entry, then the top `logprobs` (OpenAI's legacy API and vLLM): one fewer where
        # the sampled token is among them
        assert all(len(t) <= top + 1 and tok in t for t, tok in zip(tops, tokens)), c
    u = r["usage"]
    assert u["completion_tokens"] <= k * max_tokens, r


def check_completion_stream(body: dict[str, Any], events: list[Any]) -> None:
    k = num_prompts(body["prompt"]) * (body.get("n") or 1)
    chunks = stream_body(body, events)
    if chunks is None:
        return
    finished: dict[int, str] = {}
    texts = [""] * k
    for ch in check_stream_usage(body, chunks):
        for c in ch["choices"]:
            assert 0 <= c["index"] < k and c["index"] not in finished, (ch, finished)
            texts[c["index"]] += c["text"]
            if c["finish_reason"] is not None:
                assert c["finish_reason"] in ("stop", "length"), c
                finished[c["index"]] = c["finish_reason"]
    assert sorted(finished) == list(range(k)), finished
    for i in range(k):
        if not body.get("echo"):
            check_constrained(body, texts[i], finished[i])


# ---- one example, the survival of the server --------------------------------------------------------

CHECKS: dict[str, tuple[Callable[[Any, Answer], None], Callable[[Any, list[Any]], None]]] = {
    "/v1/chat/completions": (check_chat, check_chat_stream),
    "/v1/completions": (check_completion, check_completion_stream),
}


def check_answer(path: str, body: Any, answer: Answer) -> None:
    """Any answer: an error below 500 in OpenAI's shape, or a 200 of the path's form (raw bodies: any)."""
    STATUSES[f"{path} {answer.status}"] += 1
    if answer.status != 200:
        check_error(answer)
    elif isinstance(body, dict) and path in CHECKS:
        check, check_stream = CHECKS[path]
        if answer.content_type.startswith("text/event-stream"):
            check_stream(body, sse_events(answer.data))
        else:
            assert answer.content_type == "application/json", answer
            check(body, answer)


def send(target: Target, path: str, body: Any, drop_after_bytes: int | None = None) -> None:
    """body (JSON, or raw bytes) to path; checks the answer and that no rank went down meanwhile."""
    before = target.ranks_up()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    note(f"POST {path} {raw[:4000]!r}")
    answer = post(target.port, path, raw, drop_after_bytes)
    assert target.ranks_up() == before, f"an engine rank restarted: {target.log_tail()}"
    if answer is not None:
        check_answer(path, body, answer)


def send_openai_stream(target: Target, body: dict[str, Any]) -> None:
    """A streamed chat body through the openai client: its errors are typed, its chunks parsed."""
    before = target.ranks_up()
    note(f"openai stream {json.dumps(body)[:4000]}")
    rest = {k: v for k, v in body.items() if k not in ("model", "messages", "stream")}
    finished: set[int] = set()
    try:
        stream = openai_client(target.servers[0].url, REQUEST_TIMEOUT_S).chat.completions.create(
            model=body.get("model", MODEL), messages=body["messages"], stream=True, extra_body=rest
        )
        for ch in stream:
            for c in ch.choices:
                assert c.index not in finished, ch
                if c.finish_reason is not None:
                    finished.add(c.index)
        assert finished == set(range(body.get("n") or 1)), finished
    except openai.APIStatusError as e:
        assert e.status_code < 500, e
    assert target.ranks_up() == before, f"an engine rank restarted: {target.log_tail()}"


@dataclass
class Survival:
    """What the servers must still be after a fuzz run: the same rank processes, never restarted, idle
    with every KV block free, and no traceback in their logs since the run began."""

    target: Target
    pids: dict[tuple[int, int], int]
    log_offsets: list[int]

    @classmethod
    def before(cls, target: Target) -> Survival:
        return cls(target, target.ranks_up(), [log_path(s).stat().st_size for s in target.servers])

    def check(self) -> None:
        print(sorted(STATUSES.items()))
        STATUSES.clear()
        assert self.target.ranks_up() == self.pids, self.target.log_tail()
        for s, offset in zip(self.target.servers, self.log_offsets):
            health = get_json(s.url + "/health")[1]
            assert all(r["state"] == "up" and r["num_restarts"] == 0 for r in health["ranks"]), health
            wait_idle(s.port, timeout_s=60)
            with open(log_path(s), "rb") as f:
                f.seek(offset)
                log = f.read().decode(errors="replace")
            assert not bad_log_lines(log, self.target.is_pair), log[-8000:]


def bad_log_lines(log: str, is_pair: bool) -> list[str]:
    """The log's lines that no server should write."""
    return [line for line in log.splitlines() if any(b in line for b in BAD_LOG_LINES)]


def log_path(server: ServerProcess) -> Path:
    assert server.log_path is not None
    return server.log_path


# ---- the fuzz runs -----------------------------------------------------------------------------------


def drops(target: Target) -> st.SearchStrategy[int | None]:
    """When the client hangs up: never (most often), before the answer, in its head, in it."""
    return st.sampled_from([None] * 12 + [0, 1, 200])


def test_fuzz_chat(target: Target) -> None:
    survival = Survival.before(target)

    @fuzz_settings(40)
    @given(chat_bodies(MODEL), drops(target), st.integers(0, 3))
    def run(body: dict[str, Any], drop: int | None, via: int) -> None:
        if (
            body.get("stream") is True
            and isinstance(body.get("messages"), list)
            and via == 0
            and drop is None
        ):
            send_openai_stream(target, body)
        else:
            send(target, "/v1/chat/completions", body, drop)

    run()
    survival.check()


def test_fuzz_completions(target: Target) -> None:
    survival = Survival.before(target)

    @fuzz_settings(25)
    @given(completion_bodies(MODEL), drops(target))
    def run(body: dict[str, Any], drop: int | None) -> None:
        send(target, "/v1/completions", body, drop)

    run()
    survival.check()


def test_fuzz_raw_bodies(target: Target) -> None:
    """Bodies that are not a JSON object, or are one only to a lenient parser, on every POST route."""
    survival = Survival.before(target)

    @fuzz_settings(15)
    @given(
        RAW_BODIES, st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"])
    )
    def run(raw: bytes, path: str) -> None:
        send(target, path, raw)

    run()
    survival.check()


def test_fuzz_concurrent(target: Target) -> None:
    """Valid bodies sent at once share the engine's batches: rows with different constraints,
    penalties, biases, stops and logprobs side by side (a lone request's batch has one kind of row)."""
    survival = Survival.before(target)
    one = st.one_of(
        valid_chat_body(MODEL).map(lambda b: ("/v1/chat/completions", b)),
        valid_completion_body(MODEL).map(lambda b: ("/v1/completions", b)),
    )

    @fuzz_settings(10)
    @given(st.lists(one, min_size=2, max_size=4))
    def run(requests: list[tuple[str, dict[str, Any]]]) -> None:
        before = target.ranks_up()
        for path, body in requests:
            note(f"POST {path} {json.dumps(body)[:4000]}")
        with ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(lambda r: post(target.port, r[0], json.dumps(r[1]).encode()), requests))
        assert target.ranks_up() == before, f"an engine rank restarted: {target.log_tail()}"
        for (path, body), answer in zip(requests, answers):
            assert answer is not None
            check_answer(path, body, answer)

    run()
    survival.check()
