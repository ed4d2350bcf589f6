"""The generated references (pd/tools/docs_ref.py): the committed docs/reference files are what the code gives
now, and they hold every flag and every series the code declares."""

from __future__ import annotations

from pd.config import ServerConfig
from pd.flags import flags
from pd.rank.decode_role import DecodeRole
from pd.rank.prefill_role import PrefillRole
from pd.router.config import RouterConfig
from pd.tools import docs_ref


def test_committed_references_match_the_code() -> None:
    wrong = docs_ref.stale()
    assert not wrong, (
        f"{', '.join(map(str, wrong))} out of date with the code: run `{docs_ref.COMMAND}` (or `make docs`) "
        "and commit the result"
    )


def test_every_flag_is_listed() -> None:
    text = docs_ref.flags_markdown()
    for settings in (ServerConfig, RouterConfig):
        for f in flags(settings):
            for name in f.names:
                assert f"`{name}`" in text, name
    assert "`--config`" in text and "`--no-deterministic`" in text


def test_every_series_is_listed_once_per_section() -> None:
    text = docs_ref.metrics_markdown()
    for name in (
        "pdserve_time_to_first_token_seconds", "pdserve_rank_restarts_total", "pdserve_engine_cache_hit_tokens_total",
        "pdserve_engine_spec_accepted_per_position_total", "pdserve_moe_expert_imbalance",
        "pdserve_engine_handoffs_imported_total", "pdserve_engine_handoffs_sent_total", "vllm:kv_cache_usage_perc",
        "vllm:time_per_output_token_seconds", "vllm:iteration_tokens_total", "pdserve_ttft_phase_seconds",
        "pdserve_router_backend_selected_total",
    ):  # fmt: skip
        assert f"| `{name}` |" in text, name
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(set(rows)), sorted({r for r in rows if rows.count(r) > 1})
    # a labelled series declared up front shows its labels before it has a child
    assert "| `vllm:time_per_output_token_seconds` | histogram | `model_name`, `engine` |" in text


def test_role_stats_are_read_from_the_roles() -> None:
    ce, pe = docs_ref.role_stat_keys(DecodeRole), docs_ref.role_stat_keys(PrefillRole)
    assert {"num_reservations_waiting", "handoffs_imported_total", "num_quarantined_blocks"} <= set(ce)
    # PrefillRole spreads its counters dict (**self.counters) into what stats() returns
    assert {"handoffs_sent_total", "handoff_bytes_sent_total", "num_handoffs_inflight"} <= set(pe)
