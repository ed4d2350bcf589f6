"""/metrics as the tools built for vLLM read it, and --log-format json, on a real server (a tiny random
Llama with SmolLM2's tokenizer) through the real `openai` client: counters are typed counters; the
`vllm:` series carry vLLM's names, types, labels and buckets, and move by what the requests did (token
counters by the usage the client got, one success per request, running and KV usage while a request
decodes); every log line is one JSON object with the request's id where one is served."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd.tools.server_process import ServerProcess
from tests.server_fixtures import openai_client
from tests.tiny_models import make_servable

pytestmark = pytest.mark.slow

SERVED = "tiny-llama"

# vLLM v1's series that production-stack's router, its dashboards, KEDA examples and llm-d's endpoint
# picker read: name, type, labels. Source: vLLM's "Production Metrics" page (docs.vllm.ai/en/stable/
# usage/metrics/) and its Prometheus logger, vllm/v1/metrics/loggers.py (labelnames = ["model_name",
# "engine"]; vllm:request_success adds "finished_reason").
VLLM_SERIES = {
    "vllm:num_requests_running": ("gauge", {"model_name", "engine"}),
    "vllm:num_requests_waiting": ("gauge", {"model_name", "engine"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name", "engine"}),
    "vllm:gpu_cache_usage_perc": ("gauge", {"model_name", "engine"}),
    "vllm:num_preemptions": ("counter", {"model_name", "engine"}),
    "vllm:prompt_tokens": ("counter", {"model_name", "engine"}),
    "vllm:generation_tokens": ("counter", {"model_name", "engine"}),
    "vllm:request_success": ("counter", {"model_name", "engine", "finished_reason"}),
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:time_per_output_token_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:request_queue_time_seconds": ("histogram", {"model_name", "engine"}),
    "vllm:iteration_tokens_total": ("histogram", {"model_name", "engine"}),
    "vllm:num_requests_waiting_by_reason": ("gauge", {"model_name", "engine", "reason"}),
    "vllm:prefix_cache_queries": ("counter", {"model_name", "engine"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name", "engine"}),
    # the host tier (--hicache-gb), as vLLM counts a KV connector's (vllm/v1/metrics/loggers.py, 0.11+)
    "vllm:external_prefix_cache_queries": ("counter", {"model_name", "engine"}),
    "vllm:external_prefix_cache_hits": ("counter", {"model_name", "engine"}),
    "vllm:request_prompt_tokens": ("histogram", {"model_name", "engine"}),
    "vllm:request_generation_tokens": ("histogram", {"model_name", "engine"}),
}
# the same source's buckets
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0, 160.0, 640.0, 2560.0,
    ],
    "vllm:inter_token_latency_seconds": [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    ],
    "vllm:e2e_request_latency_seconds": [
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
        480.0, 960.0, 1920.0, 7680.0,
    ],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    # build_1_2_5_buckets(max_model_len): --max-model-len 2048
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
    "vllm:request_generation_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from engine.checkpoints import resolve_model

    folder = make_servable("llama", tmp_path_factory.mktemp("tiny-llama"), resolve_model("smollm2-135m-instruct"))
    args = ("--model", str(folder), "--served-model-name", SERVED, "--max-model-len", "2048",
            "--kv-cache-gb", "0.05", "--log-format", "json", "--access-log")  # fmt: skip
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess(*args, log_path=log) as s:
        yield s


def scrape(server: ServerProcess) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        return r.read().decode()


def families(text: str) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    return {
        f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
        for f in text_string_to_metric_families(text)
    }


def value(fams: dict, family: str, sample: str, **labels: str) -> float:
    return sum(v for name, have, v in fams[family][1] if name == sample and labels.items() <= have.items())


def test_counters_are_counters_and_vllm_series(server: ServerProcess) -> None:
    client = openai_client(server.url)
    before = families(scrape(server))
    whole = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "Count to five."}], max_tokens=7, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(
        client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Name a colour, then another."}], max_tokens=5,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    usages = [whole.usage, chunks[-1].usage]
    text = scrape(server)
    after = families(text)

    # counters as counters: no family typed gauge ends in _total; an engine counter is a counter
    typed = [line.split() for line in text.splitlines() if line.startswith("# TYPE ")]
    assert [t for t in typed if t[2].endswith("_total") and t[3] == "gauge"] == []
    assert ["#", "TYPE", "pdserve_engine_num_preemptions_total", "counter"] in typed  # prometheus_client writes _total here
    assert "pdserve_engine_num_preemptions_total" in {s for _, ss in after.values() for s, _, _ in ss}

    for name, (kind, labels) in VLLM_SERIES.items():
        assert name in after, name
        assert after[name][0] == kind, (name, after[name][0])
        samples = after[name][1]
        assert samples, name
        for sample, have, _ in samples:
            assert set(have) - {"le"} == labels, (sample, have)
            assert have["model_name"] == SERVED and have["engine"] == "0"
    for name, buckets in VLLM_BUCKETS.items():
        les = [float(h["le"]) for s, h, _ in after[name][1] if s == f"{name}_bucket" and h["le"] != "+Inf"]
        assert les == buckets, name

    def moved(family: str, sample: str, **labels: str) -> float:
        old = value(before, family, sample, **labels) if family in before else 0.0
        return value(after, family, sample, **labels) - old

    assert moved("vllm:prompt_tokens", "vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert moved("vllm:generation_tokens", "vllm:generation_tokens_total") == 7 + 5
    assert sum(u.completion_tokens for u in usages) == 12
    assert moved("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert moved(name, f"{name}_count") == 2
    # every token after a request's first is one inter-token gap
    assert moved("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 6 + 4
    # a step per output token, the first with the prompt (vLLM's count)
    assert moved("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") == 7 + 5
    num_tokens = sum(u.prompt_tokens + u.completion_tokens for u in usages)
    assert moved("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum") == num_tokens
    # a finished request's token counts; every prompt looked up once in the host tier (the single
    # engine's only prefix cache: the engine pool's own is a decode engine's, never looked up here)
    assert moved("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert moved("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 12
    assert moved("vllm:request_generation_tokens", "vllm:request_generation_tokens_count") == 2
    assert moved("vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_queries_total") == sum(
        u.prompt_tokens for u in usages
    )
    assert moved("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 0
    # vLLM's cache_config_info: 1, the cache settings as labels (vLLM's test_metrics_exist reads these two)
    (info,) = after["vllm:cache_config_info"][1]
    assert info[2] == 1.0 and info[1]["model_name"] == SERVED and info[1]["engine"] == "0"
    num_blocks = value(after, "pdserve_kv_total_blocks", "pdserve_kv_total_blocks")
    assert info[1]["num_gpu_blocks"] == str(int(num_blocks)) and info[1]["block_size"] == "128"
    assert info[1]["kv_cache_size_tokens"] == str(int(num_blocks) * 128)
    assert float(info[1]["kv_cache_max_concurrency"]) == pytest.approx(num_blocks * 128 / 2048, abs=0.01)
    assert info[1]["enable_prefix_caching"] == "True" and int(info[1]["num_cpu_blocks"]) > 0
    # the same values as pdserve's own series
    assert value(after, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == value(
        after, "pdserve_prompt_tokens", "pdserve_prompt_tokens_total"
    )
    assert value(after, "vllm:num_preemptions", "vllm:num_preemptions_total") == value(
        after, "pdserve_engine_num_preemptions", "pdserve_engine_num_preemptions_total"
    )


def test_prefix_cache_counters_count_tokens(server: ServerProcess) -> None:
    """The same prompt twice: the second finds its whole pages in the host tier; queries and hits move by
    the tokens asked and found, as the answers' usage.prompt_tokens_details.cached_tokens says."""
    client = openai_client(server.url)
    prompt = [100 + (i * 37) % 5000 for i in range(300)]
    before = families(scrape(server))
    cached = []
    for _ in range(2):
        answer = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1, temperature=0)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
    after = families(scrape(server))
    assert cached == [0, 256]  # two whole pages of 128; the last token is always computed

    def moved(family: str) -> float:
        sample = f"{family}_total"
        return value(after, family, sample) - value(before, family, sample)

    assert moved("vllm:external_prefix_cache_queries") == 2 * 300
    assert moved("vllm:external_prefix_cache_hits") == 256
    assert moved("vllm:prefix_cache_hits") == 0


