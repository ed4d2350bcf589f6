"""A P/D pair on Phi-3 (a tiny phi3 with SmolLM2's tokenizer and chat template: q/k/v and gate/up fused in
the checkpoint, a 24-token window on every layer, so no full-attention layer: a handoff carries the SWA
state alone, and the host prefix cache keeps states, not pages): bench/check_pd.py finds the pair's tokens
identical to a single engine on the same checkpoint, both --deterministic, with the host prefix cache on
and pages of 16 tokens, so that the conversations' later turns hit the PE's cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pd.tools.server_process import PDPair, ServerProcess, wait_idle
from tests.server_fixtures import SMALL_DETERMINISTIC, run_check_pd, serving
from tests.tiny_models import make_servable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, PDPair]]:
    from engine.checkpoints import resolve_model

    root = tmp_path_factory.mktemp("phi3")
    model = str(make_servable("phi3", root / "model", resolve_model("smollm2-135m-instruct")))
    args = ("--model", model, *SMALL_DETERMINISTIC, "--block-size", "16", "--hicache-gb", "0.05")
    ref = ServerProcess(*args, log_path=root / "ref.log")
    pair = PDPair(*args, log_dir=root)
    with serving(ref, pair):
        yield ref, pair


@pytest.mark.timeout(1800)
def test_check_pd_phi3(servers, capsys) -> None:
    ref, pair = servers
    # the family is what differs from the other pairs: greedy, streamed, sampled, long (many windows) and
    # multi-turn chats and completions, and conversations at once (the API's other cases run on SmolLM2's
    # pair, tests/pd/disagg/test_pair_e2e.py)
    only = "chat short,chat seeded sampling,chat long,conversation,completion long,completion multi-turn,concurrent"
    code = run_check_pd(ref, pair, "--concurrency", "4", "--only", only, "--parallel", "6")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "DIFF" not in out and "FAIL" not in out and "13/13 cases identical" in out, out
    ce = wait_idle(pair.ce.port, timeout_s=60)
    pe = wait_idle(pair.pe.port, timeout_s=60)
    assert ce["pdserve_engine_handoffs_imported_total"] >= 34  # every request of the 13 cases
    # the PE stored every prompt's state at its last page boundary and the later turns restored theirs
    assert pe["pdserve_engine_cache_stored_pages_total"] > 0
    assert pe["pdserve_engine_cache_hit_tokens_total"] > 0
