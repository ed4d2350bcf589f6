"""Speculative decoding served: `--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'` on a
single server and on a CE (SmolLM2-135M, --deterministic), through the real `openai` client. The reference is
the session's single server without it (tests/pd/conftest.py); the speculating CE takes its prefills from the
session pair's PE, which does not speculate (a PE only prefills). The prompts ask the model to repeat a
paragraph and a piece of code verbatim, so prompt lookup drafts and most drafts are accepted.

- the same tokens and logprobs as without speculation, greedy and seeded sampling, whole and streamed;
- /metrics: vLLM's spec_decode counters (names, labels, per position) move, pdserve's mirror agrees, the
  reference has none; both engines go back to idle with every page free (rejected drafts rolled back);
- the CE: the same tokens as the single engine, and bench/check_pd.py's cases that touch what a draft must
  respect (stop strings, penalties, a grammar, seeded n > 1 streamed, top logprobs);
- a bad --speculative-config stops the server at startup with a message naming the problem."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd.tools.server_process import PDPair, ServerProcess, free_port, get_json, wait_idle
from tests.server_fixtures import SMALL_DETERMINISTIC, at_once, metric, openai_client, serving

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'
PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at six. He wound the clock, trimmed the wick "
    "and wrote the weather in a leather book: wind from the west, light rain, the sea calm by midnight."
)
CODE = """def moving_average(values, window):
    total = 0.0
    out = []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
"""
SPEC_SERIES = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def verbatim(text: str) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"Repeat the following text exactly as it is, word for word:\n\n{text}"}
    ]


@pytest.fixture(scope="module")
def servers(
    smollm_servers: tuple[ServerProcess, PDPair], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess, ServerProcess]]:
    """(the reference, a speculating single server, a speculating CE beside the session pair's PE)."""
    ref, pair = smollm_servers
    logs = tmp_path_factory.mktemp("speculative")
    args = ("--model", MODEL, *SMALL_DETERMINISTIC, "--speculative-config", SPEC)
    single = ServerProcess(*args, log_path=logs / "single.log")
    ce = ServerProcess(
        "--role", "ce", *args, "--prefill-url", pair.pe.url, "--kv-port-base", str(free_port()),
        log_path=logs / "ce.log", env=pair.env,
    )  # fmt: skip
    with serving(single, ce):
        deadline = time.monotonic() + 30
        while get_json(ce.url + "/health")[1].get("prefill_engines", [{}])[0].get("state") != "up":
            assert time.monotonic() < deadline, "the CE does not see the PE"
            time.sleep(0.2)
        yield ref, single, ce


GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
# (messages, sampling): sent at once, so that one server decodes them in one batch
CASES = [(verbatim(PARAGRAPH), GREEDY), (verbatim(CODE), GREEDY), (verbatim(CODE), SEEDED)]
Answer = tuple[str, list[tuple[str, float]], int]  # text, (token, logprob) pairs, completion tokens


def answers(url: str) -> list[Answer]:
    """Each case's answer, 40 tokens at most, with logprobs."""
    client = openai_client(url)

    def one(messages: list[dict[str, str]], kw: dict[str, Any]) -> Answer:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, logprobs=True, **kw)
        c = r.choices[0]
        assert c.logprobs is not None and c.logprobs.content is not None and r.usage is not None
        lps = [(t.token, t.logprob) for t in c.logprobs.content]
        return c.message.content or "", lps, r.usage.completion_tokens

    return at_once(*(lambda m=m, kw=kw: one(m, kw) for m, kw in CASES))


def streamed(url: str) -> tuple[str, int]:
    """The last case streamed: its text and the usage's completion tokens."""
    messages, kw = CASES[-1]
    text, num_tokens = "", -1
    chunks = openai_client(url).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, stream=True, stream_options={"include_usage": True}, **kw
    )  # fmt: skip
    for ch in chunks:
        if ch.usage is not None:
            num_tokens = ch.usage.completion_tokens
        for c in ch.choices:
            text += c.delta.content or ""
    return text, num_tokens


@pytest.fixture(scope="module")
def want(servers) -> list[Answer]:
    """The reference's answers (no speculation)."""
    got = answers(servers[0].url)
    assert all(n == len(lps) > 20 for _, lps, n in got)
    return got


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return str(r.read().decode())


def spec_counts(url: str) -> dict[str, float]:
    return {name: metric(url, name + "_total") for name in SPEC_SERIES}


