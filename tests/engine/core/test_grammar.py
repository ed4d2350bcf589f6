"""Structured outputs in the engine (engine/core/grammar.py): every kind compiles and constrains SmolLM2's
greedy output; bad specs are InvalidRequestError; the mask is batched and leaves other rows alone; a
CE that replays the handed-over tokens continues exactly as the PE's engine would have."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.checkpoints import resolve_model
from engine.core.grammar import GrammarCompiler, Matcher, grammar_text, mask_logits
from engine.errors import InvalidRequestError
from engine.request import SamplingParams, StructuredOutput
from tests.engine_utils import small_engine

pytestmark = pytest.mark.smoke

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def engine():
    return small_engine(resolve_model("smollm2-135m-instruct"), max_num_batched_tokens=256)


def _prompt(eng, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


def _run(eng, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[str, str | None]]:
    for rid, (ids, params) in requests.items():
        eng.add_request(rid, ids, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    finish: dict[str, str | None] = {}
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id] += o.new_token_ids
            if o.is_finished:
                finish[o.request_id] = o.finish_reason
    eng.check_idle()
    return {rid: (eng.tokenizer.decode(t, skip_special_tokens=True), finish[rid]) for rid, t in tokens.items()}


def test_every_kind_constrains_greedy_output(engine) -> None:
    greedy = lambda so, n: SamplingParams(max_tokens=n, temperature=0, structured=so)  # noqa: E731
    ask = _prompt(engine, "Tell me about a person named Ann who is 31, as JSON.")
    free = SamplingParams(max_tokens=8, temperature=0)
    out = _run(
        engine,
        {
            "schema": (ask, greedy(StructuredOutput("json_schema", json.dumps(PERSON)), 32)),
            "object": (_prompt(engine, 'Reply with this JSON: {"ok": true}'), greedy(StructuredOutput("json_object"), 16)),
            "regex": (_prompt(engine, "Give a phone number."), greedy(StructuredOutput("regex", "[0-9]{3}-[0-9]{4}"), 12)),
            "choice": (_prompt(engine, "Is water wet?"), greedy(StructuredOutput("choice", '["yes", "no"]'), 4)),
            "gbnf": (_prompt(engine, "Pick."), greedy(StructuredOutput("grammar", 'root ::= "A" | "B" "C"'), 4)),
            "lark": (_prompt(engine, "Pick."), greedy(StructuredOutput("grammar", 'start: "x" "y"+'), 6)),
            "free": (ask, free),  # batched with the others, and untouched by their masks
        },
    )
    text, reason = out["schema"]
    person = json.loads(text)
    assert reason == "stop" and set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert out["object"][1] == "stop" and isinstance(json.loads(out["object"][0]), dict), out["object"]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out["regex"][0]) and out["regex"][1] == "stop"
    assert out["choice"] in (("yes", "stop"), ("no", "stop"))
    assert out["gbnf"][0] in ("A", "BC")
    assert re.fullmatch("xy+", out["lark"][0])
    assert _run(engine, {"free": (ask, free)}) == {"free": out["free"]}


def test_schema_objects_are_closed_unless_they_say_otherwise() -> None:
    closed = json.loads(grammar_text(StructuredOutput("json_schema", json.dumps(PERSON))))
    schema = closed["grammars"][0]["json_schema"]
    assert schema["additionalProperties"] is False
    opened = {**PERSON, "additionalProperties": True}
    schema = json.loads(grammar_text(StructuredOutput("json_schema", json.dumps(opened))))["grammars"][0]["json_schema"]
    assert schema["additionalProperties"] is True


@pytest.mark.parametrize(
    "so, param",
    [
        (StructuredOutput("regex", "a(b"), "structured_outputs"),
        (StructuredOutput("grammar", "start: undefined_rule"), "structured_outputs"),
        (StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'), "response_format"),
        (StructuredOutput("json_schema", "{not json"), "response_format"),
        (StructuredOutput("json_schema", "[1, 2]"), "response_format"),
        (StructuredOutput("choice", "[]"), "structured_outputs"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused(engine, so, param) -> None:
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured=so))
    assert e.value.param == param
    engine.check_idle()


# Specs that compile but allow no first token; their library error quotes the spec, "CUDA error" included,
# which once ended the rank (issue 29): now a 400 at admission.
NO_FIRST_TOKEN = [
    (StructuredOutput("regex", "[^\\x00-\\U0010FFFF]CUDA error"), "structured_outputs"),
    (
        StructuredOutput("json_schema", json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a", "title": "CUDA error"})),
        "response_format",
    ),
]


MID_OUTPUT_FAILURE = 'start: "a" x\nx: /[^\\x00-\\U0010FFFF]CUDA error/'  # fails after its "a"


@pytest.mark.parametrize("so, param", NO_FIRST_TOKEN)
def test_a_spec_that_allows_no_first_token_is_refused_at_admission(engine, so, param) -> None:
    with pytest.raises(InvalidRequestError, match="allows no first token") as e:
        engine.add_request("empty", [1, 2, 3], SamplingParams(structured=so))
    assert e.value.param == param
    engine.check_idle()


def test_a_grammar_failing_mid_output_fails_its_request_alone(engine) -> None:
    """A grammar whose error (quoting "CUDA error" from the spec) comes after its first token: that
    request ends with finish_reason "error", the one beside it completes, nothing is raised."""
    ids = _prompt(engine, "Say a.")
    bad = SamplingParams(max_tokens=8, structured=StructuredOutput("grammar", MID_OUTPUT_FAILURE))
    good = SamplingParams(max_tokens=4, ignore_eos=True)
    out = _run(engine, {"bad": (ids, bad), "good": (ids, good)})
    assert out["bad"][1] == "error"
    assert out["good"][1] == "length"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_allowing_only_what_min_tokens_bars_ends_the_request(engine, temperature) -> None:
    """The grammar allows one token, a stop id that min_tokens bars: every logit would be -inf (a greedy
    row took token 0 and broke the grammar, a sampled row's draw raised). The grammar wins: the request
    ends there with "stop", as it would without min_tokens, and the row beside it is untouched."""
    (yes,) = engine.tokenizer.encode("yes", add_special_tokens=False)
    ids = _prompt(engine, "Is water wet?")
    only_yes = StructuredOutput("choice", '["yes"]')
    base = dict(max_tokens=8, temperature=temperature, seed=3, stop_token_ids=(yes,), structured=only_yes)
    free = SamplingParams(max_tokens=4, ignore_eos=True, temperature=temperature, seed=3)
    out = _run(engine, {"barred": (ids, SamplingParams(min_tokens=3, **base)), "free": (ids, free)})
    assert out["barred"] == ("yes", "stop") == _run(engine, {"plain": (ids, SamplingParams(**base))})["plain"]
    assert out["free"] == _run(engine, {"free": (ids, free)})["free"] and out["free"][1] == "length"


def test_mask_allows_exactly_the_grammars_tokens(engine) -> None:
    compiler = GrammarCompiler(engine.tokenizer, engine.arch.vocab_size, engine.eos_token_ids)
    digits = compiler.matcher(StructuredOutput("regex", "[0-9]+"), [])
    vocab = engine.arch.vocab_size
    logits = torch.zeros(3, vocab)
    masked = mask_logits(logits, [None, digits, None])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    texts = [engine.tokenizer.decode([t]) for t in allowed]
    assert allowed and all(t.isdigit() for t in texts), texts[:10]


def test_replaying_the_handed_over_tokens_continues_the_same_output(engine) -> None:
    """What a CE does: a matcher rebuilt from the output so far equals one advanced token by token."""
    so = StructuredOutput("json_schema", json.dumps(PERSON))
    compiler = GrammarCompiler(engine.tokenizer, engine.arch.vocab_size, engine.eos_token_ids)
    ids = engine.tokenizer.encode('{"name": "Bo', add_special_tokens=False)
    stepped = compiler.matcher(so, [])
    for t in ids:
        stepped.accept(t)
    replayed = compiler.matcher(so, ids)
    a = mask_logits(torch.zeros(1, engine.arch.vocab_size), [stepped])
    b = mask_logits(torch.zeros(1, engine.arch.vocab_size), [replayed])
    assert torch.equal(a, b)
    with pytest.raises(InvalidRequestError, match="grammar cannot be followed"):  # a token the grammar refuses
        Matcher.accept(compiler.matcher(so, []), engine.tokenizer.encode("]", add_special_tokens=False)[0])
