"""The P/D pair on Gemma 3 270M (a base model with sliding-window layers: the handoff carries the SWA
state ring as well as the full-attention pages): bench/check_pd.py against a single-engine server,
both --deterministic. No chat template, so check_pd runs its completions cases (prompts longer than
the 512-token window included), streaming and 16 concurrent conversations among them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pd.testing import PDPair, ServerProcess, rank_metrics, wait_idle

from server_fixtures import SMALL_DETERMINISTIC

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ARGS = (
    "--model",
    "gemma3-270m",
    *SMALL_DETERMINISTIC,
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd_gemma")
    ref = ServerProcess(*ARGS, log_path=logs / "ref.log")
    pair = PDPair(*ARGS, log_dir=logs)
    try:
        ref.start()
        pair.start()
        ref.wait_ready()
        pair.wait_ready()
        yield ref, pair
    finally:
        pair.stop()
        ref.stop()


@pytest.mark.timeout(2400)
def test_check_pd_gemma(servers, capsys):
    ref, pair = servers
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import check_pd
    finally:
        sys.path.remove(str(ROOT / "bench"))
    code = check_pd.main(["--ref", ref.url, "--pd", pair.url, "--max-tokens", "8", "--concurrency", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "completions cases only" in out and "16 concurrent completion conversations" in out
    m = rank_metrics(pair.ce.port)
    assert m["pdserve_engine_handoffs_imported_total"] > 16
    wait_idle(pair.ce.port, timeout_s=60)
    wait_idle(pair.pe.port, timeout_s=60)
