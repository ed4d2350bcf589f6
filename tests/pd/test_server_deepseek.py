"""DeepSeek-V3 (a tiny deepseek_v3 with SmolLM2's tokenizer: latent attention, group-limited routing with
a shared expert, a dense first layer) through real servers and the openai client: `--dp 2 --ep 2` (each rank
holds half the routed experts, every rank its shared expert) gives the tokens and logprobs of a single
`--ep 1` engine bit for bit in deterministic mode, expert rebalancing included; a P/D pair, whose handoff
carries latent pages, passes bench/check_pd.py against a single engine over tcp."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator

import pytest

from pd.tools.server_process import PDPair, ServerProcess
from tests.server_fixtures import SMALL_DETERMINISTIC, openai_client, run_check_pd, wait_pair_idle
from tests.tiny_models import make_servable

pytestmark = pytest.mark.slow

PROMPTS = [f"Story {i}: the cat and the {'dog ' * (1 + i % 4)}" for i in range(8)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.models import resolve_model

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
    try:
        for s in every:
            s.start()
        for s in every:
            s.wait_ready()
        yield ref, ep, pair
    finally:
        for s in every:
            s.terminate()
        for s in every:
            s.stop()


def completions(url: str, model: str, concurrency: int) -> list[tuple[str, list[float]]]:
    client = openai_client(url)

    def one(prompt: str) -> tuple[str, list[float]]:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=1)
        assert r.choices[0].logprobs is not None
        return r.choices[0].text, list(r.choices[0].logprobs.token_logprobs or [])

    with cf.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, PROMPTS))


def test_ep2_equals_ep1_bit_for_bit(servers, model: str) -> None:
    ref, ep, _ = servers
    want = completions(ref.url, model, 1)
    assert len({text for text, _ in want}) > 1  # the prompts do not all give the same answer
    # one request at a time (a rank idles through its peer's steps) and all at once (both ranks busy)
    for concurrency in (1, len(PROMPTS)):
        assert completions(ep.url, model, concurrency) == want, concurrency


def test_pd_pair_matches_single_engine(servers, capsys) -> None:
    ref, _, pair = servers
    assert run_check_pd(ref, pair, "--concurrency", "4") == 0
    out = capsys.readouterr().out
    assert "DIFF" not in out and "FAIL" not in out
    wait_pair_idle(pair)
