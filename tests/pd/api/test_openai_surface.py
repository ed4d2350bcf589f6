"""Issue 30's parameters, through the official `openai` client against a single-engine server and a P/D pair
(SmolLM2-135M, --deterministic): continue_final_message and add_generation_prompt (chat and /tokenize),
vLLM's /v1/models fields, completions' logprobs 0, custom message roles, the seed range, a forced
tool_choice (named or "required": the answer constrained to the tools' schema), prompt_logprobs and
completions' echo with logprobs (max_tokens 0 too), and vLLM's fields this server does not have. Each is
honoured as vLLM does, or a 400 naming it."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from pd.api.chat import parse_tool_output
from pd.api.protocol import parse_chat_request
from pd.chat.reasoning import Start, continued_start
from pd.chat.renderer import PromptRenderer
from pd.chat.toolcalls import HermesParser
from pd.errors import ApiError
from pd.frontend.coordinator import load_tokenizer
from pd.tools.server_process import ServerProcess, wait_idle
from tests.server_fixtures import openai_client, wait_pair_idle

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
QUESTION = {"role": "user", "content": "What is the capital of France?"}
PARTIAL = "The capital of France is"
PREFILLED = [QUESTION, {"role": "assistant", "content": PARTIAL}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
GENERATION_PROMPT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def servers(smollm_servers):
    """The session's SmolLM2 reference and pair (tests/pd/conftest.py), SMALL_DETERMINISTIC."""
    return smollm_servers


def both(servers: tuple[ServerProcess, Any]) -> list[str]:
    """The single server's URL and the pair's (its CE)."""
    ref, pair = servers
    return [ref.url, pair.url]


def post_json(url: str, path: str, body: object) -> tuple[int, Any]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def tokenize_text(url: str, body: dict[str, Any]) -> tuple[list[int], str]:
    status, t = post_json(url, "/tokenize", body)
    assert status == 200, t
    status, d = post_json(url, "/detokenize", {"tokens": t["tokens"]})
    assert status == 200, d
    return t["tokens"], d["prompt"]


