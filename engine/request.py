"""What a caller hands the engine (prompt + sampling parameters) and what it gets back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
LOGIT_BIAS_RANGE = 100.0
MAX_SEED = 2**63 - 1  # a seed fits a 64-bit generator (torch.Generator.manual_seed) with room for step_seed
# below this a repetition penalty divides a logit past float32's range (1e-50 is even 0 in float32): inf and
# NaN logits, and the sampler raised
MIN_REPETITION_PENALTY = 1e-3
GREEDY_TEMPERATURE = 1e-5  # below this a temperature is greedy (as in vLLM): logits / 1e-40 overflow to inf


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_seed(seed: object, param: str = "seed") -> None:
    """A sampling seed: None (drawn by the engine) or an integer in [0, MAX_SEED]."""
    if seed is not None and not (_is_int(seed) and 0 <= seed <= MAX_SEED):  # type: ignore[operator]
        raise InvalidRequestError(f"{param} must be an integer in [0, {MAX_SEED}], got {seed!r}", param)


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_SPEC_CHARS = 1 << 20
StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output (engine/core/grammar.py compiles it): `spec` is the JSON schema's text
    (json_schema), "" (json_object: any JSON object), a regular expression (regex), a JSON array of the
    allowed strings (choice), or a Lark or GBNF grammar (grammar). It travels with the request's
    parameters, so a CE rebuilds the matcher from it and the tokens it was handed."""

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise InvalidRequestError(f"a structured output spec is a string of at most {MAX_STRUCTURED_SPEC_CHARS} characters")
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(f"a {self.kind} structured output needs a non-empty spec")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature below GREEDY_TEMPERATURE (0 included) means greedy; top_k <= 0
    means off.

    NOTE: every field is checked here, for type, range and finiteness, before anything computes with it:
    the HTTP layer, the codec's decode of rank messages, /prefill bodies and handoff headers all build
    one, so a value that passes can never crash the sampler. Token ids against the vocabulary are the
    engine's check (LLMEngine.validate), since only it knows the vocabulary.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N >= 0: chosen token's logprob plus the top N
    # None: none; N >= 0: each prompt token's logprob plus the top N there (vLLM's prompt_logprobs: the
    # prompt is computed whole, its cached prefix not restored; engine/core/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    # Logit processors, with OpenAI's and vLLM's meanings (engine/layers/sampler.py applies them, batched):
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # [-2, 2], times the token's count in the output
    repetition_penalty: float = 1.0  # [MIN_REPETITION_PENALTY, 2]: a token in the prompt or output: logit / p if > 0, else * p
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to its logit
    min_p: float = 0.0  # [0, 1]: tokens less likely than min_p times the likeliest are dropped (sampling)
    min_tokens: int = 0  # EOS and stop_token_ids are barred until the output has this many tokens
    structured: StructuredOutput | None = None  # the output follows this grammar (a token mask per step)

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not _is_number(self.temperature) or self.temperature < 0.0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k):
            raise InvalidRequestError(f"top_k must be an integer, got {self.top_k!r}", "top_k")
        check_seed(self.seed)
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        if not isinstance(self.stop_token_ids, tuple) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}", "stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}", "ignore_eos")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}", "top_logprobs"
            )
        pl = self.prompt_logprobs
        if pl is not None and not (_is_int(pl) and 0 <= pl <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(
                f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {pl!r}", "prompt_logprobs"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {v!r}", name)
        rp = self.repetition_penalty
        if not _is_number(rp) or not MIN_REPETITION_PENALTY <= rp <= 2.0:
            raise InvalidRequestError(
                f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY:g}, 2], got {rp!r}", "repetition_penalty"
            )
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be a number in [0, 1], got {self.min_p!r}", "min_p")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens ({self.max_tokens})], got {self.min_tokens!r}",
                "min_tokens",
            )
        lb = self.logit_bias
        if not isinstance(lb, tuple) or len(lb) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries", "logit_bias")
        for entry in lb:
            if not (isinstance(entry, tuple) and len(entry) == 2 and _is_int(entry[0]) and entry[0] >= 0
                    and _is_number(entry[1]) and abs(entry[1]) <= LOGIT_BIAS_RANGE):
                raise InvalidRequestError(
                    f"logit_bias maps token ids (integers >= 0) to numbers in [-100, 100], got {entry!r}", "logit_bias"
                )
        if len({t for t, _ in lb}) != len(lb):
            raise InvalidRequestError("logit_bias names a token twice", "logit_bias")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError("structured must be a StructuredOutput", "response_format")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether the logits are changed before the choice (engine/layers/sampler.py: process_logits)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
            or self.min_tokens
        )


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab: int, max_model_len: int) -> None:
    """InvalidRequestError for a request no engine of this vocabulary and context length can serve: an empty
    prompt, token ids out of the vocabulary (prompt, stop_token_ids, logit_bias), too many tokens."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params must be SamplingParams")
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token ids must be integers in [0, {vocab}); got {bad[:5]!r}", "prompt")
    bad = [t for t in params.stop_token_ids if t >= vocab]  # SamplingParams checked type and sign
    if bad:
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab}); got {bad[:5]!r}", "stop_token_ids")
    bad = [t for t, _ in params.logit_bias if t >= vocab]
    if bad:
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab}); got {bad[:5]!r}", "logit_bias")
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({len(prompt_token_ids)} in the prompt, {params.max_tokens} for the completion). "
            "Please reduce the length of the prompt or max_tokens.",
            "max_tokens" if len(prompt_token_ids) < max_model_len else "prompt",
        )


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's logprob and the top-N alternatives at that step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """vLLM's prompt_logprobs of a prompt of n tokens, for its tokens 1..n-1 in order (token 0 has none):
    each one's logprob given the tokens before it and its rank there (1: the likeliest), and the
    `num_top` likeliest tokens there, best first, flat (position i's are [i * num_top, (i + 1) * num_top)
    of top_ids and top_logprobs). Logprobs are the model's (no processors), float32 values."""

    num_top: int
    logprobs: tuple[float, ...] = ()
    ranks: tuple[int, ...] = ()
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n, k = len(self.logprobs), self.num_top
        if not (_is_int(k) and 0 <= k <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"num_top must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}")
        if len(self.ranks) != n or len(self.top_ids) != n * k or len(self.top_logprobs) != n * k:
            raise InvalidRequestError(f"prompt logprobs of {n} positions need {n} ranks and {n} x {k} top entries")
        if any(not _is_int(r) or r < 1 for r in self.ranks) or any(not _is_int(t) or t < 0 for t in self.top_ids):
            raise InvalidRequestError("prompt logprobs' ranks are integers >= 1 and their token ids integers >= 0")
        if any(math.isnan(x) or x > 0 for x in (*self.logprobs, *self.top_logprobs)):
            raise InvalidRequestError("logprobs are numbers <= 0")

    @property
    def num_positions(self) -> int:
        return len(self.logprobs)

    def top(self, i: int) -> tuple[tuple[int, float], ...]:
        """The top entries at position i (prompt token i + 1), best first."""
        k = self.num_top
        return tuple(zip(self.top_ids[i * k : (i + 1) * k], self.top_logprobs[i * k : (i + 1) * k]))


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
    is_request_fault: bool = False  # finish_reason "error" for the request's own fault (a 400 where it can be)
    is_handoff_ready: bool = False  # prefill-only request: prefilled, first token sampled, KV parked for export
    # params.prompt_logprobs set: on the first output with tokens (a CE's too: they came with the handoff)
    prompt_logprobs: PromptLogprobs | None = None
