#!/usr/bin/env python3
"""Token identity between a single-engine server and a P/D pair (same model, both --deterministic).

Every case is sent to both; the outputs must be identical token for token (compared through the
logprobs' token bytes where the API gives them, and always as text, finish reason and completion token
count). Cases: short and long prompts, stop strings, penalties, logit_bias, min_p and min_tokens,
seeded sampling, n > 1, max_tokens 1 (the PE's
first token ends it), beam search (every step a max_tokens-1 request: the PE answers it), completions,
streaming, multi-turn conversations (each turn carries the
reference's previous answer to both, so a difference shows at the turn it happens), and
--concurrency conversations at once. The prompt-logprob cases (vLLM's prompt_logprobs, completions' echo
with logprobs, as lm-evaluation-harness's loglikelihood sends it) compare the values too, bit for bit:
the PE computes them, the CE returns them. A model without a chat template gets the completions cases only.
Prints one line per case and a summary; exits 1 on any difference or failed request. `--pd` may
list several CEs of one cluster (comma-separated): the cases take them in turn. `--parallel N` runs N
cases at once (both servers --deterministic: the batches they share do not change a token); on a CPU
that takes a fraction of the time: --deterministic computes every matrix product over a multiple of 16
rows (engine/layers/numerics.py), so a decode step of one sequence costs what one of sixteen does.

    python bench/check_pd.py --ref http://127.0.0.1:8890 --pd http://127.0.0.1:8888
    python bench/check_pd.py --ref http://127.0.0.1:8890 --pd http://127.0.0.4:8888,http://127.0.0.5:8888
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

LONG_CONTEXT = "Notes for the discussion. " + " ".join(
    f"Note {i}: the service on host {i % 7} answered in {10 + (i * 37) % 90} ms." for i in range(45)
)
QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colours.",
    "Explain what a hash table is in two sentences.",
    "Name a famous physicist and one discovery.",
    "What is 17 times 3? Answer briefly.",
    "Describe a cat in five words.",
    "Give a short tip for writing clean code.",
]
FOLLOW_UPS = ["Tell me more.", "Summarise that in one line.", "Why?"]


@dataclass(frozen=True)
class Output:
    """What must match: per choice, the text, finish reason and tokens (bytes), plus usage counts; and for
    the cases that compare values, the logprob values (prompt_logprobs, token_logprobs, top_logprobs)."""

    choices: tuple[tuple[str, str | None, tuple[bytes, ...] | None], ...]
    completion_tokens: int | None
    values: tuple[Any, ...] = ()


@dataclass
class CaseResult:
    name: str
    diffs: list[str] = field(default_factory=list)
    num_requests: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.diffs and self.error is None


CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "country", "population"],
}


def _tokens(logprobs: Any) -> tuple[bytes, ...] | None:
    if logprobs is None:
        return None
    content = getattr(logprobs, "content", None)
    if content is not None:  # chat
        return tuple(bytes(t.bytes or t.token.encode()) for t in content)
    tokens = getattr(logprobs, "tokens", None)  # completions
    return tuple(t.encode() for t in tokens) if tokens is not None else None


def _extra(kw: dict[str, Any]) -> dict[str, Any]:
    """Parameters the openai client does not know travel in extra_body."""
    kw = dict(kw)
    for k in (
        "top_k", "ignore_eos", "prefix_cache", "repetition_penalty", "min_p", "min_tokens", "structured_outputs",
        "prompt_logprobs", "use_beam_search", "length_penalty",
    ):  # fmt: skip
        if k in kw:
            kw.setdefault("extra_body", {})[k] = kw.pop(k)
    return kw


def chat(client: Any, model: str, stream: bool, **kw: Any) -> Output:
    kw = _extra(kw)
    if not stream:
        r = client.chat.completions.create(model=model, **kw)
        return Output(
            tuple(
                (c.message.content or "", c.finish_reason, _tokens(c.logprobs))
                for c in sorted(r.choices, key=lambda c: c.index)
            ),
            r.usage.completion_tokens if r.usage else None,
            (getattr(r, "prompt_logprobs", None),),
        )
    usage = kw.pop("stream_options", {"include_usage": True})
    chunks = client.chat.completions.create(model=model, stream=True, stream_options=usage, **kw)
    return _streamed(chunks, kw.get("n", 1), bool(kw.get("logprobs")), lambda c: c.delta.content or "")


def complete(client: Any, model: str, stream: bool, **kw: Any) -> Output:
    kw = _extra(kw)
    if not stream:
        r = client.completions.create(model=model, **kw)
        choices = sorted(r.choices, key=lambda c: c.index)
        return Output(
            tuple((c.text, c.finish_reason, _tokens(c.logprobs)) for c in choices),
            r.usage.completion_tokens if r.usage else None,
            tuple((getattr(c, "prompt_logprobs", None), _values(c.logprobs)) for c in choices),
        )
    usage = kw.pop("stream_options", {"include_usage": True})
    chunks = client.completions.create(model=model, stream=True, stream_options=usage, **kw)
    return _streamed(chunks, kw.get("n", 1), kw.get("logprobs") is not None, lambda c: c.text or "")


def _values(logprobs: Any) -> tuple[Any, ...] | None:
    """A completions choice's logprob values (token_logprobs, top_logprobs), None for chat's or none."""
    if logprobs is None or getattr(logprobs, "token_logprobs", None) is None:
        return None
    return (list(logprobs.token_logprobs), list(logprobs.top_logprobs or []))


def _streamed(chunks: Any, n: int, with_tokens: bool, text_of: Callable[[Any], str]) -> Output:
    """An Output from a stream of chunks (chat or completions: `text_of` reads a choice's new text); its
    values have each choice's usage in its last chunk (vLLM's continuous_usage_stats; else None)."""
    texts, finish = [""] * n, [None] * n
    chunk_usage: list[int | None] = [None] * n
    toks: list[list[bytes] | None] = [[] if with_tokens else None for _ in range(n)]
    values: list[list[Any]] = [[[], []] for _ in range(n)]
    usage = None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
        for c in ch.choices:
            if ch.usage is not None:
                chunk_usage[c.index] = ch.usage.completion_tokens
            texts[c.index] += text_of(c)
            finish[c.index] = c.finish_reason or finish[c.index]
            got = _tokens(c.logprobs)
            if got is not None and toks[c.index] is not None:
                toks[c.index] += list(got)  # type: ignore[operator]
            v = _values(c.logprobs)
            if v is not None:
                values[c.index][0] += v[0]
                values[c.index][1] += v[1]
    return Output(
        tuple((texts[i], finish[i], tuple(toks[i]) if toks[i] is not None else None) for i in range(n)),
        usage,
        tuple((None, tuple(v), chunk_usage[i]) for i, v in enumerate(values)),
    )


def compare(turn: str, ref: Output, pd: Output, values: bool = False) -> list[str]:
    diffs = []
    if len(ref.choices) != len(pd.choices):
        return [f"{turn}: {len(ref.choices)} choices (ref) vs {len(pd.choices)} (pd)"]
    if values:
        diffs += _compare_values(turn, ref.values, pd.values)
    for i, ((rt, rf, rtok), (pt, pf, ptok)) in enumerate(zip(ref.choices, pd.choices)):
        if rtok is not None and ptok is not None and rtok != ptok:
            k = next((j for j, (a, b) in enumerate(zip(rtok, ptok)) if a != b), min(len(rtok), len(ptok)))
            diffs.append(
                f"{turn} choice {i}: tokens differ at {k}: ref {rtok[k : k + 3]!r} vs pd {ptok[k : k + 3]!r} "
                f"({len(rtok)} vs {len(ptok)} tokens)"
            )
        elif rt != pt:
            k = next((j for j, (a, b) in enumerate(zip(rt, pt)) if a != b), min(len(rt), len(pt)))
            diffs.append(
                f"{turn} choice {i}: text differs at char {k}: ref {rt[k : k + 30]!r} vs pd {pt[k : k + 30]!r}"
            )
        if rf != pf:
            diffs.append(f"{turn} choice {i}: finish_reason {rf!r} (ref) vs {pf!r} (pd)")
    if ref.completion_tokens != pd.completion_tokens:
        diffs.append(
            f"{turn}: completion_tokens {ref.completion_tokens} (ref) vs {pd.completion_tokens} (pd)"
        )
    return diffs


def _compare_values(turn: str, ref: tuple[Any, ...], pd: tuple[Any, ...]) -> list[str]:
    """The logprob values, exactly (floats as JSON gives them: the same bits or not)."""
    if not any(_has_values(v) for v in ref):
        return [f"{turn}: the reference returned no logprob values to compare"]
    if len(ref) != len(pd):
        return [f"{turn}: {len(ref)} value sets (ref) vs {len(pd)} (pd)"]
    return [f"{turn} value set {i}: differ{_first_difference(a, b)}" for i, (a, b) in enumerate(zip(ref, pd)) if a != b]


def _has_values(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return any(_has_values(x) for x in v)
    return v is not None


def _first_difference(x: Any, y: Any) -> str:
    """Where two nested lists (or tuples) of values first differ."""
    path = ""
    while isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        k = next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
        if k is None:
            return f"{path}: {len(x)} vs {len(y)} entries"
        path, x, y = f"{path}[{k}]", x[k], y[k]
    return f" at {path}: ref {str(x)[:80]} vs pd {str(y)[:80]}"


# A case: name -> function(ref_client, pd_client, model) -> CaseResult.
Case = Callable[[Any, Any, str], CaseResult]


def both(on_ref: Callable[[], Output], on_pd: Callable[[], Output]) -> tuple[Output, Output]:
    """The same request to both sides at once (halves a run's time; --deterministic makes the
    batches each side happens to form irrelevant to the tokens)."""
    with ThreadPoolExecutor(1) as ex:
        pd = ex.submit(on_pd)
        return on_ref(), pd.result()


def single(name: str, kind: str, stream: bool = False, values: bool = False, **kw: Any) -> tuple[str, Case]:
    """One request to both sides; values: its logprob values must match too, bit for bit."""
    call = chat if kind == "chat" else complete

    def run(ref: Any, pd: Any, model: str) -> CaseResult:
        res = CaseResult(name, num_requests=1)
        res.diffs = compare(
            "", *both(lambda: call(ref, model, stream, **kw), lambda: call(pd, model, stream, **kw)), values=values
        )
        return res

    return name, run


def conversation(name: str, question: str, turns: int, stream: bool, **kw: Any) -> tuple[str, Case]:
    """Multi-turn chat: each turn appends the reference's answer and a follow-up, for both sides."""

    def run(ref: Any, pd: Any, model: str) -> CaseResult:
        res = CaseResult(name)
        messages: list[dict[str, str]] = [{"role": "user", "content": question}]
        for t in range(turns):
            a, b = both(
                lambda m=messages: chat(ref, model, stream, messages=m, logprobs=True, **kw),
                lambda m=messages: chat(pd, model, stream, messages=m, logprobs=True, **kw),
            )
            res.num_requests += 1
            res.diffs += compare(f"turn {t + 1}", a, b)
            messages = messages + [
                {"role": "assistant", "content": a.choices[0][0]},
                {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]},
            ]
        return res

    return name, run