def refused(create: Callable[..., Any], param: str, **kw: Any) -> str:
    """create(**kw) is a 400 naming `param`: its message."""
    with pytest.raises(openai.BadRequestError) as e:
        create(**kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    return str(e.value.body["message"])


# ---- 1. continue_final_message and add_generation_prompt -------------------------------------------------


def test_tokenize_honours_the_generation_prompt_flags(servers):
    for url in both(servers):
        _, default = tokenize_text(url, {"messages": [QUESTION]})
        _, without = tokenize_text(url, {"messages": [QUESTION], "add_generation_prompt": False})
        assert default.endswith(GENERATION_PROMPT) and default == without + GENERATION_PROMPT
        _, continued = tokenize_text(url, {"messages": PREFILLED, **CONTINUE})
        _, closed = tokenize_text(url, {"messages": PREFILLED})
        assert continued.endswith(PARTIAL) and closed.endswith(PARTIAL + "<|im_end|>\n" + GENERATION_PROMPT)
        assert continued == tokenize_text(url, {"messages": PREFILLED, "continue_final_message": True})[1]
        status, e = post_json(url, "/tokenize", {"messages": [QUESTION], "continue_final_message": True})
        assert status == 400 and e["error"]["param"] == "continue_final_message", e


def test_chat_continues_the_final_message(servers):
    answers = []
    kw: dict[str, Any] = dict(model=MODEL, messages=PREFILLED, max_tokens=4, temperature=0)
    for url in both(servers):
        client = openai_client(url)
        r = client.chat.completions.create(**kw, extra_body=CONTINUE)
        content = r.choices[0].message.content
        assert content and not content.startswith(PARTIAL)  # the continuation only, as vLLM answers
        ids, _ = tokenize_text(url, {"messages": PREFILLED, **CONTINUE})
        assert r.usage is not None and r.usage.prompt_tokens == len(ids)
        only_continue = {"continue_final_message": True}  # no generation prompt unless asked for
        stream = client.chat.completions.create(**kw, stream=True, extra_body=only_continue)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content
        answers.append(content)
    assert answers[0] == answers[1]
    # the same as completing the rendered prompt: the answer goes on from PARTIAL
    ref_client = openai_client(servers[0].url)
    plain = ref_client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert plain.choices[0].text == answers[0]


def test_generation_prompt_refusals(servers):
    for url in both(servers):
        create = openai_client(url).chat.completions.create
        kw: dict[str, Any] = dict(model=MODEL, max_tokens=1)
        both_true = {**CONTINUE, "add_generation_prompt": True}
        message = refused(create, "continue_final_message", **kw, messages=PREFILLED, extra_body=both_true)
        assert "cannot set both" in message
        user_last = {"continue_final_message": True}
        message = refused(create, "continue_final_message", **kw, messages=[QUESTION], extra_body=user_last)
        assert "assistant" in message
        not_bool = {"add_generation_prompt": "yes"}
        refused(create, "add_generation_prompt", **kw, messages=[QUESTION], extra_body=not_bool)


def test_a_continued_message_decides_the_reasoning():
    assert continued_start("The answer is") is None
    assert continued_start("<think>Let me see") is Start.IN_REASONING
    assert continued_start("<think>Done.</think>The answer is") is None


# ---- 5. /v1/models ---------------------------------------------------------------------------------------


def test_models_have_vllms_fields(servers):
    _, pair = servers
    for url in [*both(servers), pair.pe.url]:
        cards = [m.model_dump() for m in openai_client(url).models.list().data]
        if url != pair.pe.url:  # the PE lists its model; retrieving one is the CE's
            cards.append(openai_client(url).models.retrieve(MODEL).model_dump())
        for card in cards:
            assert (card["id"], card["object"], card["owned_by"], card["root"], card["parent"]) == (
                MODEL,
                "model",
                "pdserve",
                MODEL,
                None,
            )
            assert card["max_model_len"] == 2048
            (perm,) = card["permission"]
            assert perm["id"].startswith("modelperm-") and perm["created"] == card["created"]
            assert {k: v for k, v in perm.items() if k not in ("id", "created")} == {
                "object": "model_permission",
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }


# ---- 6. logprobs 0 ---------------------------------------------------------------------------------------


def test_completions_logprobs_always_have_the_sampled_token(servers):
    kw: dict[str, Any] = dict(model=MODEL, prompt="The capital of France is", max_tokens=4)
    for url, stream in zip(both(servers), (False, True), strict=True):  # whole, then streamed
        r = openai_client(url).completions.create(**kw, temperature=0, logprobs=0, stream=stream)
        chunks = list(r) if stream else [r]
        lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for lp in lps for t in lp.tokens]
        token_lps = [x for lp in lps for x in lp.token_logprobs]
        tops = [t for lp in lps for t in lp.top_logprobs]
        assert len(tokens) == 4 and tops == [{t: x} for t, x in zip(tokens, token_lps, strict=True)]
    # sampled, not greedy: the sampled token is there with the top 2 (so 2 or 3 entries)
    r = openai_client(servers[1].url).completions.create(**kw, temperature=1.5, seed=7, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None
    for token, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == x and 2 <= len(top) <= 3


def test_chat_top_logprobs_zero_is_an_empty_list(servers):
    for url in both(servers):
        r = openai_client(url).chat.completions.create(
            model=MODEL, messages=[QUESTION], max_tokens=3, temperature=0, logprobs=True, top_logprobs=0
        )
        content = r.choices[0].logprobs.content
        assert content and len(content) == 3 and all(c.top_logprobs == [] for c in content)


# ---- 7. custom roles -------------------------------------------------------------------------------------


def test_custom_roles_reach_the_template(servers):
    messages = [{"role": "critic", "content": "Be brief."}, {"role": "function", "content": "42"}, QUESTION]
    answers = []
    for url in both(servers):
        _, text = tokenize_text(url, {"messages": messages})
        assert "<|im_start|>critic\nBe brief.<|im_end|>" in text and "<|im_start|>function\n42" in text
        r = openai_client(url).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0
        )
        assert r.choices[0].message.content
        answers.append(r.choices[0].message.content)
        create = openai_client(url).chat.completions.create
        no_role = [{"role": "", "content": "x"}]
        refused(create, "messages[0].role", model=MODEL, messages=no_role, max_tokens=1)
    assert answers[0] == answers[1]


