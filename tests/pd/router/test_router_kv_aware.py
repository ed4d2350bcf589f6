"""`pdserve router --routing kv-aware` (issue 51) over the shared SmolLM2 servers (tests/pd/conftest.py: a
single server and a P/D pair's CE, both publishing KV events): the router subscribes to the streams each
CE's /health names, gets a chat's token ids from a CE's /tokenize and a completion's from its body, and
sends chats that share a long system prompt to the engine holding its pages, although their first user
turns' rendezvous order puts them on the other one."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd.disagg.membership import hrw_order
from pd.tools.server_process import PDPair, ServerProcess, get_json
from tests.pd.conftest import SMOLLM
from tests.server_fixtures import metric


@pytest.fixture(scope="module")
def router(smollm_servers: tuple[ServerProcess, PDPair], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    ref, pair = smollm_servers
    r = ServerProcess("--decode-url", f"{ref.url},{pair.url}", "--routing", "kv-aware",
                      command=(sys.executable, "-m", "pd.router.server"),
                      log_path=Path(tmp_path_factory.mktemp("router-kv")) / "router.log")  # fmt: skip
    r.start()
    try:
        deadline = time.monotonic() + 60
        while True:  # both CEs up, and a stream of each subscribed
            try:
                status, body = get_json(r.url + "/health")
                if status == 200 and body.get("kv_index", {}).get("streams") == 2:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, r.log_tail()
            time.sleep(0.2)
        yield r
    finally:
        r.terminate()
        r.stop()


def chat(url: str, messages: list[dict[str, str]]) -> dict:
    body = {"model": SMOLLM, "messages": messages, "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def selected(router: str, ce: str, reason: str) -> float:
    return metric(router, "pdserve_router_backend_selected_total", backend=ce, reason=reason)


def test_chats_sharing_a_system_prompt_go_where_its_pages_are(router: ServerProcess, smollm_servers) -> None:
    ref, pair = smollm_servers
    urls = [ref.url, pair.url]
    nonce = uuid.uuid4().hex  # pages no engine holds yet
    system = f"Session {nonce}. You answer questions about a warehouse. " + " ".join(
        f"Shelf {i} holds {nonce[i % 32]} boxes of item {i * 7}." for i in range(60)
    )  # about 900 tokens: several 128-token pages
    tokenized = metric(router.url, "pdserve_router_prompt_ids_total", source="tokenize")
    sent_cached = {u: metric(router.url, "pdserve_router_kv_sent_cached_tokens_total", backend=u) for u in urls}
    before = {u: (selected(router.url, u, "kv-hit"), selected(router.url, u, "kv-miss")) for u in urls}
    first = chat(router.url, [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}])
    assert first["usage"]["prompt_tokens"] > 3 * 128
    home = next(u for u in urls if selected(router.url, u, "kv-miss") - before[u][1] == 1)
    # the home engine's events reach the router: its index holds the system prompt's pages
    deadline = time.monotonic() + 30
    while get_json(router.url + "/health")[1]["kv_index"]["blocks"] < 3:
        assert time.monotonic() < deadline, router.log_tail()
        time.sleep(0.1)
    # user turns whose conversation order puts them on the other engine
    users = [u for u in (f"Which shelf is item {i}?" for i in range(200)) if hrw_order(u, urls)[0] != home][:3]
    for user in users:
        r = chat(router.url, [{"role": "system", "content": system}, {"role": "user", "content": user}])
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 128, r["usage"]
    assert selected(router.url, home, "kv-hit") - before[home][0] == len(users)
    other = next(u for u in urls if u != home)
    assert selected(router.url, other, "kv-hit") + selected(router.url, other, "kv-miss") == sum(before[other])
    assert metric(router.url, "pdserve_router_prompt_ids_total", source="tokenize") - tokenized == 1 + len(users)
    # the router's own series: its index per CE rank, and the cached tokens it expected where it sent them
    assert metric(router.url, "pdserve_router_kv_index_blocks", backend=home) >= 3
    assert metric(router.url, "pdserve_router_kv_sent_cached_tokens_total", backend=home) - sent_cached[home] >= 3 * 128 * len(users)
    assert metric(router.url, "pdserve_router_kv_events_gaps_total", backend=home) == 0


def test_a_completion_of_token_ids_is_routed_by_its_own_ids(router: ServerProcess) -> None:
    from_body = metric(router.url, "pdserve_router_prompt_ids_total", source="body")
    body = {"model": SMOLLM, "prompt": list(range(1000, 1300)), "max_tokens": 1, "temperature": 0}
    req = urllib.request.Request(router.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert json.loads(r.read())["usage"]["prompt_tokens"] == 300
    assert metric(router.url, "pdserve_router_prompt_ids_total", source="body") - from_body == 1


def test_prompt_ids_read_from_a_body() -> None:
    from pd.router.key import prompt_ids

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [], "temperature": 0.5}
    assert prompt_ids("/v1/chat/completions", chat) == {"model": "m", "messages": chat["messages"], "tools": []}
    assert prompt_ids("/invocations", chat) == prompt_ids("/v1/chat/completions", chat)
    assert prompt_ids("/v1/completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_ids("/v1/completions", {"prompt": [[4, 5], [6]]}) == [4, 5]
    assert prompt_ids("/v1/completions", {"prompt": ["a b", "c"], "add_special_tokens": False}) == {
        "prompt": "a b", "add_special_tokens": False}  # fmt: skip
    for path, body in (("/v1/completions", {"prompt": [1, "x"]}), ("/v1/completions", {"prompt": []}),
                       ("/v1/chat/completions", {"messages": "hi"}), ("/v1/models", {}),
                       ("/v1/completions", [1, 2])):  # fmt: skip
        assert prompt_ids(path, body) is None


def test_a_bad_routing_or_weight_is_refused() -> None:
    from pd.router.config import RouterConfig

    with pytest.raises(ValueError, match="--routing"):
        RouterConfig(decode_url="http://127.0.0.1:1", routing="nearest")
    with pytest.raises(ValueError, match="--kv-load-weight"):
        RouterConfig(decode_url="http://127.0.0.1:1", routing="kv-aware", kv_load_weight=-1)


def test_a_stream_passes_through(router: ServerProcess) -> None:
    from tests.server_fixtures import openai_client

    stream = openai_client(router.url).chat.completions.create(
        model=SMOLLM, messages=[{"role": "user", "content": "Count to five."}], max_tokens=6, temperature=0,
        stream=True, timeout=120,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
    assert 1 <= len(chunks) <= 6
