"""Issue 55's parts of vLLM's OpenAI surface, through the official `openai` client against the session's
single-engine server and P/D pair (SmolLM2-135M, --deterministic), each as vLLM's own tests ask:
usage in every chunk (`stream_options.continuous_usage_stats`), chat's `echo` with
`continue_final_message`, GET /tokenizer_info, /tokenize with tools, GET /load, POST /invocations, an
empty `prompt_embeds` beside a prompt, `vllm:iteration_tokens_total`, and beam search (`use_beam_search`)."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pd.tools.server_process import ServerProcess, get_json
from tests.pd.api.test_openai_surface import post_json, refused
from tests.server_fixtures import metric, openai_client, wait_pair_idle

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SAYING = "Here is a common saying about apple. An apple a day, keeps"
PREFILLED = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": SAYING}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
BOTH_USAGES = {"include_usage": True, "continuous_usage_stats": True}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def servers(smollm_servers):
    """The session's SmolLM2 reference and pair (tests/pd/conftest.py), SMALL_DETERMINISTIC."""
    return smollm_servers


def both(servers: tuple[ServerProcess, Any]) -> list[str]:
    ref, pair = servers
    return [ref.url, pair.url]


# ---- usage in every chunk ------------------------------------------------------------------------------


def test_completions_usage_in_every_chunk(servers):
    """vLLM's test_completion_stream_options: every chunk's usage has the prompt and the tokens so far; the
    last chunk (no choices) the totals."""
    texts = []
    for url in both(servers):
        client = openai_client(url)
        kw: dict[str, Any] = dict(
            model=MODEL, prompt="What is an LLM?", max_tokens=5, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(client.completions.create(**kw, stream_options=BOTH_USAGES))
        *pieces, last = chunks
        assert pieces and all(c.usage is not None for c in chunks)
        done = [c.usage.completion_tokens for c in pieces]
        assert done == sorted(done) and done[0] > 0 and done[-1] == 5, done
        for c in chunks:
            assert c.usage.prompt_tokens > 0 and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        assert pieces[-1].choices[0].finish_reason == "length"
        assert last.choices == [] and (last.usage.completion_tokens, last.usage.total_tokens) == (5, last.usage.prompt_tokens + 5)
        # include_usage alone: null in every chunk but the last; continuous_usage_stats alone asks for nothing (vLLM's)
        plain = list(client.completions.create(**kw, stream_options={"include_usage": True}))
        assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage == last.usage
        alone = list(client.completions.create(**kw, stream_options={"continuous_usage_stats": True}))
        assert all(c.usage is None for c in alone) and alone[-1].choices
        texts.append("".join(c.choices[0].text for c in pieces))
    assert texts[0] == texts[1]


def test_chat_usage_in_every_chunk(servers):
    """vLLM's test_chat_streaming's continuous case: completion_tokens grow chunk by chunk, the last
    (usage-only) chunk repeats the total; n = 2 counts each choice's own."""
    for url in both(servers):
        client = openai_client(url)
        kw: dict[str, Any] = dict(model=MODEL, messages=PREFILLED[:1], max_tokens=10, temperature=0, stream=True)
        chunks = list(client.chat.completions.create(**kw, stream_options=BOTH_USAGES, extra_body={"ignore_eos": True}))
        last_done = 0
        for c in chunks:
            assert c.usage is not None and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
            assert c.usage.completion_tokens > last_done or (not c.choices and c.usage.completion_tokens == last_done)
            last_done = c.usage.completion_tokens
        assert last_done == 10 and chunks[-1].choices == []
        per_choice: dict[int, list[int]] = {0: [], 1: []}
        for c in client.chat.completions.create(**kw, n=2, stream_options=BOTH_USAGES, extra_body={"ignore_eos": True}):
            for ch in c.choices:
                per_choice[ch.index].append(c.usage.completion_tokens)
        assert all(v and v == sorted(v) and v[-1] == 10 for v in per_choice.values()), per_choice
    wait_pair_idle(servers[1])


# ---- chat echo -----------------------------------------------------------------------------------------


def test_chat_echo_with_continue_final_message(servers):
    """vLLM's test_chat_session_with_echo_and_continue_final_message: echo puts the continued message's
    content before the continuation, whole and streamed; without echo the continuation alone."""
    answers = []
    for url in both(servers):
        client = openai_client(url)
        kw: dict[str, Any] = dict(model=MODEL, messages=PREFILLED, max_tokens=8, temperature=0)
        echoed = client.chat.completions.create(**kw, extra_body={"echo": True, **CONTINUE})
        plain = client.chat.completions.create(**kw, extra_body={"echo": False, **CONTINUE})
        content = echoed.choices[0].message.content
        assert echoed.choices[0].message.role == "assistant"
        assert content == SAYING + plain.choices[0].message.content and SAYING not in plain.choices[0].message.content
        assert echoed.usage.completion_tokens == plain.usage.completion_tokens  # the echo is no output
        stream = client.chat.completions.create(**kw, stream=True, extra_body={"echo": True, **CONTINUE})
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content
        # a generation prompt after a user's message: nothing to echo (the answer's role is the assistant's)
        question = client.chat.completions.create(**{**kw, "messages": PREFILLED[:1]}, extra_body={"echo": True})
        assert not question.choices[0].message.content.startswith(PREFILLED[0]["content"])
        answers.append(content)
    assert answers[0] == answers[1]


# ---- the tokenizer ---------------------------------------------------------------------------------------


def test_tokenizer_info(servers):
    """vLLM's five test_tokenizer_info_* cases, on both servers (the same answer)."""
    infos = []
    for url in both(servers):
        status, info = get_json(url + "/tokenizer_info")
        assert status == 200, info
        assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
        types = {"bos_token": str, "eos_token": str, "pad_token": str, "unk_token": str, "chat_template": str,
                 "model_max_length": int, "added_tokens_decoder": dict}  # fmt: skip
        for field, kind in types.items():
            assert isinstance(info.get(field), kind), (field, info.get(field))
        for token_id, token in info["added_tokens_decoder"].items():
            assert token_id.isdigit() and isinstance(token["content"], str) and isinstance(token["special"], bool)
        assert info["added_tokens_decoder"]["0"]["content"] == "<|endoftext|>"
        status, t = post_json(url, "/tokenize", {"prompt": "Hello world!"})
        assert status == 200 and info["model_max_length"] >= t["max_model_len"]
        assert info["chat_template"].strip() and "<|im_start|>" in info["chat_template"]
        assert info["name_or_path"] == MODEL and "vocab_file" not in info  # no path of the host
        infos.append(info)
    assert infos[0] == infos[1]


def test_tokenize_with_tools_counts_what_chat_sends(servers):
    """/tokenize renders the tools as a chat request does (SmolLM2's template has no tools: the fallback
    prompt), so its count is the chat answer's prompt_tokens."""
    for url in both(servers):
        messages = [{"role": "user", "content": "What's the weather like in Paris today?"}]
        status, t = post_json(url, "/tokenize", {"messages": messages, "tools": TOOLS})
        assert status == 200, t
        status, without = post_json(url, "/tokenize", {"messages": messages})
        assert status == 200 and without["count"] < t["count"]
        status, d = post_json(url, "/detokenize", {"tokens": t["tokens"]})
        assert status == 200 and "get_weather" in d["prompt"]
        r = openai_client(url).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=1)
        assert r.usage.prompt_tokens == t["count"]


