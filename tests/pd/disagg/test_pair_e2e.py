"""The P/D pair end to end (SmolLM2-135M, TCP handoff on loopback, striped over 4 sockets: each page of
5.9 MiB spans them all): a PE and a CE started on free ports
next to a single-engine server, all --deterministic. The openai client against the CE; bench/check_pd.py
against both (every case, streaming and 8 concurrent conversations included); the cluster token
required on /prefill and on the KV receiver; both pools back to idle afterwards."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd.tools.server_process import PDPair, get_json, rank_metrics, signed_headers
from tests.deploy.test_grafana_dashboard import (
    exposition_labels,
    load_dashboard,
    metric_names,
    missing_metrics,
)
from tests.deploy.test_k8s_monitoring import scaling_queries
from tests.pd.conftest import KV_TCP_STREAMS
from tests.server_fixtures import at_once, metric, openai_client, run_check_pd, wait_pair_idle

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
LONG = "Background: " + " ".join(f"Fact {i}: the value of item {i} is {i * 7 % 13}." for i in range(60))


@pytest.fixture(scope="module")
def servers(smollm_servers):
    """The session's SmolLM2 reference and pair (tests/pd/conftest.py), SMALL_DETERMINISTIC, the PE
    striping its handoffs over KV_TCP_STREAMS sockets."""
    return smollm_servers


def established_on_port(port: int) -> int:
    """Established TCP connections whose local port is port (IPv4, this network namespace)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        count += int(local.rsplit(":", 1)[1], 16) == port and state == "01"
    return count


def test_handoffs_go_over_the_striped_sockets(servers):
    """--kv-tcp-streams 4 on the PE: its kept connection to the CE's receiver is 4 sockets (the control
    connection and 3 data connections), each one authenticated."""
    ref, pair = servers
    before = _cluster_counters(pair.url)["handoffs"]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=4, temperature=0)
    got = openai_client(pair.url).chat.completions.create(**kw)
    held = established_on_port(pair.kv_port)  # NOTE: before the receiver closes the idle ones (--keepalive-s)
    assert held >= KV_TCP_STREAMS and held % KV_TCP_STREAMS == 0, held
    assert _cluster_counters(pair.url)["handoffs"] == before + 1
    want = openai_client(ref.url).chat.completions.create(**kw)
    assert got.choices[0].message.content == want.choices[0].message.content
    wait_pair_idle(pair)


@pytest.mark.smoke
def test_roles_and_health(servers):
    _, pair = servers
    status, ce = get_json(pair.url + "/health")
    assert status == 200 and ce["role"] == "ce" and ce["status"] == "ok"
    assert ce["prefill_engines"] == [{"url": pair.pe.url, "state": "up", "inflight": 0}]
    status, pe = get_json(pair.pe.url + "/health")
    assert status == 200 and pe["role"] == "pe"
    assert [m.id for m in openai_client(pair.url).models.list().data] == [MODEL]
    # the PE serves no OpenAI generation: a CE never prefills, a PE never decodes
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(pair.pe.url + "/v1/chat/completions", data=b"{}"))
    assert e.value.code in (404, 405)


