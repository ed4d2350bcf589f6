"""End to end: the real `openai` client against `python -m pd.server` (SmolLM2-135M, --deterministic), the
session's single-engine server (tests/pd/conftest.py, shared with the other SmolLM2 server tests)."""

from __future__ import annotations

import http.client
import json
import re
import time

import pytest

from pd.tools.server_process import get_json, rank_metrics
from pd.tools.server_process import wait_idle as _wait_idle
from tests.server_fixtures import openai_client

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server(smollm_servers):
    """The session's SmolLM2 single-engine server (tests/pd/conftest.py), SMALL_DETERMINISTIC."""
    return smollm_servers[0]


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


@pytest.fixture(scope="module")
def tokenizer():
    from pd.frontend.coordinator import load_tokenizer

    return load_tokenizer(MODEL)


def metrics(server) -> dict[str, float]:
    return rank_metrics(server.port)


def wait_idle(server) -> dict[str, float]:
    return _wait_idle(server.port)


def stream_text(client, **kw) -> tuple[str, str | None]:
    text, finish = "", None
    for ch in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.smoke
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = get_json(server.url + "/health")
    assert status == 200 and body["status"] == "ok" and body["ranks"][0]["state"] == "up"


@pytest.mark.smoke
def test_chat_whole_then_streamed_with_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=8, temperature=0)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert c.message.role == "assistant" and c.message.content and "Paris" in c.message.content
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert (
        u.prompt_tokens > 5
        and 1 <= u.completion_tokens <= 8
        and u.total_tokens == u.prompt_tokens + u.completion_tokens
    )
    assert u.prompt_tokens_details.cached_tokens >= 0

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CAPITAL,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        c.finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert chunks[-1].usage.prompt_tokens == u.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_max_completion_tokens_and_prefix_cache_off(client):
    r = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_completion_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length"
    off = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        max_completion_tokens=2,
        temperature=0,
        extra_body={"prefix_cache": False},
    )
    assert off.choices[0].message.content == r.choices[0].message.content
    assert off.usage.prompt_tokens_details.cached_tokens == 0


def test_n_choices(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, max_tokens=6, temperature=1.0, seed=7, n=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 12
    seen = {}
    for ch in client.chat.completions.create(
        model=MODEL, messages=CAPITAL, max_tokens=6, temperature=1.0, seed=7, n=2, stream=True
    ):
        for c in ch.choices:
            seen[c.index] = seen.get(c.index, "") + (c.delta.content or "")
    assert seen == {
        0: r.choices[0].message.content,
        1: r.choices[1].message.content,
    }  # seeds 7 and 8, both ways


def test_stop_strings(client):
    base = (
        client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=8, temperature=0)
        .choices[0]
        .message.content
    )
    words = base.split(" ")
    assert len(words) >= 4, base
    stop = " " + words[2]
    for stop_arg in (stop, ["no such text", stop]):
        r = client.chat.completions.create(
            model=MODEL, messages=CAPITAL, max_tokens=8, temperature=0, stop=stop_arg
        )
        assert r.choices[0].message.content == base[: base.index(stop)]
        assert r.choices[0].finish_reason == "stop"
    text, finish = stream_text(client, messages=CAPITAL, max_tokens=8, temperature=0, stop=stop)
    assert (text, finish) == (base[: base.index(stop)], "stop")


def test_seed_reproducible(client):
    story = [{"role": "user", "content": "Write the first line of a story."}]  # many likely answers
    kw = dict(model=MODEL, messages=story, max_tokens=5, temperature=1.0)
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    assert a == b
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2)}
    assert len(others | {a}) > 1


