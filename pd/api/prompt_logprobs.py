"""Prompt logprobs in a response, as vLLM writes them (engine/request.py: PromptLogprobs holds the values).

vLLM's `prompt_logprobs` (completions: on each choice; chat: at the top level) is a list with one entry per
prompt token: null for the first (nothing comes before it), then a map from token id (as a string) to
{"logprob", "rank", "decoded_token"}: the prompt's token first, then the top N (the prompt's token once,
where it is among them). Completions' echo with logprobs writes the same values into the legacy
logprobs object (completions.py: _LogprobWriter.prompt_block).
"""

from __future__ import annotations

from typing import Any

from engine.request import PromptLogprobs
from pd.frontend.coordinator import Coordinator

LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinities)


def candidates(prompt_ids: list[int], plp: PromptLogprobs, i: int) -> list[tuple[int, float, int]]:
    """(token id, logprob, rank) at prompt token i + 1 (position i), in vLLM's order: the prompt's token,
    then the top N, each id once (a top entry that is the prompt's token keeps the first place)."""
    out: dict[int, tuple[float, int]] = {prompt_ids[i + 1]: (plp.logprobs[i], plp.ranks[i])}
    for rank, (t, x) in enumerate(plp.top(i), 1):
        out[t] = (x, rank)
    return [(t, x, rank) for t, (x, rank) in out.items()]


def prompt_logprobs_json(co: Coordinator, prompt_ids: list[int], plp: PromptLogprobs) -> list[Any]:
    """vLLM's prompt_logprobs list for a prompt."""
    if plp.num_positions != len(prompt_ids) - 1:
        raise AssertionError(f"{plp.num_positions} prompt logprobs for a prompt of {len(prompt_ids)} tokens")
    out: list[Any] = [None]
    for i in range(plp.num_positions):
        out.append(
            {
                str(t): {"logprob": max(x, LOGPROB_FLOOR), "rank": rank, "decoded_token": co.token_text(t)}
                for t, x, rank in candidates(prompt_ids, plp, i)
            }
        )
    return out
