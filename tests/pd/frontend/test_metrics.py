"""The server's /metrics (pd/frontend/metrics.py) rendered per rank, without a server."""

from __future__ import annotations

from pd.frontend.metrics import RankSnapshot, ServerMetrics


def test_metrics_render_per_rank():
    snap = [
        RankSnapshot(
            0,
            True,
            2,
            {
                "num_running": 1,
                "num_waiting": 0,
                "kv_usage": 0.25,
                "num_free_blocks": 3,
                "num_total_blocks": 4,
                "x_new": 7,
            },
        ),
        RankSnapshot(1, False, 0, {}, num_restarts=2),
    ]
    m = ServerMetrics(lambda: snap, "served-name")
    m.ttft_s.labels("served-name", "0").observe(0.1)
    m.prompt_tokens.labels("served-name", "0").inc(5)
    text = m.render().decode()
    for line in (
        'pdserve_rank_up{rank="0"} 1.0',
        'pdserve_rank_up{rank="1"} 0.0',
        'pdserve_rank_restarts_total{rank="0"} 0.0',
        'pdserve_rank_restarts_total{rank="1"} 2.0',
        'pdserve_kv_cache_usage_ratio{rank="0"} 0.25',
        'pdserve_num_requests_running{rank="0"} 1.0',
        'pdserve_engine_x_new{rank="0"} 7.0',
        'pdserve_prompt_tokens_total{model_name="served-name",rank="0"} 5.0',
        'pdserve_time_to_first_token_seconds_count{model_name="served-name",rank="0"} 1.0',
    ):
        assert line in text, line