def test_a_template_that_refuses_a_role_is_a_400():
    template = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('no role ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}"
    )
    renderer = PromptRenderer(load_tokenizer(MODEL), template)
    req = parse_chat_request({"messages": [{"role": "critic", "content": "x"}]})
    with pytest.raises(ApiError, match="no role critic") as e:
        renderer.render_chat(req.messages)
    assert e.value.status == 400 and e.value.param == "messages"


# ---- 8. seed ---------------------------------------------------------------------------------------------


def test_seed_takes_vllms_range(servers):
    answers = []
    kw: dict[str, Any] = dict(model=MODEL, messages=[QUESTION], max_tokens=4, temperature=1.5)
    for url in both(servers):
        client = openai_client(url)
        answers.append(client.chat.completions.create(**kw, seed=-5).choices[0].message.content)
        for seed in (2**64, 2**63, -(2**64)):  # past 64 bits, the JSON parser gives a float
            message = refused(client.chat.completions.create, "seed", **kw, seed=seed)
            assert "must be an integer between" in message and "float" not in message
        message = refused(client.completions.create, "seed", model=MODEL, prompt="x", seed=2**64)
        assert "must be an integer between" in message
        assert "must be an integer" in refused(client.chat.completions.create, "seed", **kw, seed=1.5)
    assert answers[0] == answers[1]  # a negative seed draws the same tokens alone and across a handoff


def test_parallel_tool_calls_false_keeps_the_first_call():
    co = SimpleNamespace(renderer=SimpleNamespace(tool_parser=HermesParser()))
    text = "".join(
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>\n'
        for city in ("Paris", "Lyon")
    )
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    for parallel, cities in ((True, ["Paris", "Lyon"]), (False, ["Paris"])):
        req = parse_chat_request({"messages": [QUESTION], "tools": tools, "parallel_tool_calls": parallel})
        calls = parse_tool_output(co, req, text).tool_calls
        assert [json.loads(c.arguments)["city"] for c in calls] == cities


# ---- 9. a forced tool_choice: the answer constrained to the tools' JSON schema ------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def valid_arguments(name: str, arguments: str) -> bool:
    """The arguments parse and follow the tool's schema (by hand: required keys, string types, enums,
    nothing else)."""
    (schema,) = [t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name]
    args = json.loads(arguments)
    props = schema["properties"]
    return (
        isinstance(args, dict)
        and set(schema["required"]) <= set(args) <= set(props)
        and all(isinstance(v, str) and v in props[k].get("enum", [v]) for k, v in args.items())
    )


def forced(
    url: str, choice: Any, stream: bool, **extra: Any
) -> tuple[list[tuple[str, str]], str | None, str | None]:
    """(calls as (name, arguments), content, finish_reason), whole or put together from the stream."""
    kw: dict[str, Any] = dict(
        model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice=choice, temperature=0, **extra
    )
    client = openai_client(url)
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        calls = c.message.tool_calls or []
        assert all(t.type == "function" and t.id.startswith("call_") for t in calls)
        return [(t.function.name, t.function.arguments) for t in calls], c.message.content, c.finish_reason
    parts: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for t in delta.tool_calls or []:
            if t.index not in parts:  # a call's first delta names it
                assert t.id and t.id.startswith("call_") and t.type == "function" and t.function.name
                parts[t.index] = [t.function.name, ""]
            parts[t.index][1] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [(name, args) for name, args in (parts[k] for k in sorted(parts))], content, finish


