"""The P/D pair on Gemma 3 270M (a base model with sliding-window layers: the handoff carries the SWA
state ring as well as the full-attention pages): bench/check_pd.py against a single-engine server,
both --deterministic. No chat template, so check_pd runs its completions cases: those where the window
matters (prompts longer than the 512-token window, multi-turn), streaming, sampling and 4 concurrent
conversations."""

from __future__ import annotations

import pytest

from pd.tools.server_process import rank_metrics
from tests.server_fixtures import SMALL_DETERMINISTIC, module_ref_and_pair, run_check_pd, wait_pair_idle

pytestmark = pytest.mark.slow

ARGS = (
    "--model",
    "gemma3-270m",
    *SMALL_DETERMINISTIC,
)


servers = module_ref_and_pair(*ARGS)


@pytest.mark.timeout(2400)
def test_check_pd_gemma(servers, capsys):
    ref, pair = servers
    # the cases where the sliding-window layers matter (prompts across the window, turns that come back,
    # conversations at once, streaming, sampling); the API's other cases run on SmolLM2's pair
    # (tests/pd/disagg/test_pair_e2e.py, every case). All 7 at once: --deterministic, so sharing batches
    # changes no token, and a decode step of a few sequences costs what one of one does.
    only = "completion greedy,completion stream,completion long,completion seeded,completion multi-turn,concurrent"
    code = run_check_pd(ref, pair, "--concurrency", "4", "--only", only, "--parallel", "7")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "completions cases only" in out and "4 concurrent completion conversations" in out
    assert "7/7 cases identical" in out, out
    m = rank_metrics(pair.ce.port)
    assert m["pdserve_engine_handoffs_imported_total"] > 8
    wait_pair_idle(pair)