def test_speculation_series_only_for_ranks_that_speculate():
    """vLLM's spec_decode counters (vllm/v1/spec_decode/metrics.py: names, help, labels + position) and
    pdserve's mirror, from each rank's stats as they arrive from the rank (msgpack: the per-position tuple
    is a list); a rank without --speculative-config (no per-position counts) has none of them."""
    from prometheus_client.parser import text_string_to_metric_families

    spec = {
        "spec_num_drafts_total": 10,
        "spec_num_draft_tokens_total": 30,
        "spec_num_accepted_tokens_total": 12,
        "spec_accepted_per_position": [7, 4, 1],
    }
    plain = {"spec_num_drafts_total": 0, "spec_num_draft_tokens_total": 0, "spec_num_accepted_tokens_total": 0,
             "spec_accepted_per_position": []}  # fmt: skip
    snap = [RankSnapshot(0, True, 0, {"num_running": 0, **spec}), RankSnapshot(1, True, 0, {"num_running": 0, **plain})]
    fams = {f.name: f for f in text_string_to_metric_families(ServerMetrics(lambda: snap, "m").render().decode())}
    want = {
        "vllm:spec_decode_num_drafts": ("Number of spec decoding drafts.", 10),
        "vllm:spec_decode_num_draft_tokens": ("Number of draft tokens.", 30),
        "vllm:spec_decode_num_accepted_tokens": ("Number of accepted tokens.", 12),
    }
    for name, (doc, v) in want.items():
        f = fams[name]
        assert (f.type, f.documentation) == ("counter", doc)
        assert [(s.name, s.labels, s.value) for s in f.samples] == [
            (f"{name}_total", {"model_name": "m", "engine": "0"}, v)
        ]
    per_pos = fams["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert (per_pos.type, per_pos.documentation) == ("counter", "Accepted tokens per draft position.")
    assert [(s.labels["position"], s.labels["engine"], s.value) for s in per_pos.samples] == [
        ("0", "0", 7),
        ("1", "0", 4),
        ("2", "0", 1),
    ]
    mirror = fams["pdserve_engine_spec_accepted_per_position"]
    assert [(s.labels, s.value) for s in mirror.samples] == [
        ({"rank": "0", "position": str(k)}, n) for k, n in enumerate([7, 4, 1])
    ]
    drafts = fams["pdserve_engine_spec_num_drafts"]
    assert drafts.type == "counter" and [(s.labels, s.value) for s in drafts.samples] == [({"rank": "0"}, 10)]
    # no rank speculates: no family at all, not even an empty one
    none = [RankSnapshot(0, True, 0, {"num_running": 0, **plain})]
    text = ServerMetrics(lambda: none, "m").render().decode()
    assert "spec_decode" not in text and "pdserve_engine_spec" not in text


def test_vllm_cache_series_per_tier_and_cache_config_info():
    """vLLM's prefix-cache counters in tokens (the decode cache as its local cache, the host tier as its
    external one, only where a rank has one), the waiting split by reason, vllm:cache_config_info with
    vLLM's label names, and the request token histograms in vLLM's 1-2-5 buckets up to max_model_len."""
    from prometheus_client.parser import text_string_to_metric_families

    from pd.frontend.vllm_metrics import CacheConfigInfo, build_1_2_5_buckets

    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(2048)[-1] == 2000
    host = {"num_waiting": 3, "num_total_blocks": 10, "cache_total_pages": 40, "cache_query_tokens_total": 300,
            "cache_hit_tokens_total": 128, "decode_cache_query_tokens_total": 0, "decode_cache_hit_tokens_total": 0}
    ce = {"num_waiting": 0, "num_total_blocks": 20, "decode_cache_query_tokens_total": 512,
          "decode_cache_hit_tokens_total": 256}  # fmt: skip
    snap = [RankSnapshot(0, True, 0, host, max_model_len=256), RankSnapshot(1, True, 0, ce, max_model_len=256)]
    m = ServerMetrics(lambda: snap, "m", CacheConfigInfo(block_size=16, gpu_memory_utilization=0.9, enable_prefix_caching=True))
    m.vllm.size_token_histograms(256)
    m.vllm.observe_finished(("m", "0"), 37, 5)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}

    def samples(family: str) -> dict[tuple[str, ...], float]:
        return {(s.name, *(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value for s in fams[family].samples}

    assert samples("vllm:prefix_cache_queries") == {
        ("vllm:prefix_cache_queries_total", "engine=0", "model_name=m"): 0.0,
        ("vllm:prefix_cache_queries_total", "engine=1", "model_name=m"): 512.0,
    }
    assert samples("vllm:prefix_cache_hits")[("vllm:prefix_cache_hits_total", "engine=1", "model_name=m")] == 256.0
    assert samples("vllm:external_prefix_cache_queries") == {
        ("vllm:external_prefix_cache_queries_total", "engine=0", "model_name=m"): 300.0
    }
    assert samples("vllm:external_prefix_cache_hits") == {
        ("vllm:external_prefix_cache_hits_total", "engine=0", "model_name=m"): 128.0
    }
    waiting = samples("vllm:num_requests_waiting_by_reason")
    assert waiting[("vllm:num_requests_waiting_by_reason", "engine=0", "model_name=m", "reason=capacity")] == 3.0
    assert waiting[("vllm:num_requests_waiting_by_reason", "engine=0", "model_name=m", "reason=deferred")] == 0.0
    info = {s.labels["engine"]: s for s in fams["vllm:cache_config_info"].samples}
    assert info["0"].value == 1.0
    assert info["0"].labels == {
        "model_name": "m", "engine": "0", "block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9", "num_gpu_blocks": "10", "num_cpu_blocks": "40",
        "kv_cache_size_tokens": "160", "kv_cache_max_concurrency": "0.62",
    }  # fmt: skip
    assert info["1"].labels["num_cpu_blocks"] == "0" and info["1"].labels["kv_cache_size_tokens"] == "320"
    prompt = samples("vllm:request_prompt_tokens")
    les = [float(k[2].removeprefix("le=")) for k in prompt if k[0].endswith("_bucket") and k[2] != "le=+Inf"]
    assert les == [1, 2, 5, 10, 20, 50, 100, 200]
    assert prompt[("vllm:request_prompt_tokens_sum", "engine=0", "model_name=m")] == 37.0
    assert samples("vllm:request_generation_tokens")[("vllm:request_generation_tokens_sum", "engine=0", "model_name=m")] == 5.0