def text_conversation(name: str, prompt: str, turns: int, stream: bool, **kw: Any) -> tuple[str, Case]:
    """Multi-turn without a chat template: the prompt grows by the reference's completion each turn."""

    def run(ref: Any, pd: Any, model: str) -> CaseResult:
        res = CaseResult(name)
        text = prompt
        for t in range(turns):
            a, b = both(
                lambda p=text: complete(ref, model, stream, prompt=p, logprobs=0, **kw),
                lambda p=text: complete(pd, model, stream, prompt=p, logprobs=0, **kw),
            )
            res.num_requests += 1
            res.diffs += compare(f"turn {t + 1}", a, b)
            text = text + a.choices[0][0] + "\n"
        return res

    return name, run


def concurrent(name: str, inner: list[tuple[str, Case]], concurrency: int) -> tuple[str, Case]:
    """The inner cases all at once against each side (the P/D side batches them; --deterministic
    makes that irrelevant to the tokens)."""

    def run(ref: Any, pd: Any, model: str) -> CaseResult:
        res = CaseResult(name)
        with ThreadPoolExecutor(concurrency) as ex:
            results = list(ex.map(lambda c: c[1](ref, pd, model), inner))
        for r in results:
            res.num_requests += r.num_requests
            res.diffs += [f"{r.name}: {d}" for d in r.diffs]
            if r.error:
                res.diffs.append(f"{r.name}: {r.error}")
        return res

    return name, run


