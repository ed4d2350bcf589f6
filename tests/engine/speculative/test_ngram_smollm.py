"""Prompt lookup (engine/speculative/ngram.py) on the real SmolLM2-135M-Instruct: on a chat whose answers
echo the prompt (a tool's JSON result asked back verbatim, an email asked back with a spelling fix), the
drafts are mostly accepted (mean accepted length above 1.5, vLLM's 1 + accepted / drafts) and the tokens are
those of the same engine without speculation (deterministic numerics, greedy). Counts and identity only:
the speed is bench/spec_decode.py's."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from engine.checkpoints import load_tokenizer, resolve_model
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams

MODEL = "smollm2-135m-instruct"
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1, "auto_disable": False})
MAX_TOKENS = 64

USER = json.dumps(
    {
        "id": 42,
        "name": "Ada Martin",
        "email": "ada.martin@example.com",
        "plan": "pro",
        "created": "2025-03-14",
        "tags": ["beta", "admin"],
        "usage": {"requests": 18234, "tokens": 9120044},
    },
    indent=2,
)
EMAIL = (
    "Hi Sam,\n\nThanks for sending the report. I have read it and I think the numbers for the third quarter "
    "look good. Could you send me the final version by Friday? I will foward it to the team on Monday.\n\n"
    "Best regards,\nAlex"
)
CHATS = [
    [
        {"role": "system", "content": "You are a coding agent. You can call tools; their results follow."},
        {"role": "user", "content": "Look up user 42."},
        {"role": "assistant", "content": "get_user(42)"},
        {"role": "tool", "content": USER},
        {"role": "user", "content": "Return the tool result exactly as it is, as JSON."},
    ],
    [{"role": "user", "content": f"Fix the spelling mistake in this email and return the whole email:\n\n{EMAIL}"}],
]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread while the test runs. The tests share 2 cores with another pytest process (make test)
    and OpenMP's threads spin while they wait for each other: measured here, beside other jobs, a SmolLM2
    decode step took 1.77 s with 2 threads and 0.17 s with 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _engine(speculative_config: str | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=MODEL,
            device="cpu",
            is_deterministic=True,
            max_model_len=1024,
            kv_cache_gb=0.1,
            hicache_gb=0,
            speculative_config=speculative_config,
        )
    )


def test_echo_heavy_chat_accepts_drafts_and_keeps_the_tokens(one_thread: None) -> None:
    tok = load_tokenizer(resolve_model(MODEL))
    prompts = [
        tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"
        ]
        for m in CHATS
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    plain = _engine(None)
    want = [s.output_token_ids for s in plain.generate(prompts, params)]
    plain.check_idle()
    del plain
    eng = _engine(NGRAM)
    got = [s.output_token_ids for s in eng.generate(prompts, params)]
    eng.check_idle()

    assert got == want
    assert all(len(t) >= 32 for t in want), "the answers are long enough to quote the prompt"
    stats = eng.stats()
    drafts, drafted, accepted = (
        stats.spec_num_drafts_total,
        stats.spec_num_draft_tokens_total,
        stats.spec_num_accepted_tokens_total,
    )
    per_position = list(stats.spec_accepted_per_position)
    assert drafts > 0 and 0 < accepted <= drafted <= 3 * drafts
    # a draft's position j + 1 is accepted only after j is: the counts never rise along the draft
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    mean_accepted_length = 1 + accepted / drafts
    assert mean_accepted_length > 1.5, (drafts, drafted, accepted, per_position)
    print(f"ngram k=3: {drafts} drafts, {accepted}/{drafted} accepted, mean accepted length {mean_accepted_length:.2f}")