def test_single_server_gives_the_tokens_it_gives_without_speculation(servers, want) -> None:
    ref, single, _ = servers
    before = spec_counts(single.url)
    got, stream = at_once(lambda: answers(single.url), lambda: streamed(single.url))
    assert got == want
    assert stream == (want[-1][0], want[-1][2])
    after = spec_counts(single.url)
    drafts, draft_tokens, accepted = (after[n] - before[n] for n in SPEC_SERIES)
    assert drafts > 0 and drafts <= draft_tokens <= 3 * drafts and 0 < accepted <= draft_tokens
    # the text is there to copy: most drafts are taken
    assert accepted / draft_tokens > 0.5, (drafts, draft_tokens, accepted)

    # vLLM's labels; per position, position 0 first, never more accepted at a later position; pdserve's
    # mirror has the same values
    per_pos = [
        metric(single.url, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(k))
        for k in range(4)
    ]
    assert (
        per_pos[3] == 0 and per_pos[0] >= per_pos[1] >= per_pos[2] and sum(per_pos) == after[SPEC_SERIES[2]]
    )
    for name in SPEC_SERIES:
        assert metric(single.url, name + "_total", model_name=MODEL, engine="0") == after[name] > 0
    assert metric(single.url, "pdserve_engine_spec_num_drafts_total", rank="0") == after[SPEC_SERIES[0]]
    mirror = [
        metric(single.url, "pdserve_engine_spec_accepted_per_position_total", position=str(k))
        for k in range(3)
    ]
    assert mirror == per_pos[:3]
    # a server without --speculative-config has none of these series
    text = scrape(ref.url)
    assert "spec_decode" not in text and "pdserve_engine_spec" not in text
    m = wait_idle(single.port, timeout_s=60)  # rejected drafts' pages went back to the pool
    assert m["pdserve_kv_free_blocks"] == m["pdserve_kv_total_blocks"]


def test_a_speculating_ce_gives_the_single_engines_tokens(servers, want, capsys) -> None:
    from bench import check_pd

    ref, _, ce = servers
    before = spec_counts(ce.url)
    imported = metric(ce.url, "pdserve_engine_handoffs_imported_total")
    assert answers(ce.url) == want
    assert metric(ce.url, "pdserve_engine_handoffs_imported_total") == imported + len(
        CASES
    )  # decoded on the CE
    after = spec_counts(ce.url)
    assert after[SPEC_SERIES[0]] > before[SPEC_SERIES[0]] and after[SPEC_SERIES[2]] > before[SPEC_SERIES[2]]
    # what a draft must respect: stop strings, penalties, a grammar, seeded n=2 streamed, top logprobs (the
    # chat template's tokens recur: prompt lookup drafts from the first step)
    only = "chat stop string,chat penalties,chat json_schema,chat seeded stream n=2,chat top_logprobs"
    args = ["--ref", ref.url, "--pd", ce.url, "--max-tokens", "16", "--concurrency", "1", "--only", only]
    code = check_pd.main([*args, "--parallel", "5"])
    out = capsys.readouterr().out
    assert code == 0 and "5/5 cases identical" in out, out
    drafted = spec_counts(ce.url)
    assert drafted[SPEC_SERIES[0]] > after[SPEC_SERIES[0]], (after, drafted)
    m = wait_idle(ce.port, timeout_s=60)
    assert m["pdserve_kv_free_blocks"] == m["pdserve_kv_total_blocks"]


@pytest.mark.parametrize(
    ("value", "code", "words"),
    [
        (
            '{"method": "ngram", "num_speculative_tokens": 3',
            2,
            ("--speculative-config must be a JSON object",),
        ),
        ('{"method": "ngram", "num_speculative_tokens": 3, "lookup": 2}', 2, ("unknown keys ['lookup']",)),
        # SmolLM2 has no multi-token-prediction layers: the ranks refuse it as they start
        ('{"method": "mtp", "num_speculative_tokens": 1}', 1, ("--speculative-config", "'mtp'")),
        # a draft model that is nowhere: refused as the ranks start, naming the field
        ('{"model": "/no/such/draft", "num_speculative_tokens": 2}', 1, ("--speculative-config: model", "not found")),
    ],
)
def test_a_bad_speculative_config_stops_the_server_at_startup(
    value: str, code: int, words: tuple[str, ...], tmp_path: Path
) -> None:
    """Bad JSON and an unknown key are refused as the flags are read (as every value EngineConfig refuses); a method the
    engine cannot run on this model when the ranks start: the server exits with the message (on the line
    that says why it cannot start), one line per rank, no traceback."""
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pd.server", "--model", MODEL, "--port", str(free_port()), "--speculative-config", value],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == code, out
    last = (
        out.strip().splitlines()[-1]
        if code == 2
        else next(x for x in out.splitlines() if "failed to start" in x)
    )
    assert all(w in last for w in words), out
    assert "Traceback" not in out, out
    assert time.monotonic() - t0 < 120