# ---- /load and /invocations ------------------------------------------------------------------------------


def _load(url: str) -> int:
    status, body = get_json(url + "/load")
    assert status == 200, body
    return int(body["server_load"])


def _wait_load(url: str, want: int) -> int:
    deadline = time.monotonic() + 10
    while (n := _load(url)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_server_load_counts_requests_in_flight(servers):
    """vLLM's test_server_load: 0 idle, 1 while a (streamed) request is served, 0 after."""
    for url in both(servers):
        assert _wait_load(url, 0) == 0
        client = openai_client(url)
        stream = client.completions.create(
            model=MODEL, prompt="Give me a long story", max_tokens=200, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(stream))
        assert _load(url) == 1
        stream.close()
        assert _wait_load(url, 0) == 0
    assert _load(servers[1].pe.url) == 0  # a PE's: its /prefill requests
    wait_pair_idle(servers[1])


def test_invocations_routes_by_body(servers):
    """SageMaker's POST /invocations (vLLM's): 'messages' is a chat completion, 'prompt' a completion, the
    same answers as their own endpoints; streamed too; anything else a 400."""
    for url in both(servers):
        client = openai_client(url)
        chat = dict(model=MODEL, messages=PREFILLED[:1], max_tokens=4, temperature=0)
        got = client.post(url + "/invocations", body=chat, cast_to=ChatCompletion)
        want = client.chat.completions.create(**chat)
        assert got.object == "chat.completion" and got.choices[0].message.content == want.choices[0].message.content
        completion = dict(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
        got_c = client.post(url + "/invocations", body=completion, cast_to=Completion)
        assert got_c.object == "text_completion"
        assert got_c.choices[0].text == client.completions.create(**completion).choices[0].text
        stream = client.post(
            url + "/invocations", body={**chat, "stream": True}, cast_to=ChatCompletionChunk, stream=True,
            stream_cls=openai.Stream[ChatCompletionChunk],
        )  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as e:
            client.post(url + "/invocations", body={"model": MODEL, "input": "x"}, cast_to=Completion)
        assert e.value.body["param"] == "messages"


# ---- prompt_embeds -------------------------------------------------------------------------------------


def test_empty_prompt_embeds_beside_a_prompt_is_no_embeddings(servers):
    """vLLM's: prompt_embeds [] beside a prompt is as if absent; embeddings themselves are a 400 naming the
    field (this server takes token ids and text only); [] alone leaves no prompt."""
    for url in both(servers):
        client = openai_client(url)
        kw: dict[str, Any] = dict(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
        with_empty = client.completions.create(**kw, extra_body={"prompt_embeds": []})
        assert with_empty.choices[0].text == client.completions.create(**kw).choices[0].text
        refused(client.completions.create, "prompt_embeds", **kw, extra_body={"prompt_embeds": "AAAA"})
        refused(client.completions.create, "prompt", model=MODEL, prompt=None, extra_body={"prompt_embeds": []})


# ---- vllm:iteration_tokens_total -------------------------------------------------------------------------


def _histogram(url: str) -> tuple[float, float]:
    return metric(url, "vllm:iteration_tokens_total_count"), metric(url, "vllm:iteration_tokens_total_sum")


def test_iteration_tokens(servers):
    """vLLM's test_metrics_counts: N tokens generated one a step from a P-token prompt are N steps of
    P + N tokens in all. Under P/D the PE's one step has the prompt and the first token, the CE's the rest."""
    ref, pair = servers
    wait_pair_idle(pair)
    prompt_ids = post_json(ref.url, "/tokenize", {"prompt": "Hello my name is Robert and I love magic"})[1]["tokens"]
    urls = [ref.url, pair.url, pair.pe.url]
    before = {u: _histogram(u) for u in urls}
    kw: dict[str, Any] = dict(model=MODEL, prompt=prompt_ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    for url in (ref.url, pair.url):
        for _ in range(2):
            openai_client(url).completions.create(**kw)
    moved = {u: tuple(a - b for a, b in zip(_histogram(u), before[u])) for u in urls}
    assert moved[ref.url] == (2 * 10, 2 * (len(prompt_ids) + 10)), moved
    assert moved[pair.pe.url] == (2, 2 * (len(prompt_ids) + 1)), moved
    assert moved[pair.url] == (2 * 9, 2 * 9), moved
    wait_pair_idle(pair)


# ---- beam search ----------------------------------------------------------------------------------------


def _beam(**kw: Any) -> dict[str, Any]:
    return {"use_beam_search": True, **kw}


def test_batch_completions_with_beam_search(servers):
    """vLLM's test_batch_completions, beam part: two prompts, n=2 beams each, best first, different texts;
    the same prompt twice gives the same beams; single and P/D alike."""
    answers = []
    for url in both(servers):
        client = openai_client(url)
        out = client.completions.create(
            model=MODEL, prompt=["Hello, my name is"] * 2, n=2, max_tokens=5, extra_body=_beam()
        )
        assert len(out.choices) == 4 and [c.index for c in out.choices] == [0, 1, 2, 3]
        assert out.choices[0].text != out.choices[1].text
        assert [c.text for c in out.choices[:2]] == [c.text for c in out.choices[2:]]
        assert all(c.finish_reason in ("stop", "length") for c in out.choices)
        assert out.usage.completion_tokens <= 4 * 5 and out.usage.prompt_tokens > 0
        answers.append([(c.text, c.finish_reason) for c in out.choices])
        with pytest.raises(openai.BadRequestError) as e:  # vLLM's: beam search is not streamed on completions
            client.completions.create(model=MODEL, prompt="Hi", n=2, max_tokens=5, stream=True, extra_body=_beam())
        assert e.value.body["param"] == "stream"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="Hi", n=11, best_of=11, max_tokens=5, extra_body=_beam())
        assert e.value.body["param"] == "n"
    assert answers[0] == answers[1]


def _reference_beams(url: str, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """vLLM's beam search (ignore_eos) worked out from plain greedy requests' top 2 x width logprobs, each
    candidate's token id found by its text in the tokenizer's vocabulary: [(tokens, cum_logprob)], best first."""
    from pd.frontend.coordinator import load_tokenizer

    tok = load_tokenizer(MODEL)
    ids_of: dict[str, list[int]] = {}
    for i in range(len(tok)):
        ids_of.setdefault(tok.decode([i]), []).append(i)
    client = openai_client(url)
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    for _ in range(steps):
        candidates = []
        for tokens, cum in beams:
            out = client.completions.create(
                model=MODEL, prompt=prompt + tokens, max_tokens=1, temperature=0, logprobs=2 * width,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            top = sorted(out.choices[0].logprobs.top_logprobs[0].items(), key=lambda kv: -kv[1])[: 2 * width]
            for text, lp in top:
                assert len(ids_of[text]) == 1, f"{text!r} is more than one token"
                candidates.append((tokens + ids_of[text], cum + lp))
        beams = sorted(candidates, key=lambda c: -c[1])[:width]
    return beams  # one length: the score's order is the cumulative logprob's


def test_beam_search_matches_its_steps_worked_out_by_hand(servers):
    """Width 2, 3 tokens, ignore_eos: the beams (and their logprobs) are the ones vLLM's procedure picks from
    the server's own greedy logprobs; width 1 is greedy decoding."""
    from pd.frontend.coordinator import load_tokenizer

    ref, _ = servers
    tok = load_tokenizer(MODEL)
    prompt_ids = tok.encode("The best thing about Paris is")
    want = _reference_beams(ref.url, prompt_ids, 2, 3)
    for url in both(servers):
        client = openai_client(url)
        out = client.completions.create(
            model=MODEL, prompt=prompt_ids, n=2, max_tokens=3, logprobs=1, extra_body=_beam(ignore_eos=True)
        )
        got = [(c.text, sum(c.logprobs.token_logprobs)) for c in out.choices]
        assert [t for t, _ in got] == [tok.decode(ids) for ids, _ in want]
        for (_, cum), (_, want_cum) in zip(got, want, strict=True):
            assert cum == pytest.approx(want_cum, abs=1e-4)
        assert all(c.finish_reason == "length" and len(c.logprobs.tokens) == 3 for c in out.choices)
        assert out.usage.completion_tokens == 6
        kw: dict[str, Any] = dict(model=MODEL, prompt=prompt_ids, max_tokens=6)
        greedy = client.completions.create(**kw, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
        assert client.completions.create(**kw, extra_body=_beam(ignore_eos=True)).choices[0].text == greedy


def test_chat_with_beam_search(servers):
    """vLLM's test_chat_streaming's beam case (n=2, top_logprobs): two different answers, with their tokens'
    logprobs; streamed, the same answers (one chunk each, as vLLM's); single and P/D alike."""
    answers = []
    for url in both(servers):
        client = openai_client(url)
        kw: dict[str, Any] = dict(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], n=2,
            max_completion_tokens=10, extra_body=_beam(length_penalty=0.5),
        )  # fmt: skip
        out = client.chat.completions.create(**kw, logprobs=True, top_logprobs=5)
        assert len(out.choices) == 2 and out.choices[0].message.content != out.choices[1].message.content
        for c in out.choices:
            assert c.logprobs is not None and c.logprobs.content
            assert all(len(t.top_logprobs) == 5 for t in c.logprobs.content)
        assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        streamed = ["", ""]
        for chunk in chunks:
            for c in chunk.choices:
                streamed[c.index] += c.delta.content or ""
        assert streamed == [c.message.content for c in out.choices]
        answers.append([(c.message.content, c.finish_reason) for c in out.choices])
    assert answers[0] == answers[1]


def test_beam_search_under_pd_prefills_every_step_at_the_pe_from_its_prefix_cache(servers):
    """Under P/D each beam step is a one-token request the PE answers: the first prefills the prompt, the
    later ones find its pages in the PE's prefix cache (cached tokens, counted by the CE), and none opens a
    handoff (the CE counts no failed one); the beams are the single server's."""
    ref, pair = servers
    prompt = " ".join(f"word{i}" for i in range(300)) + " The end is"
    kw: dict[str, Any] = dict(model=MODEL, prompt=prompt, n=2, max_tokens=3, extra_body=_beam())
    cached, failed = metric(pair.url, "pdserve_cached_prompt_tokens_total"), metric(pair.url, "pdserve_engine_handoffs_failed_total")
    out = openai_client(pair.url).completions.create(**kw)
    num_prompt = out.usage.prompt_tokens
    assert num_prompt > 1000 and out.usage.prompt_tokens_details.cached_tokens == 0  # the first step's
    later_steps = 2 + 2  # width 2, steps 2 and 3
    assert metric(pair.url, "pdserve_cached_prompt_tokens_total") - cached >= later_steps * (num_prompt // 2)
    assert metric(pair.url, "pdserve_engine_handoffs_failed_total") == failed
    assert [c.text for c in out.choices] == [c.text for c in openai_client(ref.url).completions.create(**kw).choices]
