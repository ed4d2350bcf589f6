"""DeepSeek-V3 (a tiny deepseek_v3 with SmolLM2's tokenizer) as P/D pairs on one GPU: bench/check_pd.py against
a single engine over tcp and over ipc, the CE's decode rows in the paged latent kernel (pdkernels/mla_decode.py)
under CUDA graphs, and each handoff carrying one latent per token and layer ((32 + 8) bf16 values). Skipped
without CUDA. PDSERVE_TOKENIZER_DIR: a folder with SmolLM2's config and tokenizer files (the GPU machine has
no converted checkpoint), else the converted model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pd.tools.server_process import PDPair, ServerProcess
from tests.pd.test_server_deepseek import handoff_counters
from tests.server_fixtures import SMALL_DETERMINISTIC, openai_client, run_check_pd, serving, wait_pair_idle
from tests.tiny_models import make_servable

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TRANSPORTS = ("tcp", "ipc")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    tokenizer = os.environ.get("PDSERVE_TOKENIZER_DIR")
    if tokenizer:
        source = Path(tokenizer)
    else:
        from engine.checkpoints import resolve_model

        source = resolve_model("smollm2-135m-instruct")
    return str(make_servable("deepseek_v3", tmp_path_factory.mktemp("tiny-deepseek-v3"), source))


@pytest.fixture(scope="module")
def servers(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, PDPair]]]:
    logs = tmp_path_factory.mktemp("deepseek-gpu")
    args = ("--model", model, *SMALL_DETERMINISTIC, "--hicache-gb", "0", "--dtype", "bfloat16")
    ref = ServerProcess(*args, log_path=logs / "ref.log")
    for t in TRANSPORTS:
        (logs / t).mkdir()
    pairs = {t: PDPair(*args, log_dir=logs / t, pe_args=("--transport", t)) for t in TRANSPORTS}
    with serving(ref, *pairs.values()):
        yield ref, pairs


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pair_matches_single_engine(servers, model: str, transport: str, capsys) -> None:
    ref, pairs = servers
    pair = pairs[transport]
    assert run_check_pd(ref, pair, "--concurrency", "4") == 0
    out = capsys.readouterr().out
    assert "DIFF" not in out and "FAIL" not in out
    # a fresh two-page prompt: the handoff is 4 layers x 128 tokens x (32 + 8) bf16 values a page
    prompt = f"A fresh prompt over {transport}: " + " ".join(f"item {i}" for i in range(60))
    before = handoff_counters(pair.url)
    got = openai_client(pair.url).completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    want = openai_client(ref.url).completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert got.choices[0].text == want.choices[0].text
    after = handoff_counters(pair.url)
    assert got.usage is not None and got.usage.prompt_tokens > 128
    assert (after[0] - before[0], after[2] - before[2]) == (1, 0)
    assert after[1] - before[1] == -(-got.usage.prompt_tokens // 128) * 4 * 128 * (32 + 8) * 2
    wait_pair_idle(pair)
