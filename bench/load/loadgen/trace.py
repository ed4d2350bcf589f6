"""Conversations to replay: the seeded synthetic trace (its distributions are in bench/load/replay.py's
docstring), trace files in this tool's JSONL format or aiperf's, and a trace's digest."""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Synthetic text is sized in tokens by estimate: a word of _WORDS is one token, a tool line's
# `path:line:` head and newline HEAD_TOKENS (SmolLM2's tokenizer: 1.01 tokens a word; tool results within 5%).
HEAD_TOKENS = 12

TURN_TOKENS = 8  # the chat template's markers around one message

_WORDS = (
    "the of and to in is that for it as with was on be by at this from are or an which have not but "
    "all can one has more their were will about if when there other into some time what only new out "
    "also two first any these may such after most over used then where could than many well made "
    "between under both each same must file line value error model request server token cache block "
    "memory layer batch queue rank prefill decode stream output input function return call check path "
    "test build config state page table index count size length limit start end next last read write "
    "open close load save send receive update change list item key name type field number string data "
    "result report step run task user agent tool answer question plan note fix issue patch code change"
).split()

_PATHS = (
    "src/app.py",
    "src/server/handler.py",
    "lib/cache.py",
    "tests/test_api.py",
    "README.md",
    "setup.cfg",
)

SYSTEM_HEAD = "You are a coding agent. Follow the instructions, call tools when needed, answer briefly."


@dataclass(frozen=True)
class Turn:
    content: str
    max_tokens: int
    delay_s: float = 0.0  # think time before this turn is sent (after the previous answer)
    kind: str = "user"  # "user" | "tool": what the new message stands for (it is sent as a user message)

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.delay_s < 0 or self.kind not in ("user", "tool"):
            raise ValueError(f"bad turn: {self.max_tokens=} {self.delay_s=} {self.kind=}")


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]
    system: str | None = None