def forced_at_once(
    requests: list[tuple[str, Any, bool, dict[str, Any]]],
) -> list[tuple[list[tuple[str, str]], str | None, str | None]]:
    """forced(url, choice, stream, **extra) for each request, all at once (the servers are --deterministic:
    the batches they share change no token); the answers in the requests' order."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: forced(r[0], r[1], r[2], **r[3]), requests))


def test_named_tool_choice_is_a_call_that_follows_the_schema(servers):
    answers = []
    requests = [(url, NAMED, stream, dict(max_tokens=60)) for url in both(servers) for stream in (False, True)]
    for calls, content, finish in forced_at_once(requests):
        ((name, arguments),) = calls
        assert name == "get_weather" and valid_arguments(name, arguments), arguments
        assert not content and finish == "stop"  # vLLM's (and OpenAI's) for a named function
        answers.append(calls)
    assert len(answers) == 4 and all(a == answers[0] for a in answers)  # whole == streamed, single == pair


def test_required_tool_choice_calls_tools_that_exist(servers):
    answers, firsts = [], []
    single, pair = both(servers)
    # each answer whole from one server and streamed from the other (about 100 tokens each under the grammar:
    # every combination would double this test's time); all four at once
    # SmolLM2 calls both tools (about 100 tokens with the grammar's whitespace)
    every = dict(max_tokens=200)
    # parallel_tool_calls false: an array of one (maxItems 1), so the answer stops after one call
    one = dict(max_tokens=200, parallel_tool_calls=False)
    requests = [(single, "required", False, every), (pair, "required", True, every)]
    requests += [(single, "required", True, one), (pair, "required", False, one)]
    got = forced_at_once(requests)
    for calls, content, finish in got[:2]:
        assert calls and all(valid_arguments(name, args) for name, args in calls), calls
        assert not content and finish == "tool_calls"
        answers.append(calls)
    for calls, content, finish in got[2:]:
        assert len(calls) == 1 and valid_arguments(*calls[0]) and not content and finish == "tool_calls"
        firsts.append(calls)
    assert answers[0] == answers[1] and firsts[0] == firsts[1]


def test_forced_tool_choice_with_a_response_format_is_a_400(servers):
    for url in both(servers):
        kw: dict[str, Any] = dict(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=4)
        for choice in (NAMED, "required"):
            create = openai_client(url).chat.completions.create
            refused(create, "tool_choice", **kw, tool_choice=choice, response_format={"type": "json_object"})


# ---- the audit: what is not supported is a 400, never ignored --------------------------------------------


def test_unsupported_fields_are_refused(servers):
    for url in both(servers):
        client = openai_client(url)
        kw: dict[str, Any] = dict(model=MODEL, messages=[QUESTION], max_tokens=1)
        obfuscated = {"include_usage": True, "include_obfuscation": True}
        param = "stream_options.include_obfuscation"
        refused(client.chat.completions.create, param, **kw, stream=True, stream_options=obfuscated)
        early = {"use_beam_search": True, "early_stopping": True}  # vLLM's v1 beam search does nothing with it
        refused(client.chat.completions.create, "early_stopping", **kw, extra_body=early)
        keep = {"prompt": "x", "extra_body": {"skip_special_tokens": False}}
        message = refused(client.completions.create, "skip_special_tokens", model=MODEL, **keep)
        assert "leave it out or send true" in message
        status, e = post_json(url, "/tokenize", {"messages": [QUESTION], "chat_template": "{{ messages }}"})
        assert status == 400 and e["error"]["param"] == "chat_template", e


# ---- 2. prompt_logprobs, and completions' echo with logprobs ------------------------------------------------

PROMPT = "The capital of France is"


def check_prompt_logprobs(plp: Any, prompt_ids: list[int], num_top: int) -> None:
    """vLLM's shape: null, then per prompt token {id: {logprob, rank, decoded_token}}: the prompt's token
    first, then the top num_top (ranks 1..num_top; the prompt's token once when it is among them)."""
    assert isinstance(plp, list) and len(plp) == len(prompt_ids) and plp[0] is None, plp
    for token, entry in zip(prompt_ids[1:], plp[1:], strict=True):
        keys = list(entry)
        assert keys[0] == str(token) and len(keys) in (num_top, num_top + 1), entry
        for value in entry.values():
            assert set(value) == {"logprob", "rank", "decoded_token"} and value["logprob"] <= 0.0, entry
            assert isinstance(value["rank"], int) and value["rank"] >= 1 and isinstance(value["decoded_token"], str)
        ranks = [v["rank"] for v in entry.values()]
        assert sorted(ranks[-num_top:] if num_top else []) == list(range(1, num_top + 1)), entry
        by_rank = [v["logprob"] for v in sorted(entry.values(), key=lambda v: v["rank"])]
        assert by_rank == sorted(by_rank, reverse=True), entry  # rank 1 is the likeliest


def prompt_ids_of(url: str, prompt: str) -> list[int]:
    status, t = post_json(url, "/tokenize", {"prompt": prompt})
    assert status == 200, t
    return list(t["tokens"])


def test_completions_prompt_logprobs(servers):
    ref, pair = servers
    ids = prompt_ids_of(ref.url, PROMPT)
    answers = []
    for url in both(servers):
        client = openai_client(url)
        kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, n=2)
        r = client.completions.create(**kw, extra_body={"prompt_logprobs": 3})
        plps = [c.prompt_logprobs for c in r.choices]  # type: ignore[attr-defined]
        check_prompt_logprobs(plps[0], ids, 3)
        assert plps[1] == plps[0]
        # again: the prompt is computed whole (nothing from the prefix cache), to the same values
        again = client.completions.create(**kw, extra_body={"prompt_logprobs": 3})
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == 0
        assert [c.prompt_logprobs for c in again.choices] == plps  # type: ignore[attr-defined]
        assert [c.text for c in again.choices] == [c.text for c in r.choices]
        zero = client.completions.create(**kw, extra_body={"prompt_logprobs": 0}).choices[0]
        check_prompt_logprobs(zero.prompt_logprobs, ids, 0)  # type: ignore[attr-defined]
        assert [{k: e[k] for k in list(e)[:1]} for e in plps[0][1:]] == zero.prompt_logprobs[1:]  # type: ignore[attr-defined]
        plain = client.completions.create(**kw).choices[0]
        assert plain.prompt_logprobs is None and plain.text == r.choices[0].text  # type: ignore[attr-defined]
        answers.append(plps[0])
    assert answers[0] == answers[1]  # the PE's prefill gives the single engine's bits
    wait_idle(ref.port)
    wait_pair_idle(pair)