def chat_cases(concurrency: int, max_tokens: int) -> list[tuple[str, Case]]:
    m = max_tokens
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    long = user(LONG_CONTEXT + "\n\nWhich host answered fastest? Answer briefly.")
    cases = [
        single(
            "chat short greedy",
            "chat",
            messages=user(QUESTIONS[0]),
            max_tokens=m,
            temperature=0,
            logprobs=True,
        ),
        single(
            "chat short stream",
            "chat",
            True,
            messages=user(QUESTIONS[1]),
            max_tokens=m,
            temperature=0,
            logprobs=True,
        ),
        single(
            "chat usage in every chunk",
            "chat",
            True,
            values=True,
            messages=user(QUESTIONS[2]),
            max_tokens=m,
            temperature=0,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
        single(
            "chat beam search",
            "chat",
            messages=user(QUESTIONS[2]),
            n=2,
            max_tokens=m,
            logprobs=True,
            top_logprobs=2,
            use_beam_search=True,
            length_penalty=0.5,
        ),
        single("chat long greedy", "chat", messages=long, max_tokens=m, temperature=0, logprobs=True),
        single("chat long stream", "chat", True, messages=long, max_tokens=m, temperature=0, logprobs=True),
        single(
            "chat stop string",
            "chat",
            messages=user("Count from one to ten in words, separated by commas."),
            max_tokens=m,
            temperature=0,
            stop=[", four", "ten"],
        ),
        single(
            "chat penalties",
            "chat",
            messages=user("Repeat the word 'echo' many times."),
            max_tokens=m,
            temperature=0,
            presence_penalty=0.6,
            frequency_penalty=0.8,
            repetition_penalty=1.3,
            logprobs=True,
        ),
        single(
            "chat logit_bias, min_p and min_tokens",
            "chat",
            messages=user("Answer with one word: is the sky blue?"),
            max_tokens=m,
            temperature=0.8,
            seed=99,
            logit_bias={"13": -100, "28": 5},
            min_p=0.05,
            min_tokens=max(1, m - 2),
            logprobs=True,
        ),
        single(
            "chat json_schema",
            "chat",
            messages=user("Describe a city as JSON: its name, country and population."),
            max_tokens=m,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}},
            logprobs=True,
        ),
        single(
            "chat json_object seeded stream",
            "chat",
            True,
            messages=user("Give a JSON object describing a cat."),
            max_tokens=m,
            temperature=0.9,
            seed=5,
            response_format={"type": "json_object"},
            logprobs=True,
        ),
        single(
            "chat regex",
            "chat",
            messages=user("What is a phone number?"),
            max_tokens=m,
            temperature=0,
            structured_outputs={"regex": "[0-9]{3}-[0-9]{4}"},
        ),
        single(
            "chat seeded sampling",
            "chat",
            messages=user(QUESTIONS[2]),
            max_tokens=m,
            temperature=0.9,
            top_p=0.9,
            seed=1234,
            logprobs=True,
        ),
        single(
            "chat seeded stream n=2",
            "chat",
            True,
            messages=user(QUESTIONS[3]),
            max_tokens=m,
            temperature=1.0,
            top_k=40,
            seed=7,
            n=2,
            logprobs=True,
        ),
        single(
            "chat max_tokens 1",
            "chat",
            messages=user(QUESTIONS[4]),
            max_tokens=1,
            temperature=0,
            logprobs=True,
        ),
        single(
            "chat top_logprobs",
            "chat",
            messages=user(QUESTIONS[5]),
            max_tokens=m,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        ),
        single(
            "chat prompt_logprobs",
            "chat",
            values=True,
            messages=user(QUESTIONS[5]),
            max_tokens=m,
            temperature=0,
            logprobs=True,
            prompt_logprobs=3,
        ),
        conversation("conversation greedy 3 turns", QUESTIONS[6], 3, False, max_tokens=m, temperature=0),
        conversation(
            "conversation seeded stream 3 turns",
            QUESTIONS[7],
            3,
            True,
            max_tokens=m,
            temperature=0.8,
            seed=99,
        ),
        conversation(
            "conversation long 2 turns",
            LONG_CONTEXT + "\n\nWhich host is mentioned first?",
            2,
            True,
            max_tokens=m,
            temperature=0,
        ),
    ]
    if concurrency > 1:
        inner = [
            conversation(
                f"#{i}",
                QUESTIONS[i % len(QUESTIONS)] + f" (conversation {i})",
                2,
                i % 2 == 0,
                max_tokens=m,
                temperature=0 if i % 3 else 0.7,
                seed=i,
            )
            for i in range(concurrency)
        ]
        cases.append(concurrent(f"{concurrency} concurrent conversations", inner, concurrency))
    return cases


