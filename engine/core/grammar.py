"""Structured outputs: a request's constraint (JSON schema, any JSON object, regex, choice, Lark or GBNF
grammar) as a token mask per step, through llguidance.

Why llguidance rather than xgrammar (bench/micro/grammar_backends.py measures both, bench/figures/cpu-micro.md has the
figures): its wheel is 3 MB with no dependencies, where xgrammar's Linux wheel pulls torch's CUDA
build and triton into a CPU install; and it computes a step's mask on the fly from the parser state
(no per-grammar token-table precompilation), so a new schema costs no compile time before its first
token.

One matcher per sequence, advanced by every token the sequence emits. Its state is a function of the
output tokens alone, so a CE rebuilds it by replaying the tokens a handoff carries, and a preempted
sequence (which keeps its output) keeps its matcher.
"""

from __future__ import annotations

import copy
import functools
import json
from collections import OrderedDict
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.request import StructuredOutput

_NUM_CHECKED = 256  # specs remembered as valid (a schema sent with every request compiles once)


def _strict_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever an object lists its properties and says
    nothing of others: OpenAI's strict mode (and xgrammar's default in vLLM and SGLang)."""
    if isinstance(schema, dict):
        out = {k: _strict_objects(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict_objects(v) for v in schema]
    return schema


def grammar_text(so: StructuredOutput) -> str:
    """llguidance's grammar for a constraint; InvalidRequestError for a spec that is not one."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    param = "response_format" if so.kind in ("json_schema", "json_object") else "structured_outputs"
    try:
        if so.kind == "json_object":
            return str(llguidance.grammar_from("json_schema", json.dumps({"type": "object"})))
        if so.kind == "json_schema":
            schema = json.loads(so.spec)
            if not isinstance(schema, dict):
                raise InvalidRequestError("a JSON schema must be an object", param)
            return str(llguidance.grammar_from("json_schema", json.dumps(_strict_objects(copy.deepcopy(schema)))))
        if so.kind == "regex":
            return str(llguidance.grammar_from("regex", so.spec))
        if so.kind == "choice":
            choices = json.loads(so.spec)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise InvalidRequestError("'choice' must be a non-empty array of non-empty strings", param)
            lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            return str(llguidance.grammar_from("lark", lark))
        return str(llguidance.grammar_from("lark", any_to_lark(so.spec)))
    except InvalidRequestError:
        raise
    except Exception as e:  # json, llguidance's and the GBNF converter's own errors
        raise InvalidRequestError(f"the {so.kind} cannot be compiled: {e}", param) from e


class GrammarCompiler:
    """One engine's grammar side: the tokenizer as llguidance sees it (built on first use, ~0.3 s),
    spec checks, and matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int] | frozenset[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._checked: OrderedDict[StructuredOutput, str] = OrderedDict()

    def _lltokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            if self._hf_tokenizer is None:
                raise InvalidRequestError("structured outputs need the model's tokenizer, and this model has none")
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        return self._tokenizer

    def check(self, so: StructuredOutput) -> str:
        """The compiled grammar's text; InvalidRequestError (a 400) when it cannot be compiled."""
        hit = self._checked.get(so)
        if hit is not None:
            self._checked.move_to_end(so)
            return hit
        import llguidance

        text = grammar_text(so)
        param = "response_format" if so.kind in ("json_schema", "json_object") else "structured_outputs"
        error = llguidance.LLMatcher.validate_grammar(text, self._lltokenizer())
        if error:
            raise InvalidRequestError(f"the {so.kind} cannot be compiled: {error.strip()}", param)
        # NOTE: a grammar can compile and still allow no first token (an empty character class, a schema
        # that only refers to itself): its first mask is computed here, once per grammar, so such a
        # request is a 400 at admission rather than a failure in the middle of a batch
        first = Matcher(llguidance.LLMatcher(self._lltokenizer(), text))
        bitmask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
        try:
            fill_masks([first], bitmask)
        except InvalidRequestError:
            raise InvalidRequestError(f"the {so.kind} allows no first token", param) from None
        if not bitmask.any():
            raise InvalidRequestError(f"the {so.kind} allows no first token", param)
        self._checked[so] = text
        if len(self._checked) > _NUM_CHECKED:
            self._checked.popitem(last=False)
        return text

    def matcher(self, so: StructuredOutput, replay: list[int]) -> Matcher:
        """A matcher for so, advanced past the tokens in replay (a handoff's or a restart's output)."""
        import llguidance

        m = Matcher(llguidance.LLMatcher(self._lltokenizer(), self.check(so)))
        for t in replay:
            m.accept(t)
        return m


class Matcher:
    """One sequence's grammar state."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, token: int) -> None:
        if not self._m.consume_token(token):
            # the mask allowed it: text the grammar demands that the model cannot spell (a special token's,
            # bytes its vocabulary lacks), which is the request's to fix
            reason = (self._m.get_error() or "").strip().split("\n", 1)[0][:200]
            raise InvalidRequestError(f"the output's grammar cannot be followed by this model: {reason}")

    def num_valid(self, tokens: list[int]) -> int:
        """How many of tokens, from the first, the grammar would accept next (its state unchanged)."""
        return int(self._m.validate_tokens(tokens))

    @property
    def is_finished(self) -> bool:
        """Nothing more can follow (the grammar is complete and admits no extension)."""
        return bool(self._m.is_stopped())


@functools.cache
def _executor() -> Any:
    """llguidance's thread pool, made on first use."""
    import llguidance

    return llguidance.LLExecutor()


def fill_masks(matchers: list[Matcher], bitmask: torch.Tensor) -> None:
    """Row r of bitmask (int32 [R, ceil(V / 32)] on the host): the tokens matchers[r] allows next,
    computed for all rows at once on llguidance's own threads."""
    from llguidance.torch import fill_next_token_bitmask_par

    fill_next_token_bitmask_par(_executor(), [(m._m, r) for r, m in enumerate(matchers)], bitmask)
    for m in matchers:
        if m._m.is_error():  # the request's grammar (too complex, a lexer that cannot go on): its fault
            # the error's first line (the rest is the matcher's state and the whole grammar)
            reason = (m._m.get_error() or "").strip().split("\n", 1)[0][:200]
            raise InvalidRequestError(f"the output's grammar failed: {reason}")


def _additive_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each byte of a bitmask, 0 where its bit is set (allowed), -inf where not."""
    key = (device, dtype)
    table = _TABLES.get(key)
    if table is None:
        bits = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
        table = _TABLES[key] = torch.where(bits, 0.0, float("-inf")).to(device, dtype)
    return table


_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def mask_logits(logits: torch.Tensor, matchers: list[Matcher | None]) -> torch.Tensor:
    """logits with every token its row's grammar does not allow at -inf (rows without one unchanged).
    One bitmask for the batch, filled on the host; on the logits' device each mask byte is looked up
    in a [256, 8] table of 0 / -inf and added (a masked_fill over unpacked bits is ~8x slower on the
    CPU: bench/micro/grammar_backends.py). NOTE: the int32 words are read as bytes, least significant first
    (little-endian hosts and GPUs), which is llguidance's bit order: token 32w + b is bit b of word w."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    bitmask = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    fill_masks([m for m in matchers if m is not None], bitmask)
    as_bytes = bitmask.to(logits.device, non_blocking=True).view(torch.uint8).long()
    add = torch.nn.functional.embedding(as_bytes, _additive_table(logits.device, logits.dtype))
    out = logits.clone()
    out[rows] = logits[rows] + add.flatten(1)[:, :vocab]
    return out
