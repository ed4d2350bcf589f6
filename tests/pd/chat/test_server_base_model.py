"""A base model with no chat template (Gemma 3 270M) serves /v1/completions; its chat requests get a
clear 400, and a --chat-template file makes chat work."""

from __future__ import annotations

import openai
import pytest

from pd.tools.server_process import ServerProcess
from tests.server_fixtures import openai_client

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess("--model", MODEL, "--max-model-len", "512", "--kv-cache-gb", "0.1", log_path=log) as s:
        yield openai_client(s.url, timeout_s=300)


def test_base_model_completes_and_refuses_chat(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert e.value.body["code"] == "no_chat_template" and "chat template" in e.value.body["message"]
    again = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=2, temperature=0)
    assert again.choices[0].text


def test_chat_template_file(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    log = tmp_path / "server.log"
    with ServerProcess(
        "--model",
        MODEL,
        "--max-model-len",
        "512",
        "--kv-cache-gb",
        "0.1",
        "--chat-template",
        str(path),
        log_path=log,
    ) as s:
        c = openai_client(s.url, timeout_s=300)
        r = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
        )
        assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
