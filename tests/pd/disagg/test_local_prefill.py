"""--local-prefill-max-tokens (issue 51): a CE beside the shared pair's (tests/pd/conftest.py), on the same PE,
prefills a conversation's later turns itself when little is left after what its decode cache holds; the
first turn goes to the PE. Every answer equals the single server's, token for token (the same
deterministic flags), and the metrics say where each prefill ran."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pd.tools.server_process import PDPair, ServerProcess, free_port
from tests.pd.conftest import SMOLLM
from tests.server_fixtures import SMALL_DETERMINISTIC, metric, openai_client

MAX_LEFT = 256  # two of the default 128-token pages


@pytest.fixture(scope="module")
def local_ce(smollm_servers: tuple[ServerProcess, PDPair], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    _, pair = smollm_servers
    ce = ServerProcess("--role", "ce", "--model", SMOLLM, *SMALL_DETERMINISTIC, "--prefill-url", pair.pe.url,
                       "--kv-port-base", str(free_port()), "--local-prefill-max-tokens", str(MAX_LEFT),
                       env=pair.env, log_path=Path(tmp_path_factory.mktemp("local-ce")) / "ce.log")  # fmt: skip
    ce.start()
    try:
        ce.wait_ready()
        yield ce
    finally:
        ce.terminate()
        ce.stop()


def test_later_turns_are_prefilled_on_the_ce_with_the_same_tokens(local_ce: ServerProcess, smollm_servers) -> None:
    ref, pair = smollm_servers
    system = "You are a terse assistant for a library. " + " ".join(
        f"Room {i} keeps books about topic {i * 3} and opens at {8 + i % 4} o'clock." for i in range(24)
    )  # over MAX_LEFT tokens: the first turn goes to the PE
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which room opens first?"}]
    client, single = openai_client(local_ce.url), openai_client(ref.url)

    def count(reason: str) -> float:
        return metric(local_ce.url, "pdserve_local_prefills_total", reason=reason)

    remote = metric(local_ce.url, "pdserve_pe_selected_total")
    for turn in range(3):
        r = client.chat.completions.create(model=SMOLLM, messages=messages, max_tokens=8, temperature=0)
        want = single.chat.completions.create(model=SMOLLM, messages=messages, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want.choices[0].message.content, f"turn {turn}"
        assert r.usage.prompt_tokens == want.usage.prompt_tokens
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        if turn == 0:
            assert r.usage.prompt_tokens > MAX_LEFT
            assert metric(local_ce.url, "pdserve_pe_selected_total") - remote == 1
            assert count("short") == 0
        else:  # the CE held the earlier turns' pages: only the rest was computed, here
            assert cached >= 2 * 128 and r.usage.prompt_tokens - cached <= MAX_LEFT, r.usage
            assert count("short") == turn
            assert metric(local_ce.url, "pdserve_pe_selected_total") - remote == 1
        messages = [*messages, {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": f"And room {turn + 5}?"}]  # fmt: skip
    assert count("fallback") == 0
