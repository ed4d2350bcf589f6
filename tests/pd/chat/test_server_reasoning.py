"""End to end through the real `openai` client: a server with a test chat template that opens <think>
in the prompt and shows chat_template_kwargs / reasoning_effort, `--reasoning-parser deepseek_r1` and
`--api-key`; the refusals of non-text inputs; GET /v1/models/{id}; X-Request-Id on every answer.

SmolLM2-135M never writes </think>, so with deepseek_r1 its whole answer is reasoning."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from pd.tools.server_process import ServerProcess
from tests.server_fixtures import SMALL_DETERMINISTIC

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
API_KEY = "sk-reasoning-test-key"
HI = [{"role": "user", "content": "What is the capital of France?"}]
TEMPLATE = (
    "<|im_start|>system\n[thinking={{ 'off' if enable_thinking is defined and not enable_thinking else 'on' }}"
    " effort={{ reasoning_effort | default('unset') }}]<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    (tmp / "template.jinja").write_text(TEMPLATE)
    flags = ("--chat-template", str(tmp / "template.jinja"), "--reasoning-parser", "deepseek_r1")
    args = ("--model", MODEL, *SMALL_DETERMINISTIC, *flags, "--api-key", API_KEY)
    with ServerProcess(*args, log_path=tmp / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def call(server, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a POST (a GET without a body), with the API key."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        server.url + path,
        data=data,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def rendered_ids(server, **extra) -> list[int]:
    status, body, _ = call(server, "/tokenize", {"model": MODEL, "messages": HI, **extra})
    assert status == 200, body
    return body["tokens"]


def rendered(server, **extra) -> str:
    status, body, _ = call(server, "/detokenize", {"model": MODEL, "tokens": rendered_ids(server, **extra)})
    assert status == 200, body
    return body["prompt"]


def test_template_kwargs_and_reasoning_effort_reach_the_template(server, client):
    assert "[thinking=on effort=unset]" in rendered(server)
    text = rendered(server, chat_template_kwargs={"enable_thinking": False}, reasoning_effort="high")
    assert "[thinking=off effort=high]" in text and text.endswith("<think>\n")
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "medium"}
    _, tokenized, _ = call(server, "/tokenize", {"messages": HI, **extra})
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, extra_body=extra)
    assert r.usage.prompt_tokens == tokenized["count"] != len(rendered_ids(server))
    status, body, _ = call(server, "/tokenize", {"messages": HI, "chat_template_kwargs": {"tools": []}})
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs", body


def test_deepseek_r1_unterminated_answer_is_all_reasoning(client):
    kw = dict(model=MODEL, messages=HI, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    m = client.chat.completions.create(**kw).choices[0].message
    assert m.content is None and m.reasoning_content and "</think>" not in m.reasoning_content
    reasoning, content = "", ""
    for ch in client.chat.completions.create(**kw, stream=True):
        reasoning += getattr(ch.choices[0].delta, "reasoning_content", None) or ""
        content += ch.choices[0].delta.content or ""
    assert (reasoning, content) == (m.reasoning_content, "")
    hidden = client.chat.completions.create(
        **{**kw, "max_tokens": 2, "extra_body": {"ignore_eos": True, "include_reasoning": False}}
    )
    assert hidden.choices[0].message.reasoning_content is None and hidden.choices[0].message.content is None


@pytest.mark.parametrize(
    "extra,param",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
                    }
                ]
            },
            "messages[0].content",
        ),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_refusals(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": HI, "max_tokens": 2, **extra})
    assert e.value.body["param"] == param, e.value.body


def test_retrieve_model(server, client):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "pdserve")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    status, body, _ = call(server, f"/v1/models/{MODEL}", headers={"Authorization": "Bearer wrong"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_request_id_echoed_streamed_and_on_errors(server, client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HI, max_tokens=1, stream=True, extra_headers={"X-Request-Id": "rsn-stream-1"}
    )
    assert raw.headers["x-request-id"] == "rsn-stream-1"
    assert sum(1 for _ in raw.parse()) > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=0, extra_headers={"X-Request-Id": "rsn-error-1"}
        )
    assert e.value.response.headers["x-request-id"] == "rsn-error-1"
    status, _, headers = call(server, "/v1/models/nope", headers={"X-Request-Id": "rsn-404"})
    assert status == 404 and headers["X-Request-Id"] == "rsn-404"
