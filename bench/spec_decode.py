"""Speculative decoding with prompt lookup (`--speculative-config '{"method": "ngram", ...}'`) on the real
SmolLM2-135M-Instruct, against the same engine without speculation in the same run (the baseline).

Two workloads of real text, rendered with the checkpoint's chat template:

- agentic: turns whose answer quotes the prompt: a file asked back with a small edit (a rename), a tool's
  JSON result asked back verbatim or as a JSON field, search results and a CSV copied, a text with a
  spelling mistake fixed;
- chat: plain questions whose answers do not quote the prompt (prompt lookup finds little to draft).

For each workload, batch size and k (num_speculative_tokens): output tokens/s with and without speculation,
the speedup, the acceptance rate (accepted / draft tokens), the mean accepted length (vLLM's: 1 + accepted /
drafts, over the steps that drafted) and the acceptance per draft position (accepted at j / drafts). Greedy,
stopping at EOS or max tokens. Two clocks: "decode" (from the step at which every sequence of the batch has
its first token to the end: what speculation acts on) and "request" (the whole request, prefill included).
Batch 1 runs each prompt alone, one after another; batch B runs B prompts at once (the workload's prompts,
cycled). The configurations take turns request by request (batch by batch), their order rotated, so that
a change in the machine's load falls on all alike; the rates are over every round's tokens and seconds,
and the speedup of each round is given beside.

The identity check: the same prompts in deterministic mode (`is_deterministic=True`: batch-invariant
numerics, so a verify chunk of 1 + k rows gives the logits a one-token step does), at the largest batch,
every k against the baseline, token for token. The speed runs use the default numerics; whether their
tokens also matched the baseline's is reported beside (a float32 near-tie may part them).

    python bench/spec_decode.py [--ks 1,3,5] [--batches 1,8] [--prompts 8] [--max-tokens 160]
        [--rounds 2] [--quick] [--out DIR]
"""

from __future__ import annotations

import os

# A step's threads wait passively: on shared cores OpenMP's spinning waits cost a CPU decode step ten times
# its time here (SmolLM2, 2 cores beside other jobs: 1.77 s a token spinning, 0.17 s passive). The numbers
# are the same either way. Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import engine  # noqa: E402
from engine.checkpoints import load_tokenizer, resolve_model  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

Messages = list[dict[str, str]]

_CODE = '''import json
from dataclasses import dataclass


@dataclass
class Config:
    name: str
    size: int = 0


def parse_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("missing name")
    return Config(name=data["name"], size=int(data.get("size", 0)))
'''

_WEATHER = json.dumps(
    {
        "location": "Lyon, FR",
        "observed_at": "2026-12-07T06:00:00Z",
        "temperature_c": 3.4,
        "feels_like_c": 0.9,
        "humidity": 81,
        "wind": {"speed_kmh": 14, "direction": "NW"},
        "conditions": "light rain",
    },
    indent=2,
)

