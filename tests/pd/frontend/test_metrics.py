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
