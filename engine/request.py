"""What a caller hands the engine (prompt + sampling parameters) and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy; top_k <= 0 means off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N >= 0: chosen token's logprob plus the top N

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not (self.temperature >= 0.0):  # also refuses NaN
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int):
            raise InvalidRequestError(f"top_k must be an integer, got {self.top_k!r}", "top_k")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}", "top_logprobs")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's logprob and the top-N alternatives at that step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One step's news for one request: tokens sampled since the last output.

    text_delta is the detokenized text of the new tokens, with stop strings cut off and any text that
    could still turn into a stop string held back until it cannot.
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    is_finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    is_handoff_ready: bool = False  # prefill-only request: prefilled, first token sampled, KV parked for export