def test_chat_matches_single_engine_with_usage_and_cached_tokens(servers):
    ref, pair = servers
    messages = [{"role": "user", "content": LONG + "\n\nWhat is the value of item 12?"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    first, want = at_once(
        lambda: openai_client(pair.url).chat.completions.create(**kw),
        lambda: openai_client(ref.url).chat.completions.create(**kw),
    )
    again = openai_client(pair.url).chat.completions.create(**kw)
    assert (
        first.choices[0].message.content
        == again.choices[0].message.content
        == want.choices[0].message.content
    )
    assert first.usage.prompt_tokens == want.usage.prompt_tokens > 256
    assert first.usage.completion_tokens == want.usage.completion_tokens
    # the second time the PE's prefix cache has the prompt's full pages; the CE reports the PE's count
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 256 and cached % 128 == 0 and cached < again.usage.prompt_tokens
    # streamed, with usage at the end
    text, usage = "", None
    for ch in openai_client(pair.url).chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    ):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text += c.delta.content or ""
    assert text == want.choices[0].message.content
    assert usage is not None and usage.prompt_tokens == want.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == cached
    m = rank_metrics(pair.ce.port)
    assert m["pdserve_engine_handoffs_imported_total"] >= 3
    wait_pair_idle(pair)


@pytest.mark.smoke
def test_check_pd_a_few_cases(servers, capsys):
    """The smoke set's share of check_pd (all of it takes minutes): greedy, and a JSON schema (the CE
    replays the PE's first token into the grammar)."""
    ref, pair = servers
    assert run_check_pd(ref, pair, "--concurrency", "1", "--only", "chat short greedy,chat json_schema", "--parallel", "2") == 0
    assert "2/2 cases identical" in capsys.readouterr().out
    wait_pair_idle(pair)


@pytest.mark.timeout(1800)
def test_check_pd_every_case(servers, capsys):
    """Every case, the two of 8 concurrent conversations (chat, completions) included, 8 cases at a time:
    the servers are --deterministic, so sharing batches changes no token, and on the CPU a decode step
    of one sequence costs about what one of eight does."""
    ref, pair = servers
    assert run_check_pd(ref, pair, "--concurrency", "8", "--parallel", "8") == 0
    out = capsys.readouterr().out
    assert "DIFF" not in out and "FAIL" not in out and "stream" in out and "conversation" in out
    assert "8 concurrent conversations" in out and "8 concurrent completion conversations" in out
    assert "37/37 cases identical" in out, out
    wait_pair_idle(pair)


def post_prefill(pair: PDPair, headers: dict[str, str], data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(pair.pe.url + "/prefill", data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, orjson.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read())


async def test_cluster_token_required(servers):
    import torch

    from engine.checkpoints import resolve_model
    from engine.core.kv_cache import layout_of
    from engine.handoff import SequenceExport
    from engine.models.registry import arch_from_hf, load_hf_config
    from engine.request import SamplingParams
    from transfer.errors import AUTH, HandoffError
    from transfer.header import model_fingerprint
    from transfer.sender import KVSender

    _, pair = servers
    refused_before = metric(pair.pe.url, "pdserve_unauthenticated_requests_total")
    # a body that passes the signature check and then fails validation (a 400, not a prefill)
    data = orjson.dumps({"request_id": f"unauth-{time.monotonic_ns()}", "prompt_token_ids": [1, 2, 3]})
    signed = signed_headers(pair.token, data)
    for headers in (
        {},  # no credentials
        {"Authorization": f"Bearer {pair.token}"},  # the old scheme: the secret itself on the wire
        signed_headers("wrong-token-wrong-token-0123", data),
        {**signed, "Authorization": signed["Authorization"].replace("ts=", "ts=1")},  # tampered
        {"Authorization": "Bearer \udcff".encode("utf-8", "surrogateescape").decode("latin-1")},
    ):
        status, body = post_prefill(pair, headers, data)
        assert status == 401 and body["error"]["code"] == "unauthorized", (headers, body)
    assert post_prefill(pair, signed, data)[0] == 400  # signed: it reaches the body's checks
    status, body = post_prefill(pair, signed, data)  # the same request again: a replay
    assert status == 401 and body["error"]["code"] == "unauthorized"
    assert post_prefill(pair, signed, data + b" ")[0] == 401  # another body under that signature
    log = pair.pe.log_tail(20000)
    assert "refused POST /prefill" in log and "replayed" in log
    assert metric(pair.pe.url, "pdserve_unauthenticated_requests_total") - refused_before == 7

    folder = resolve_model(MODEL)
    layout = layout_of(arch_from_hf(load_hf_config(folder)), 128, torch.float32)
    pages = torch.zeros((1, layout.num_full_layers, 2, 128, layout.num_kv_heads, layout.head_dim))
    export = SequenceExport("intruder", [1, 2, 3], [4], 3, SamplingParams(max_tokens=4), 0, pages, None)
    sender = KVSender(b"wrong-token-wrong-token-0123", layout, model=model_fingerprint(folder))
    with pytest.raises(HandoffError) as e:
        await sender.send(f"127.0.0.1:{pair.kv_port}", export, timeout_s=30)
    assert e.value.code == AUTH
    deadline = time.monotonic() + 10
    while rank_metrics(pair.ce.port).get("pdserve_engine_handoffs_refused_auth_total", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    # and the cluster keeps serving
    r = openai_client(pair.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert r.choices[0].message.content
    wait_pair_idle(pair)


def test_every_dashboard_metric_is_exported(servers):
    """Every series deploy/grafana/pdserve.json queries is exported by these servers, and every series
    the autoscaling examples (deploy/k8s/monitoring/scaledobject.yaml) scale on."""
    ref, pair = servers
    for url in (ref.url, pair.url):
        # two tokens at least: an inter-token latency, and on the pair a handoff (not a PE-only answer)
        openai_client(url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        with pytest.raises(openai.NotFoundError):  # an error response, counted by status
            openai_client(url).chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
            )
    exported: dict[str, set[str]] = {}
    for server in (ref, pair.ce, pair.pe):
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        for name, labels in exposition_labels(text).items():
            exported.setdefault(name, set()).update(labels)
        # every vllm: sample and every TTFT phase carries the served name, as vLLM's series do
        unnamed = [
            s.name for f in text_string_to_metric_families(text) for s in f.samples
            if f.name.startswith(("vllm:", "pdserve_ttft_phase_seconds")) and s.labels.get("model_name") != MODEL
        ]  # fmt: skip
        assert unnamed == [], (server.url, unnamed)
    assert "model_name" in exported["pdserve_ttft_phase_seconds_count"]
    assert missing_metrics(load_dashboard(), exported) == []
    for query in scaling_queries():
        assert metric_names(query) <= set(exported), query


def _cluster_counters(url: str) -> dict[str, float]:
    """The CE coordinator's handoff counters (summed over transports)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {"bytes": 0.0, "skipped": 0.0, "handoffs": 0.0}
    for line in text.splitlines():
        for key, name in (
            ("bytes", "pdserve_handoff_bytes_total{"),
            ("skipped", "pdserve_handoff_skipped_tokens_total{"),
            ("handoffs", "pdserve_handoffs_total{"),
        ):
            if line.startswith(name):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def test_multi_turn_hands_off_only_what_the_ce_lacks(servers):
    """The CE keeps each finished turn's pages (--decode-cache, on by default): from turn 2 on the PE
    sends the new tokens' pages (plus the page they start in) only, and the output stays identical."""
    ref, pair = servers
    block = 128  # EngineConfig's default block_size, which these servers run with
    notes = "Notes for the retention test. " + " ".join(f"Entry {i} reads {i * 11 % 17}." for i in range(70))
    messages = [{"role": "user", "content": notes + "\n\nWhat does entry 3 read?"}]
    page_bytes, previous = 0.0, 0
    for turn in range(6):
        before = _cluster_counters(pair.url)
        kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        got, want = at_once(  # the reference's request counts nothing on the pair
            lambda kw=kw: openai_client(pair.url).chat.completions.create(**kw),
            lambda kw=kw: openai_client(ref.url).chat.completions.create(**kw),
        )
        assert got.choices[0].message.content == want.choices[0].message.content, turn
        after = _cluster_counters(pair.url)
        assert after["handoffs"] == before["handoffs"] + 1
        sent, skipped = after["bytes"] - before["bytes"], after["skipped"] - before["skipped"]
        prompt = got.usage.prompt_tokens
        if turn == 0:
            assert skipped == 0
            page_bytes = sent / -(-prompt // block)  # a llama model: pages only, no SWA state
        else:
            assert skipped > 0 and skipped % block == 0 and skipped >= previous // block * block - block
            new_pages = -(-(prompt - previous) // block)
            assert sent <= (new_pages + 1) * page_bytes, (turn, sent, new_pages, page_bytes)
        previous = prompt
        messages += [
            {"role": "assistant", "content": got.choices[0].message.content},
            {"role": "user", "content": f"And entry {turn + 10}?"},
        ]
    m = rank_metrics(pair.ce.port)
    assert m["pdserve_engine_decode_cache_hit_tokens_total"] > 0
    # vLLM's local prefix cache is the CE's decode cache, in the same tokens
    hits = metric(pair.ce.url, "vllm:prefix_cache_hits_total", engine="0")
    assert hits == m["pdserve_engine_decode_cache_hit_tokens_total"]
    assert metric(pair.ce.url, "vllm:prefix_cache_queries_total", engine="0") >= hits
    wait_pair_idle(pair)