def test_chat_prompt_logprobs_at_the_top_level(servers):
    answers = []
    for url in both(servers):
        client = openai_client(url)
        r = client.chat.completions.create(
            model=MODEL, messages=[QUESTION], max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
        )
        ids, _ = tokenize_text(url, {"messages": [QUESTION]})
        assert r.usage is not None and r.usage.prompt_tokens == len(ids)
        check_prompt_logprobs(r.prompt_logprobs, ids, 2)  # type: ignore[attr-defined]
        answers.append(r.prompt_logprobs)  # type: ignore[attr-defined]
        plain = client.chat.completions.create(model=MODEL, messages=[QUESTION], max_tokens=1)
        assert plain.prompt_logprobs is None  # type: ignore[attr-defined]
    assert answers[0] == answers[1]


def echoed(url: str, stream: bool, **kw: Any) -> tuple[str, dict[str, list[Any]], str | None, int | None]:
    """(text, logprobs as one object, finish_reason, completion_tokens), whole or put together."""
    client = openai_client(url)
    if not stream:
        r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, temperature=0, **kw)
        c = r.choices[0]
        assert c.logprobs is not None and r.usage is not None
        return c.text, c.logprobs.model_dump(), c.finish_reason, r.usage.completion_tokens
    text, finish, usage = "", None, None
    lps: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    chunks = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, temperature=0, stream=True,
        stream_options={"include_usage": True}, **kw,
    )  # fmt: skip
    for ch in chunks:
        usage = ch.usage.completion_tokens if ch.usage else usage
        for c in ch.choices:
            text += c.text
            finish = c.finish_reason or finish
            for key, values in (c.logprobs.model_dump() if c.logprobs else {}).items():
                lps[key] += values
    return text, lps, finish, usage


