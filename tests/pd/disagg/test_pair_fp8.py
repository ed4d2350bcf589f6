"""A P/D pair serving an FP8 checkpoint (a tiny Qwen3-MoE with SmolLM2's tokenizer, written as the FP8
releases ship: float8_e4m3fn projections and experts with 128x128 weight_scale_inv blocks): PE and CE hold
the weights in FP8, the KV cache stays float32 (the CPU's dtype), and bench/check_pd.py finds the pair's
tokens identical to a single engine on the same checkpoint, both --deterministic."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd.tools.server_process import PDPair, ServerProcess
from tests.server_fixtures import SMALL_DETERMINISTIC, run_check_pd, wait_pair_idle
from tests.tiny_models import FP8_FAMILIES, make_servable, to_fp8_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    from engine.checkpoints import resolve_model

    root = tmp_path_factory.mktemp("fp8")
    original = make_servable("qwen3_moe", root / "float", resolve_model("smollm2-135m-instruct"), families=FP8_FAMILIES)
    model = str(to_fp8_checkpoint(original, root / "model"))
    args = ("--model", model, *SMALL_DETERMINISTIC, "--hicache-gb", "0")
    ref = ServerProcess(*args, log_path=root / "ref.log")
    pair = PDPair(*args, log_dir=root)
    try:
        ref.start()
        pair.start()
        ref.wait_ready()
        pair.wait_ready()
        yield ref, pair, root
    finally:
        pair.terminate()
        ref.terminate()
        pair.stop()
        ref.stop()


@pytest.mark.timeout(1800)
def test_check_pd_fp8(servers, capsys) -> None:
    ref, pair, root = servers
    # the weights are what differs from the other pairs: greedy, streamed, sampled, long and multi-turn chats,
    # and conversations at once (the API's other cases run on SmolLM2's pair, tests/pd/disagg/test_pair_e2e.py)
    only = "chat short,chat seeded sampling,chat long,conversation greedy,completion multi-turn,concurrent"
    code = run_check_pd(ref, pair, "--concurrency", "4", "--only", only, "--parallel", "9")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "DIFF" not in out and "FAIL" not in out and "9/9 cases identical" in out, out
    wait_pair_idle(pair)
    for log in ("ref.log", "pe.log", "ce.log"):  # every engine loaded the FP8 weights as FP8
        assert "FP8 weights (128x128 blocks, as the checkpoint ships them)" in Path(root / log).read_text(), log
