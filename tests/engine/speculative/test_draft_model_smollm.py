"""A draft model (engine/speculative/draft_model.py) on real checkpoints: SmolLM2-135M-Instruct drafting for itself
(its real tokenizer compared with the target's, tied embeddings) has every draft accepted and gives the tokens of
the engine without speculation (deterministic numerics, greedy); gemma3-270m, another tokenizer, is refused."""

from __future__ import annotations

import json

import pytest

from engine.checkpoints import load_tokenizer, resolve_model
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.request import SamplingParams
from tests.engine.speculative.test_ngram_smollm import CHATS, MODEL, one_thread  # noqa: F401 (a fixture, by name)


def _engine(speculative_config: str | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=MODEL, device="cpu", is_deterministic=True, max_model_len=1024, kv_cache_gb=0.2, hicache_gb=0,
            speculative_config=speculative_config,
        )
    )


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_smollm2_as_its_own_draft_has_every_draft_accepted() -> None:
    tok = load_tokenizer(resolve_model(MODEL))
    prompts = [
        tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        for m in CHATS
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = [s.output_token_ids for s in _engine(None).generate(prompts, params)]
    spec = json.dumps({"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3, "auto_disable": False})
    eng = _engine(spec)
    got = [s.output_token_ids for s in eng.generate(prompts, params)]
    eng.check_idle()
    assert got == want
    st = eng.stats()
    assert st.spec_num_drafts_total > 5
    assert st.spec_num_accepted_tokens_total == st.spec_num_draft_tokens_total


def test_a_draft_of_another_tokenizer_is_refused() -> None:
    spec = json.dumps({"method": "draft_model", "model": "gemma3-270m", "num_speculative_tokens": 3, "auto_disable": False})
    with pytest.raises(InvalidRequestError, match="model 'gemma3-270m': its tokenizer's vocabulary differs"):
        _engine(spec)