def test_echo_with_logprobs_gives_the_prompts_logprobs(servers):
    """lm-evaluation-harness's loglikelihood: echo, logprobs, max_tokens 1 (or 0)."""
    ref, pair = servers
    ids = prompt_ids_of(ref.url, PROMPT)
    r = openai_client(ref.url).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    plp = r.choices[0].prompt_logprobs  # type: ignore[attr-defined]
    prompt_lps = [None] + [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], plp[1:], strict=True)]
    answers = []
    for url in both(servers):
        for stream in (False, True):
            text, lp, finish, num_out = echoed(url, stream, max_tokens=1, logprobs=1)
            assert text.startswith(PROMPT) and len(text) > len(PROMPT) and finish == "length" and num_out == 1
            assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][: len(ids)] == prompt_lps
            assert lp["top_logprobs"][0] is None and all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
            assert all(lp["top_logprobs"][j][lp["tokens"][j]] == lp["token_logprobs"][j] for j in range(1, len(ids)))
            offsets = lp["text_offset"]
            assert offsets[0] == 0 and offsets == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(offsets))]
            answers.append((text, lp))
            # max_tokens 0: the prompt alone, with its logprobs (vLLM samples one token it counts, unshown)
            text0, lp0, finish0, num_out0 = echoed(url, stream, max_tokens=0, logprobs=1)
            assert (text0, finish0, num_out0) == (PROMPT, "length", 1)
            assert lp0 == {k: v[: len(ids)] for k, v in lp.items()}
        whole = openai_client(url).completions.create(
            model=MODEL, prompt=PROMPT, echo=True, max_tokens=1, temperature=0, logprobs=1
        )
        check_prompt_logprobs(whole.choices[0].prompt_logprobs, ids, 1)  # type: ignore[attr-defined]
    assert all(a == answers[0] for a in answers)  # whole == streamed, single == pair
    wait_idle(ref.port)
    wait_pair_idle(pair)


def test_prompt_logprobs_refusals(servers):
    for url in both(servers):
        client = openai_client(url)
        create = client.completions.create
        kw: dict[str, Any] = dict(model=MODEL, prompt="x", max_tokens=1)
        message = refused(create, "prompt_logprobs", **kw, extra_body={"prompt_logprobs": -1})
        assert "whole vocabulary" in message
        for bad in (-2, 21, "3", 1.5, True):
            refused(create, "prompt_logprobs", **kw, extra_body={"prompt_logprobs": bad})
        for k in (0, 2):  # vLLM: not available when streamed
            refused(create, "prompt_logprobs", **kw, stream=True, extra_body={"prompt_logprobs": k})
        chat = client.chat.completions.create
        refused(chat, "prompt_logprobs", model=MODEL, messages=[QUESTION], extra_body={"prompt_logprobs": -1})
        refused(chat, "max_tokens", model=MODEL, messages=[QUESTION], max_tokens=0)
        message = refused(create, "max_tokens", model=MODEL, prompt="x", max_tokens=0)
        assert "echo" in message