def test_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for lp in content:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].token == lp.token  # greedy: the chosen token is the most likely one
        assert abs(lp.top_logprobs[0].logprob - lp.logprob) < 1e-4
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob >= lp.top_logprobs[2].logprob
        assert bytes(lp.bytes).decode() == lp.token
    assert "".join(lp.token for lp in content) == r.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completions(client, tokenizer):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    text = r.choices[0].text
    assert r.object == "text_completion" and text and r.choices[0].finish_reason in ("stop", "length")
    ids = tokenizer(prompt)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == text
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True
        )
        if ch.choices
    )
    assert streamed == text
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text == prompt + text
    lp = (
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
        .choices[0]
        .logprobs
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    two = client.completions.create(
        model=MODEL, prompt=[prompt, "One plus one is"], max_tokens=2, temperature=0, n=2
    )
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert all(c.text and c.finish_reason == "length" for c in two.choices)


def test_tool_call_comes_back_as_tool_calls(client, tokenizer):
    from pd.chat.renderer import PromptRenderer

    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER], tool_choice=choice, max_tokens=40, temperature=0
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and not c.message.content  # vLLM's for a named function
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    # the tools were rendered into the prompt: the server's prompt is the renderer's, tools included
    rendered = PromptRenderer(tokenizer).render_chat(tuple(msgs), (WEATHER,), choice)
    assert '"get_weather"' in tokenizer.decode(list(rendered.token_ids))
    assert r.usage.prompt_tokens == len(rendered.token_ids)
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert plain.usage.prompt_tokens < r.usage.prompt_tokens
    # streamed: the call arrives as tool_calls deltas, the first naming it (cache off: the same prefill as
    # above, same numerics)
    calls, finish = [], None
    for ch in client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        tools=[WEATHER],
        tool_choice=choice,
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"prefix_cache": False},
    ):
        if ch.choices:
            calls += ch.choices[0].delta.tool_calls or []
            finish = ch.choices[0].finish_reason or finish
    assert finish == "stop" and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert {t.index for t in calls} == {0} and all(t.function.name is None for t in calls[1:])
    assert "".join(t.function.arguments for t in calls) == call.function.arguments