def completion_cases(concurrency: int, max_tokens: int) -> list[tuple[str, Case]]:
    m = max_tokens
    cases = [
        single(
            "completion greedy",
            "completions",
            prompt="The capital of France is",
            max_tokens=m,
            temperature=0,
            logprobs=0,
        ),
        single(
            "completion stream",
            "completions",
            True,
            prompt="Once upon a time",
            max_tokens=m,
            temperature=0,
            logprobs=0,
        ),
        single(
            "completion usage in every chunk",
            "completions",
            True,
            values=True,
            prompt="Once upon a time",
            n=2,
            max_tokens=m,
            temperature=0.8,
            seed=7,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
        single(
            "completion beam search",
            "completions",
            values=True,
            prompt=["Once upon a time", "The capital of France is"],
            n=2,
            max_tokens=m,
            logprobs=1,
            use_beam_search=True,
        ),
        single(
            "completion long",
            "completions",
            prompt=LONG_CONTEXT + "\nThe fastest host was",
            max_tokens=m,
            temperature=0,
            logprobs=0,
        ),
        single(
            "completion seeded sampling",
            "completions",
            prompt="A list of fruits:",
            max_tokens=m,
            temperature=0.9,
            seed=5,
            logprobs=0,
        ),
        single("completion stop", "completions", prompt="1, 2, 3,", max_tokens=m, temperature=0, stop=[" 7"]),
        single(
            "completion penalties and logit_bias",
            "completions",
            prompt="1, 2, 3, 1, 2, 3, 1, 2,",
            max_tokens=m,
            temperature=0,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            repetition_penalty=1.2,
            logit_bias={"28": 3},
            min_tokens=max(1, m - 1),
            logprobs=0,
        ),
        single(
            "completion max_tokens 1", "completions", prompt="Hello", max_tokens=1, temperature=0, logprobs=0
        ),
        single(
            "completion prompt_logprobs n=2",
            "completions",
            values=True,
            prompt="The three primary colours are",
            max_tokens=m,
            temperature=0.8,
            seed=3,
            n=2,
            prompt_logprobs=5,
        ),
        single(
            "completion long prompt_logprobs",
            "completions",
            values=True,
            prompt=LONG_CONTEXT[: len(LONG_CONTEXT) // 3] + "\nThe slowest host was",  # 3 pages of 128
            max_tokens=m,
            temperature=0,
            logprobs=1,
            prompt_logprobs=2,
        ),
        # lm-evaluation-harness's loglikelihood: the prompt's logprobs through echo
        single(
            "completion echo logprobs",
            "completions",
            values=True,
            prompt=["Question: What is 2 + 2?\nAnswer: 4", "Question: Which city is the capital of Italy?\nAnswer: Rome"],
            max_tokens=1,
            temperature=0,
            echo=True,
            logprobs=1,
        ),
        single(
            "completion echo logprobs max_tokens 0",
            "completions",
            values=True,
            prompt="The capital of France is Paris",
            max_tokens=0,
            echo=True,
            logprobs=3,
        ),
        single(
            "completion echo logprobs stream",
            "completions",
            True,
            values=True,
            prompt="Once upon a time there was",
            max_tokens=m,
            temperature=0,
            echo=True,
            logprobs=2,
        ),
        text_conversation(
            "completion multi-turn",
            LONG_CONTEXT + "\nQ: Which host is first?\nA:",
            3,
            True,
            max_tokens=m,
            temperature=0,
        ),
    ]
    if concurrency > 1:
        inner = [
            text_conversation(
                f"#{i}",
                f"Story {i}: " + QUESTIONS[i % len(QUESTIONS)],
                2,
                i % 2 == 1,
                max_tokens=m,
                temperature=0,
                seed=i,
            )
            for i in range(concurrency)
        ]
        cases.append(concurrent(f"{concurrency} concurrent completion conversations", inner, concurrency))
    return cases


def has_chat_template(client: Any, model: str) -> bool:
    import openai

    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    except openai.BadRequestError as e:
        if e.code == "no_chat_template" or "no chat template" in str(e):
            return False
        raise
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/check_pd.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", required=True, help="single-engine server URL (http://host:port)")
    p.add_argument(
        "--pd", required=True, help="the P/D CE's URL (http://host:port); several, comma-separated: in turn"
    )
    p.add_argument("--model", default=None, help="default: the ref server's only model")
    p.add_argument("--concurrency", type=int, default=16, help="conversations at once in the concurrent case")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument(
        "--only", default=None, help="run only cases whose name contains this (or one of these, comma-separated)"
    )
    p.add_argument(
        "--parallel", type=int, default=1, help="cases at once (each case's own requests stay in order)"
    )
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error("--parallel must be at least 1")

    from openai import OpenAI

    def client(url: str) -> Any:
        return OpenAI(
            base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=args.timeout_s
        )

    pd_urls = [u.strip() for u in args.pd.split(",") if u.strip()]
    ref, pds = client(args.ref), [client(u) for u in pd_urls]
    model = args.model or ref.models.list().data[0].id
    cases = completion_cases(args.concurrency, args.max_tokens)
    if has_chat_template(ref, model):
        cases = chat_cases(args.concurrency, args.max_tokens) + cases
    else:
        print(f"{model} has no chat template: completions cases only")
    if args.only:
        wanted = [w for w in args.only.split(",") if w]
        cases = [c for c in cases if any(w in c[0] for w in wanted)]
    print(f"check_pd: {len(cases)} cases, model {model}\n  ref {args.ref}\n  pd  {', '.join(pd_urls)}")

    def timed(i: int, name: str, run: Case) -> tuple[CaseResult, float]:
        t0 = time.perf_counter()
        try:
            r = run(ref, pds[i % len(pds)], model)
        except Exception as e:  # a failed request is a failed check, reported like a difference
            r = CaseResult(name, error=f"{type(e).__name__}: {e}")
        return r, time.perf_counter() - t0

    results = []
    ex = ThreadPoolExecutor(args.parallel)
    running = [ex.submit(timed, i, name, run) for i, (name, run) in enumerate(cases)]
    try:
        for i, ((name, _), future) in enumerate(zip(cases, running)):  # printed in order, as each ends
            r, seconds = future.result()
            results.append(r)
            status = "ok  " if r.ok else "DIFF" if r.diffs else "FAIL"
            via = f" via {pd_urls[i % len(pds)]}" if len(pds) > 1 else ""
            print(f"{status} {name:<45} {r.num_requests:>3} request(s) {seconds:6.1f} s{via}")
            for d in r.diffs[:10]:
                print(f"       {d}")
            if r.error:
                print(f"       {r.error}")
    finally:  # Ctrl-C: the cases not started yet are dropped, not run to the end
        ex.shutdown(wait=False, cancel_futures=True)
    bad = [r for r in results if not r.ok]
    total = sum(r.num_requests for r in results)
    print(f"{len(results) - len(bad)}/{len(results)} cases identical ({total} requests per side)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