def test_gauges_follow_a_running_request(server: ServerProcess) -> None:
    """While a long request decodes, vllm:num_requests_running is 1 and the KV usage above 0; idle after."""
    client = openai_client(server.url)
    seen: list[tuple[float, float]] = []
    done = threading.Event()

    def request() -> None:
        try:
            client.chat.completions.create(
                model=SERVED, messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=300,
                temperature=0, extra_body={"ignore_eos": True},
            )  # fmt: skip
        finally:
            done.set()

    t = threading.Thread(target=request)
    t.start()
    while not done.is_set():
        fams = families(scrape(server))
        seen.append(
            (value(fams, "vllm:num_requests_running", "vllm:num_requests_running"),
             value(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"))
        )  # fmt: skip
        if seen[-1][0] == 1 and seen[-1][1] > 0:
            break
        time.sleep(0.05)
    t.join()
    assert any(running == 1 and usage > 0 for running, usage in seen), seen
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        fams = families(scrape(server))
        if value(fams, "vllm:num_requests_running", "vllm:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert value(fams, "vllm:num_requests_running", "vllm:num_requests_running") == 0
    assert value(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == value(
        fams, "pdserve_kv_cache_usage_ratio", "pdserve_kv_cache_usage_ratio"
    )


def test_json_logs(server: ServerProcess) -> None:
    """Every line the server and its rank wrote is one JSON object; a request's lines carry its id."""
    client = openai_client(server.url)
    bad = client.chat.completions.with_raw_response.create(
        model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"X-Request-Id": "json-log-1"},
    )  # fmt: skip
    assert bad.headers["X-Request-Id"] == "json-log-1"
    # a request the server refuses is logged while its id is set
    with pytest.raises(Exception, match="max_tokens"):
        client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=-1,
            extra_headers={"X-Request-Id": "json-log-2"},
        )  # fmt: skip
    assert server.log_path is not None

    def records() -> list[dict]:
        lines = [line for line in server.log_path.read_text().splitlines() if line.strip()]
        return [json.loads(line) for line in lines]  # raises on a line that is not JSON

    # the access log's line of the refused request (--access-log) carries its id; it is written after
    # the answer went out, so the client may see the answer first
    deadline = time.monotonic() + 10
    while not any(r.get("request_id") == "json-log-2" for r in records()) and time.monotonic() < deadline:
        time.sleep(0.1)
    logged = records()
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in logged)
    assert any(r.get("rank") == 0 for r in logged)  # the rank process's lines too
    refused = [r for r in logged if r.get("request_id") == "json-log-2"]
    assert [(r["logger"], " 400 " in r["message"]) for r in refused] == [("pd.server.access", True)], refused
