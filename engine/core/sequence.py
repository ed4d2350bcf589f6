"""A request's state inside the engine: tokens, how many are in the KV cache, the memory it owns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.core.grammar import Matcher
    from engine.core.prompt_logprobs import PromptLogprobsCollector


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # prefill-only: out of the batch, memory held until handed off (engine.handoffs)
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # sampling seed of this request (drawn by the engine when the request gives none)
    arrival_s: float
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt: int = 0  # prompt tokens that came from a cache or a handoff, not computed here
    block_ids: list[int] = field(default_factory=list)
    state_slot: int = -1
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    num_emitted_tokens: int = 0  # output tokens already reported to the caller
    use_prefix_cache: bool = True
    is_prefill_only: bool = False  # PE side of P/D: park after the first token instead of decoding
    is_retained_at_end: bool = False  # CE of P/D: at its end its full computed pages go to the decode cache
    cache_store_upto: int = 0  # prefill pauses at this page boundary so the cache can store it; 0: none
    matcher: Matcher | None = None  # structured output: the grammar's state after the output so far
    prompt_logprobs: PromptLogprobsCollector | None = None  # params.prompt_logprobs set: filled by the prefill
    # speculative decoding: this step's drafted tokens, fed after the last token and verified by the step
    # (engine/speculative/speculator.py); never part of the tokens above
    draft_token_ids: list[int] = field(default_factory=list)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (without building the whole list every step)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        """More than one token still to compute: the next step is (part of) a prefill."""
        return self.num_uncomputed > 1