@dataclass(frozen=True)
class SyntheticSpec:
    num_conversations: int = 64
    num_turns: int = 8
    seed: int = 0
    system_tokens: int = 400
    user_tokens: float = 60.0
    tool_tokens: float = 800.0
    tool_fraction: float = 0.3
    length_sigma: float = 0.6
    output_tokens: float = 150.0
    output_sigma: float = 0.5
    think_s: float = 2.0
    tool_latency_s: float = 0.5
    max_context_tokens: int = 32768

    def __post_init__(self) -> None:
        if self.num_conversations < 1 or self.num_turns < 1 or not 0 <= self.tool_fraction <= 1:
            raise ValueError(f"bad synthetic spec: {self}")


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal draw with the given mean (not median)."""
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma) if sigma > 0 else mean


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def _tool_result(rng: random.Random, n: int) -> str:
    lines, left = [], max(1, n)
    while left > 0:
        k = min(left, rng.randint(6, 16))
        lines.append(f"{rng.choice(_PATHS)}:{rng.randint(1, 900)}: {_words(rng, k)}")
        left -= k + HEAD_TOKENS
    return "Tool output:\n" + "\n".join(lines)


def synthetic_trace(spec: SyntheticSpec) -> list[Conversation]:
    """Seeded conversations with the distributions stated in bench/load/replay.py's docstring; conversation c
    is the same whatever the number of conversations, and a context cap only cuts it short."""
    system = SYSTEM_HEAD + " " + _words(random.Random(f"{spec.seed}-system"), spec.system_tokens)
    convs = []
    for c in range(spec.num_conversations):
        # one stream a conversation: its turns never depend on the other conversations
        rng = random.Random(f"{spec.seed}-{c}")
        context_tokens = spec.system_tokens + len(SYSTEM_HEAD.split()) + TURN_TOKENS  # estimated
        turns: list[Turn] = []
        for k in range(spec.num_turns):
            is_tool = k > 0 and rng.random() < spec.tool_fraction
            mean_tokens = spec.tool_tokens if is_tool else spec.user_tokens
            num_tokens = max(1, round(_lognormal(rng, mean_tokens, spec.length_sigma)))
            if is_tool:
                content = _tool_result(rng, num_tokens)
            else:
                content = (f"Task {c}: " if k == 0 else "") + _words(rng, num_tokens)
            mean_out = spec.output_tokens
            max_tokens = min(max(1, round(_lognormal(rng, mean_out, spec.output_sigma))), round(4 * mean_out))
            delay_s = (
                0.0 if k == 0 else rng.expovariate(1 / (spec.tool_latency_s if is_tool else spec.think_s))
            )
            context_tokens += num_tokens + TURN_TOKENS
            if context_tokens + max_tokens > spec.max_context_tokens:
                break
            turns.append(Turn(content, max_tokens, round(delay_s, 3), "tool" if is_tool else "user"))
            context_tokens += max_tokens + TURN_TOKENS  # the answer, at most
        if turns:
            convs.append(Conversation(f"conv-{c:04d}", tuple(turns), system))
    return convs


def trace_to_lines(convs: Sequence[Conversation], fmt: str) -> list[dict[str, Any]]:
    """JSONL records: `pdserve` (this tool's), aiperf `multi_turn` or aiperf `mooncake_trace`."""
    out: list[dict[str, Any]] = []
    for conv in convs:
        if fmt == "pdserve":
            out.append({"id": conv.id, "system": conv.system, "turns": [asdict(t) for t in conv.turns]})
        elif fmt == "multi_turn":
            turns: list[dict[str, Any]] = [{"role": "system", "text": conv.system}] if conv.system else []
            for k, t in enumerate(conv.turns):
                turns.append(
                    {"text": t.content, "output_length": t.max_tokens}
                    | ({"delay": round(t.delay_s * 1000, 3)} if k else {})
                )
            out.append({"session_id": conv.id, "turns": turns})
        elif fmt == "mooncake_trace":
            # text_input turns of one session_id: aiperf threads the answers into the history, but the
            # format has no system prompt, so it goes in front of the first user message.
            for k, t in enumerate(conv.turns):
                text = f"{conv.system}\n\n{t.content}" if k == 0 and conv.system else t.content
                out.append(
                    {"session_id": conv.id, "text_input": text, "output_length": t.max_tokens}
                    | ({"delay": round(t.delay_s * 1000, 3)} if k else {})
                )
        else:
            raise ValueError(f"unknown trace format {fmt!r}")
    return out


def write_trace(path: Path, convs: Sequence[Conversation], fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in trace_to_lines(convs, fmt):
            f.write(json.dumps(rec) + "\n")


def _turn_from_aiperf(t: dict[str, Any], default_max_tokens: int) -> Turn:
    text = t.get("text") if t.get("text") is not None else t.get("text_input")
    if text is None:
        texts = t.get("texts") or []
        text = "\n".join(x if isinstance(x, str) else "\n".join(x.get("contents", [])) for x in texts)
    kind = "tool" if str(text).startswith("Tool output:") else "user"
    max_tokens = int(t.get("output_length") or t.get("max_tokens") or default_max_tokens)
    return Turn(str(text), max_tokens, float(t.get("delay") or 0) / 1000, kind)


def read_trace(path: Path, default_max_tokens: int = 128) -> list[Conversation]:
    """Conversations of a JSONL trace in any format `trace_to_lines` writes (recognised line by line)."""
    convs: dict[str, Conversation] = {}
    for num, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "turns" in rec and "session_id" not in rec:  # pdserve
            cid = str(rec.get("id", f"conv-{num:04d}"))
            convs[cid] = Conversation(cid, tuple(Turn(**t) for t in rec["turns"]), rec.get("system"))
        elif "turns" in rec:  # aiperf multi_turn; a leading system turn is the system prompt
            cid, turns, system = str(rec["session_id"]), list(rec["turns"]), None
            if turns and turns[0].get("role") == "system":
                system = turns.pop(0).get("text")
            new = tuple(_turn_from_aiperf(t, default_max_tokens) for t in turns)
            old = convs.get(cid)
            convs[cid] = Conversation(
                cid, (old.turns if old else ()) + new, system or (old.system if old else None)
            )
        elif "text_input" in rec:  # aiperf mooncake_trace, one turn a line
            cid = str(rec.get("session_id", f"line-{num}"))
            old = convs.get(cid)
            turn = _turn_from_aiperf(rec, default_max_tokens)
            convs[cid] = Conversation(cid, (old.turns if old else ()) + (turn,), None)
        else:
            raise ValueError(f"{path}:{num + 1}: not a pdserve, multi_turn or text_input mooncake record")
    return list(convs.values())


def trace_digest(convs: Sequence[Conversation]) -> str:
    return hashlib.sha256(json.dumps(trace_to_lines(convs, "pdserve")).encode()).hexdigest()[:16]