def test_client_disconnect_aborts_and_frees(server):
    body = json.dumps(
        {
            "model": MODEL,
            "messages": CAPITAL,
            "max_tokens": 1000,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
    )
    log_start = server.log_path.stat().st_size
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # streaming has begun
    busy = metrics(server)
    assert busy["pdserve_num_requests_inflight"] == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    m = wait_idle(server)
    assert m["pdserve_kv_cache_usage_ratio"] == 0.0
    time.sleep(0.5)  # the stream's next write has met the closed connection
    log = server.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in log and "unexpected error" not in log, log  # a client gone is no server error


def test_metrics_cover_the_requests(server):
    m = wait_idle(server)
    for name in (
        "pdserve_time_to_first_token_seconds_count",
        "pdserve_inter_token_latency_seconds_count",
        "pdserve_e2e_request_latency_seconds_count",
        "pdserve_request_queue_time_seconds_count",
        "pdserve_prompt_tokens_total",
        "pdserve_generation_tokens_total",
    ):
        assert m[name] > 0, name
    assert m["pdserve_rank_up"] == 1.0


def post_json(server, path: str, body: object) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_tokenize_detokenize_and_version(server, client, tokenizer):
    text = "Paris is the capital of France."
    status, t = post_json(server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert status == 200 and t["tokens"] == tokenizer(text)["input_ids"] and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == 2048 and len(t["token_strs"]) == t["count"]
    status, d = post_json(server, "/detokenize", {"tokens": t["tokens"]})
    assert status == 200 and d == {"prompt": text}
    # a chat prompt counts what a chat request's usage says
    messages = [{"role": "user", "content": "Hi there"}]
    status, t = post_json(server, "/tokenize", {"messages": messages})
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert status == 200 and r.usage is not None and t["count"] == r.usage.prompt_tokens
    for path, body, param in (
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ):
        status, e = post_json(server, path, body)
        assert status in (400, 404) and e["error"]["param"] == param, (path, body, e)
    status, v = get_json(server.url + "/version")
    assert status == 200 and v["version"]


# ---- structured outputs and logit processors, through the openai client ----------------------------

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ANN = [{"role": "user", "content": "Tell me about a person named Ann who is 31, as JSON."}]


def test_json_schema_parses_into_a_pydantic_model(client):
    from pydantic import BaseModel, ConfigDict

    class Person(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str
        age: int

    r = client.chat.completions.parse(model=MODEL, messages=ANN, max_tokens=40, temperature=0, response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop", r
    # streamed: the same text (deterministic server), and it validates as well
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    text, finish = stream_text(client, messages=ANN, max_tokens=40, temperature=0, response_format=fmt)
    assert finish == "stop" and Person.model_validate_json(text) == person


@pytest.mark.smoke
def test_json_object_regex_choice_and_grammar(client):
    def ask(content: str, max_tokens: int, **kw) -> tuple[str, str]:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0, **kw
        )
        return r.choices[0].message.content, r.choices[0].finish_reason

    text, finish = ask('Reply with this JSON: {"ok": true}', 16, response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(text), dict), text
    text, finish = ask("Give a phone number.", 12, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert finish == "stop" and re.fullmatch("[0-9]{3}-[0-9]{4}", text), text
    text, _ = ask("Is the sky blue?", 4, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert text in ("yes", "no")
    grammar = 'root ::= answer "." \nanswer ::= "red" | "green" | "blue"'
    text, finish = ask("Name a color.", 6, extra_body={"structured_outputs": {"grammar": grammar}})
    assert text in ("red.", "green.", "blue.") and finish == "stop", text
    # completions take the same constraint
    r = client.completions.create(
        model=MODEL, prompt="The answer is", max_tokens=6, temperature=0,
        extra_body={"structured_outputs": {"regex": " (yes|no)"}},
    )
    assert r.choices[0].text in (" yes", " no")


def test_structured_output_errors_are_400s(client):
    import openai

    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
         "response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: nothing_here"}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs.choice"),
        ({"extra_body": {"structured_outputs": {"jsonn": {}}}}, "structured_outputs"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
         "structured_outputs.regex"),
    ]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=4, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)


def test_logit_processors_change_greedy_output_as_vllms_do(client, tokenizer):
    def ask(messages, max_tokens: int, **extra) -> tuple[list[int], str]:
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True, **extra
        )
        c = r.choices[0]
        return [t.token for t in c.logprobs.content], c.finish_reason

    # logit_bias +100 on one token: greedy picks it every step; -100 on the first greedy token: never again
    plain, _ = ask(CAPITAL, 6)
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    ids, _ = ask(CAPITAL, 5, logit_bias={str(forced): 100})
    assert ids == [tokenizer.decode([forced])] * 5
    first = tokenizer.encode(plain[0], add_special_tokens=False)
    assert len(first) == 1 and tokenizer.decode(first) == plain[0]
    ids, _ = ask(CAPITAL, 6, logit_bias={str(first[0]): -100})
    assert plain[0] not in ids
    # min_tokens: EOS is barred until then (a one-word answer runs on)
    short = [{"role": "user", "content": "Answer with one word: yes or no. Is fire hot?"}]
    ids, finish = ask(short, 40)
    assert finish == "stop" and len(ids) < 12
    longer, _ = ask(short, 40, extra_body={"min_tokens": 16})
    assert len(longer) >= 16 and longer[: len(ids) - 1] == ids[:-1]  # the same until the barred EOS
    # frequency_penalty: a repetitive answer repeats less
    echo = [{"role": "user", "content": "Write the word 'hello' ten times."}]
    rep, _ = ask(echo, 30)
    pen, _ = ask(echo, 30, frequency_penalty=2.0)
    most = lambda xs: max(xs.count(t) for t in set(xs))  # noqa: E731
    assert most(pen) < most(rep), ("".join(rep), "".join(pen))
