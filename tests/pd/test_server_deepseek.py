"""DeepSeek-V3 (a tiny deepseek_v3 with SmolLM2's tokenizer: latent attention, group-limited routing with
a shared expert, a dense first layer) through real servers and the openai client: `--dp 2 --ep 2` (each rank
holds half the routed experts, every rank its shared expert) gives the tokens and logprobs of a single
`--ep 1` engine bit for bit in deterministic mode, expert rebalancing included; a P/D pair, whose handoff
carries latent pages ((kv_lora_rank 32 + rotary 8) x 4 bytes a token and layer, float32 on the CPU), passes
bench/check_pd.py against a single engine over tcp."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest

from pd.tools.server_process import PDPair, ServerProcess
from tests.server_fixtures import (
    SMALL_DETERMINISTIC,
    greedy_completions,
    openai_client,
    run_check_pd,
    serving,
    story_prompts,
    wait_pair_idle,
)
from tests.tiny_models import make_servable

pytestmark = pytest.mark.slow

PROMPTS = story_prompts(8)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.checkpoints import resolve_model

    folder = tmp_path_factory.mktemp("tiny-deepseek-v3")
    return str(make_servable("deepseek_v3", folder, resolve_model("smollm2-135m-instruct")))


@pytest.fixture(scope="module")
def servers(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess, PDPair]]:
    """A single engine, a --dp 2 --ep 2 server with rebalancing every 3 steps, and a P/D pair (tcp)."""
    logs = tmp_path_factory.mktemp("deepseek")
    args = ("--model", model, *SMALL_DETERMINISTIC, "--hicache-gb", "0")
    ref = ServerProcess(*args, log_path=logs / "ref.log")
    ep = ServerProcess(*args, "--dp", "2", "--ep", "2", "--eplb-interval", "3", log_path=logs / "ep.log")
    pair = PDPair(*args, log_dir=logs)
    every = (ref, ep, pair)
    with serving(*every):
        yield ref, ep, pair


def completions(url: str, model: str, concurrency: int) -> list[tuple[str, list[float]]]:
    return greedy_completions(url, model, PROMPTS, concurrency)


def test_ep2_equals_ep1_bit_for_bit(servers, model: str) -> None:
    ref, ep, _ = servers
    want = completions(ref.url, model, 1)
    assert len({text for text, _ in want}) > 1  # the prompts do not all give the same answer
    # one request at a time (a rank idles through its peer's steps) and all at once (both ranks busy)
    for concurrency in (1, len(PROMPTS)):
        assert completions(ep.url, model, concurrency) == want, concurrency


def test_pd_pair_matches_single_engine(servers, capsys) -> None:
    ref, _, pair = servers
    assert run_check_pd(ref, pair, "--concurrency", "4", "--parallel", "8") == 0
    out = capsys.readouterr().out
    assert "DIFF" not in out and "FAIL" not in out
    wait_pair_idle(pair)


def handoff_counters(url: str) -> tuple[float, float, float]:
    """The CE's (handoffs, payload bytes, skipped tokens), summed over transports."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    names = ("pdserve_handoffs_total{", "pdserve_handoff_bytes_total{", "pdserve_handoff_skipped_tokens_total{")
    sums = [sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(n)) for n in names]
    return sums[0], sums[1], sums[2]


def test_handoff_carries_one_latent_per_token_and_layer(servers, model: str) -> None:
    """A fresh prompt's handoff is its pages of latents: 4 layers x 128 tokens x (32 + 8) float32 values a
    page (its 4 heads' expanded keys and values, 24 + 16 wide each, would be 160 values a token: 4 times as many)."""
    ref, _, pair = servers
    prompt = "A fresh prompt for the latent handoff: " + " ".join(f"item {i}" for i in range(60))
    before = handoff_counters(pair.url)
    got = openai_client(pair.url).completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    want = openai_client(ref.url).completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert got.choices[0].text == want.choices[0].text
    after = handoff_counters(pair.url)
    assert got.usage is not None and got.usage.prompt_tokens > 128  # two pages
    num_pages = -(-got.usage.prompt_tokens // 128)
    assert (after[0] - before[0], after[2] - before[2]) == (1, 0)
    assert after[1] - before[1] == num_pages * 4 * 128 * (32 + 8) * 4
    wait_pair_idle(pair)