_USER = json.dumps(
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

_CSV = """city,country,population
Paris,France,2102650
Berlin,Germany,3878100
Madrid,Spain,3332035
Rome,Italy,2755309
Oslo,Norway,717710
"""

_JS = """function total(items) {
  let sum = 0;
  for (const item of items) {
    sum += item.price * item.quantity;
  }
  return sum;
}
"""

_SEARCH = """1. Speculative decoding - Fast Inference from Transformers via Speculative Decoding (arxiv.org/abs/2211.17192)
2. Prompt lookup decoding (github.com/apoorvumang/prompt-lookup-decoding)
3. vLLM docs: Speculative Decoding (docs.vllm.ai/en/latest/features/spec_decode.html)
4. Medusa: Simple LLM Inference Acceleration Framework (arxiv.org/abs/2401.10774)
"""

_EMAIL = (
    "Hi Sam,\n\nThanks for sending the report. I have read it and I think the numbers for the third quarter "
    "look good. Could you send me the final version by Friday? I will foward it to the team on Monday.\n\n"
    "Best regards,\nAlex"
)

_NOTE = (
    "The service will recieve requests on port 8080 and forward them to the workers. Each worker "
    "keeps a connection pool of ten connections to the database and logs in JSON."
)


def _user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


def _tool_turn(ask: str, call: str, result: str, then: str) -> Messages:
    return [
        {"role": "system", "content": "You are a coding agent. You can call tools; their results follow."},
        {"role": "user", "content": ask},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": result},
        {"role": "user", "content": then},
    ]


# answers that quote the prompt: what prompt lookup is for (phrased so that SmolLM2-135M does quote it)
AGENTIC: list[Messages] = [
    _user(
        f"Here is config.py:\n\n```python\n{_CODE}```\n\nRename the function parse_config to load_config. "
        "Return the whole file, code only."
    ),
    _tool_turn("Look up user 42.", "get_user(42)", _USER, "Return the tool result exactly as it is, as JSON."),
    _tool_turn(
        "What is the weather in Lyon?",
        'get_weather(city="Lyon")',
        _WEATHER,
        'Return a JSON object {"observation": ...} whose value is the tool result exactly as given.',
    ),
    _user(
        f"Here is cart.js:\n\n```javascript\n{_JS}```\n\nCopy this code exactly, with the function named "
        "cartTotal instead of total."
    ),
    _user(f"Search results:\n\n{_SEARCH}\nCopy these results exactly."),
    _user(f"Here is cities.csv:\n\n```\n{_CSV}```\n\nCopy this CSV exactly."),
    _user(f"Fix the spelling mistake in this email and return the whole email:\n\n{_EMAIL}"),
    _user(f"Fix the spelling mistake in this paragraph and return the whole paragraph:\n\n{_NOTE}"),
]

# answers that do not quote the prompt (taken as they came: SmolLM2-135M repeats itself in some, which
# prompt lookup drafts from too)
CHAT: list[Messages] = [
    _user(q)
    for q in (
        "Why is the sky blue? Explain in a few sentences.",
        "Give me three tips for learning a new language.",
        "What is the difference between a list and a tuple in Python?",
        "Write a short poem about autumn.",
        "How do vaccines work?",
        "Suggest a name for a bakery and explain why.",
        "What are the benefits of regular exercise?",
        "Describe how a bill becomes a law, in simple terms.",
    )
]

WORKLOADS = {"agentic": AGENTIC, "chat": CHAT}


@dataclass
class Run:
    """One configuration's run of one workload at one batch size."""

    num_output_tokens: int = 0
    request_s: float = 0.0
    decode_tokens: int = 0  # output tokens after each sequence's first
    decode_s: float = 0.0
    num_forwards: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_steps: int = 0  # pure decode steps the switch let draft ("3a") / kept plain
    plain_steps: int = 0
    tokens: list[list[int]] = field(default_factory=list)  # per prompt, in order

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def request_tok_s(self) -> float:
        return self.num_output_tokens / self.request_s if self.request_s else 0.0


def _spec_counters(eng: LLMEngine) -> tuple[int, int, int, list[int], int, int]:
    s = eng.stats()
    return (
        s.spec_num_drafts_total,
        s.spec_num_draft_tokens_total,
        s.spec_num_accepted_tokens_total,
        list(s.spec_accepted_per_position),
        s.spec_switch_drafted_steps_total,
        s.spec_switch_plain_steps_total,
    )


def run_group(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, run: Run) -> None:
    """prompts run together to their end; adds to run."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    before, forwards = _spec_counters(eng), eng.runner.num_forwards
    ids = [f"p{i}" for i in range(len(prompts))]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    t_first = None
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        if t_first is None and all(out.values()):
            t_first = time.perf_counter()
    t1 = time.perf_counter()
    assert t_first is not None
    after = _spec_counters(eng)
    run.tokens += [out[rid] for rid in ids]
    n = sum(len(t) for t in out.values())
    run.num_output_tokens += n
    run.request_s += t1 - t0
    run.decode_tokens += n - len(ids)
    run.decode_s += t1 - t_first
    run.num_forwards += eng.runner.num_forwards - forwards
    run.num_drafts += after[0] - before[0]
    run.num_draft_tokens += after[1] - before[1]
    run.num_accepted_tokens += after[2] - before[2]
    run.drafted_steps += after[4] - before[4]
    run.plain_steps += after[5] - before[5]
    per = [a - b for a, b in zip(after[3], before[3])]
    if not run.accepted_per_position:
        run.accepted_per_position = [0] * len(per)
    run.accepted_per_position = [a + b for a, b in zip(run.accepted_per_position, per)]


def units_of(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """What runs at once: batch 1, each prompt alone; batch B, the prompts cycled to B."""
    if batch == 1:
        return [[p] for p in prompts]
    return [[prompts[i % len(prompts)] for i in range(batch)]]


def run_interleaved(
    engines: dict[str, LLMEngine], prompts: list[list[int]], batch: int, max_tokens: int, shift: int
) -> dict[str, Run]:
    """Every configuration runs each unit (one request at batch 1, the batch otherwise) before the next
    unit starts, their order rotated unit by unit: a change in the machine's load falls on all alike."""
    configs = list(engines)
    runs = {k: Run() for k in configs}
    for u, unit in enumerate(units_of(prompts, batch)):
        at = (u + shift) % len(configs)
        for k in configs[at:] + configs[:at]:
            run_group(engines[k], unit, max_tokens, runs[k])
    for eng in engines.values():
        eng.check_idle()
    return runs


def total(runs: list[Run]) -> Run:
    """Runs summed (rounds of one configuration)."""
    out = Run()
    for r in runs:
        out.num_output_tokens += r.num_output_tokens
        out.request_s += r.request_s
        out.decode_tokens += r.decode_tokens
        out.decode_s += r.decode_s
        out.num_forwards += r.num_forwards
        out.num_drafts += r.num_drafts
        out.num_draft_tokens += r.num_draft_tokens
        out.num_accepted_tokens += r.num_accepted_tokens
        out.drafted_steps += r.drafted_steps
        out.plain_steps += r.plain_steps
        out.accepted_per_position = [
            a + b for a, b in zip(out.accepted_per_position or [0] * len(r.accepted_per_position), r.accepted_per_position)
        ]
    out.tokens = runs[0].tokens
    return out


def spec_json(k: str) -> str:
    """k: "3", speculating at every batch size; "3a", with the switch ("auto_disable": true) deciding."""
    return json.dumps({"method": "ngram", "num_speculative_tokens": int(k.rstrip("a")), "prompt_lookup_max": 4,
                       "prompt_lookup_min": 1, "auto_disable": k.endswith("a")})


def make_engines(args: argparse.Namespace, is_deterministic: bool) -> dict[str, LLMEngine]:
    """k -> engine (0: the baseline, no speculation); each warmed up on a short request."""
    engines = {}
    for k in ["0", *args.ks]:
        eng = LLMEngine(
            EngineConfig(
                model=args.model,
                device="cpu",
                is_deterministic=is_deterministic,
                max_model_len=2048,
                kv_cache_gb=0.5,
                hicache_gb=0,  # every round prefills its prompts (no prefix cache hits across rounds)
                max_num_seqs=max(args.batches),
                speculative_config=spec_json(k) if k != "0" else None,
            )
        )
        warm = [list(range(100, 164)) * 2]  # repeats: the speculative engines draft in the warm-up
        eng.generate(warm, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        engines[k] = eng
    return engines


def tree_of(root: Path) -> str:
    """The commit of the engine this run imported, "-dirty" when its files differ from it."""
    got = subprocess.run(
        ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True
    )
    return got.stdout.strip() or "unknown"


def rate(num: int, den: int) -> float | None:
    return num / den if den else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--ks", default="1,3,5", help="num_speculative_tokens values, comma-separated; a trailing "
                    "'a' (3a): with the switch deciding per batch size (auto_disable), else drafting always")
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload (of 8)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2, help="speed rounds (summed)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument("--quick", action="store_true", help="k 3, batches 1 and 4, 3 prompts, 64 tokens, 1 round")
    ap.add_argument("--out", default=None, help="a folder for spec_decode.md and spec_decode.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.ks, args.batches, args.prompts, args.max_tokens, args.rounds = "3", "1,4", 3, 64, 1
    args.ks = [k.strip() for k in args.ks.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)

    folder = resolve_model(args.model)
    tok = load_tokenizer(folder)
    rendered = {
        name: [
            tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
                "input_ids"
            ]
            for m in msgs[: args.prompts]
        ]
        for name, msgs in WORKLOADS.items()
    }
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_before = os.getloadavg()

    # ---- speed: default numerics, the configurations interleaved request by request (batch by batch) ----
    engines = make_engines(args, is_deterministic=False)
    rounds: dict[tuple[str, int, str], list[Run]] = {}
    for r in range(args.rounds):
        for name, prompts in rendered.items():
            for batch in args.batches:
                runs = run_interleaved(engines, prompts, batch, args.max_tokens, shift=r)
                for k, run in runs.items():
                    rounds.setdefault((name, batch, k), []).append(run)
                print(
                    f"round {r} {name} b={batch}: decode tok/s "
                    + ", ".join(f"k={k} {run.decode_tok_s:.1f}" for k, run in runs.items()),
                    flush=True,
                )
    del engines
    gc.collect()

    # ---- identity: deterministic numerics, the largest batch, every k against the baseline ----
    engines = make_engines(args, is_deterministic=True)
    batch = max(args.batches)
    identity: dict[tuple[str, str], tuple[int, int]] = {}  # (workload, k) -> (sequences equal, sequences)
    det_runs: dict[tuple[str, str], Run] = {}
    for name, prompts in rendered.items():
        for k, run in run_interleaved(engines, prompts, batch, args.max_tokens, shift=0).items():
            det_runs[(name, k)] = run
        base_tokens = det_runs[(name, "0")].tokens
        for k in args.ks:
            got = det_runs[(name, k)].tokens
            identity[(name, k)] = (sum(a == b for a, b in zip(got, base_tokens)), len(base_tokens))
    del engines
    gc.collect()
    load_after = os.getloadavg()

    # ---- the table ----
    rows: list[dict[str, Any]] = []
    for name in rendered:
        for batch in args.batches:
            base = total(rounds[(name, batch, "0")])
            for k in args.ks:
                spec = total(rounds[(name, batch, k)])
                per_round = [
                    s.decode_tok_s / b.decode_tok_s for s, b in zip(rounds[(name, batch, k)], rounds[(name, batch, "0")])
                ]
                same_default = sum(a == b for a, b in zip(spec.tokens, base.tokens))
                eq, num = identity[(name, k)]
                rows.append(
                    dict(
                        workload=name,
                        batch=batch,
                        k=k,
                        output_tokens=rounds[(name, batch, k)][0].num_output_tokens,  # one round's
                        base_decode_tok_s=base.decode_tok_s,
                        spec_decode_tok_s=spec.decode_tok_s,
                        decode_speedup=spec.decode_tok_s / base.decode_tok_s,
                        decode_speedup_per_round=per_round,
                        request_speedup=spec.request_tok_s / base.request_tok_s,
                        base_request_tok_s=base.request_tok_s,
                        spec_request_tok_s=spec.request_tok_s,
                        tokens_per_forward=spec.num_output_tokens / max(1, spec.num_forwards),
                        base_tokens_per_forward=base.num_output_tokens / max(1, base.num_forwards),
                        acceptance_rate=rate(spec.num_accepted_tokens, spec.num_draft_tokens),
                        mean_accepted_length=(
                            1 + spec.num_accepted_tokens / spec.num_drafts if spec.num_drafts else None
                        ),
                        acceptance_per_position=[
                            a / spec.num_drafts if spec.num_drafts else 0.0 for a in spec.accepted_per_position
                        ],
                        num_drafts=spec.num_drafts,
                        num_draft_tokens=spec.num_draft_tokens,
                        num_accepted_tokens=spec.num_accepted_tokens,
                        switch_steps=f"{spec.drafted_steps}/{spec.plain_steps}" if k.endswith("a") else "-",
                        same_tokens_default=f"{same_default}/{len(base.tokens)}",
                        same_tokens_deterministic=f"{eq}/{num}",
                        decode_tok_s_per_round=[x.decode_tok_s for x in rounds[(name, batch, k)]],
                        base_decode_tok_s_per_round=[x.decode_tok_s for x in rounds[(name, batch, "0")]],
                    )
                )

    def fmt(v: float | None, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)

    commit = tree_of(Path(engine.__file__).parents[1])
    prompt_lens = {n: [len(p) for p in ps] for n, ps in rendered.items()}
    lines = [
        f"bench/spec_decode.py, {started}, tree {commit}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average {load_before[0]:.1f} -> "
        f"{load_after[0]:.1f}",
        f"model {args.model} (float32, CPU), greedy, max {args.max_tokens} tokens (or EOS), ngram "
        f"prompt_lookup 1..4; prompts per workload {args.prompts} (tokens: "
        + "; ".join(f"{n} {min(v)}-{max(v)}" for n, v in prompt_lens.items())
        + f"); {args.rounds} round(s) summed",
        "baseline: the same engine without speculation, in the same run, interleaved request by request; "
        f"identity: deterministic numerics at batch {max(args.batches)}",
        "",
        "| workload | batch | k | tokens | base tok/s | spec tok/s | speedup (decode) | per round | speedup (request) "
        "| acceptance | mean acc. len | acc. per position | tokens / forward | same tokens (det.) "
        "| same tokens (default) | switch: drafted/plain steps |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['workload']} | {row['batch']} | {row['k']} | {row['output_tokens']} "
            f"| {row['base_decode_tok_s']:.1f} | {row['spec_decode_tok_s']:.1f} | {row['decode_speedup']:.2f}x "
            f"| {'/'.join(format(x, '.2f') for x in row['decode_speedup_per_round'])} "
            f"| {row['request_speedup']:.2f}x | {fmt(row['acceptance_rate'])} | {fmt(row['mean_accepted_length'])} "
            f"| {'/'.join(format(a, '.2f') for a in row['acceptance_per_position'])} "
            f"| {row['tokens_per_forward']:.2f} (base {row['base_tokens_per_forward']:.2f}) "
            f"| {row['same_tokens_deterministic']} | {row['same_tokens_default']} | {row['switch_steps']} |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec_decode.md").write_text(table + "\n")
        payload = {
            "started": started,
            "tree": commit,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_average": [load_before, load_after],
            "args": {k: v for k, v in vars(args).items()},
            "prompt_tokens": prompt_lens,
            "rows": rows,
            "deterministic_runs": {f"{n} k={k}": asdict(r) | {"tokens": None} for (n, k), r in det_runs.items()},
            "baseline_texts": {n: [tok.decode(t) for t in det_runs[(n, "0")].tokens] for n in rendered},
        }
        (out / "spec_decode.json").write_text(json.dumps(payload, indent=2) + "\n")
        print(f"written: {out / 'spec_decode.md'}, {out / 'spec_decode.json'}")
    mismatched = [f"{n} k={k}" for (n, k), (eq, num) in identity.items() if eq != num]
    if mismatched:
        print("tokens differ from the baseline in deterministic mode: " + ", ".join(mismatched))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
