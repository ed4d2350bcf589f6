"""The command-line pieces that bench/load/replay.py and bench/load/compare.py share: the trace and request flags,
and what they turn into (the trace, the extra request body, the load points, run labels and salts)."""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .summary import LONG_PROMPT_TOKENS
from .trace import Conversation, SyntheticSpec, read_trace, synthetic_trace, trace_digest, write_trace


def chat_url(url: str) -> str:
    """http://h:p, http://h:p/v1 or the full chat completions URL -> the full URL (each of a
    comma-separated list: the CEs of one cluster, taken in turn)."""
    if "," in url:
        return ",".join(chat_url(u) for u in url.split(",") if u.strip())
    url = url.strip().rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def server_model(url: str) -> str:
    import urllib.request

    base = chat_url(url).split(",")[0].removesuffix("/chat/completions")
    with urllib.request.urlopen(base + "/models", timeout=30) as r:
        return str(json.loads(r.read())["data"][0]["id"])


def _floats(s: str | None) -> list[float | None]:
    return [float(x) for x in s.split(",")] if s else [None]


def add_trace_args(ap: argparse.ArgumentParser) -> None:
    d = SyntheticSpec()
    g = ap.add_argument_group("trace")
    g.add_argument(
        "--trace", default="synthetic", help="'synthetic' or a JSONL file (pdserve, multi_turn, mooncake)"
    )
    g.add_argument(
        "--conversations", type=int, default=None, help=f"synthetic: {d.num_conversations}; a file: all of it"
    )
    g.add_argument(
        "--turns", type=int, default=None, help=f"turns per conversation, at most (synthetic: {d.num_turns})"
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--system-tokens", type=int, default=d.system_tokens)
    g.add_argument("--user-tokens", type=float, default=d.user_tokens)
    g.add_argument("--tool-tokens", type=float, default=d.tool_tokens)
    g.add_argument("--tool-fraction", type=float, default=d.tool_fraction)
    g.add_argument("--length-sigma", type=float, default=d.length_sigma)
    g.add_argument("--output-tokens", type=float, default=d.output_tokens, help="mean max_tokens a turn")
    g.add_argument(
        "--output-sigma",
        type=float,
        default=d.output_sigma,
        help="0: every turn asks exactly --output-tokens",
    )
    g.add_argument("--think-s", type=float, default=d.think_s)
    g.add_argument("--tool-latency-s", type=float, default=d.tool_latency_s)
    g.add_argument("--max-context-tokens", type=int, default=d.max_context_tokens)
    g.add_argument("--write-trace", type=Path, default=None, help="also write the trace here")
    g.add_argument("--trace-format", default="pdserve", choices=("pdserve", "multi_turn", "mooncake_trace"))


def add_request_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("load and requests")
    g.add_argument("--model", default=None, help="default: the server's first model")
    g.add_argument("--concurrency", default=None, help="concurrent conversations; a comma list sweeps")
    g.add_argument("--request-rate", default=None, help="new conversations/s (Poisson); a comma list sweeps")
    g.add_argument("--max-requests", type=int, default=None, help="stop sending after this many")
    g.add_argument("--duration-s", type=float, default=600.0, help="stop sending after this long")
    g.add_argument("--grace-s", type=float, default=30.0, help="then cancel what is still running after this")
    g.add_argument("--timeout-s", type=float, default=600.0, help="one request's limit")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--logprobs", action="store_true", help="ask for logprobs to count streamed tokens exactly"
    )
    g.add_argument(
        "--ignore-eos", action="store_true", help='send "ignore_eos": true (pdserve, vLLM, SGLang)'
    )
    g.add_argument("--no-prefix-cache", action="store_true", help='send "prefix_cache": false (pdserve)')
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request")
    g.add_argument("--warmup", type=int, default=1, help="short requests sent first, not recorded")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-itl-ms", type=float, default=None)
    g.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=LONG_PROMPT_TOKENS,
        help="uncached prompt tokens that make a long prefill (ITL is split by overlap with those)",
    )
    g.add_argument("--no-plots", action="store_true")


def trace_from_args(args: argparse.Namespace) -> tuple[list[Conversation], dict[str, Any]]:
    if args.trace == "synthetic":
        spec = SyntheticSpec(
            args.conversations or SyntheticSpec.num_conversations,
            args.turns or SyntheticSpec.num_turns,
            args.seed,
            args.system_tokens,
            args.user_tokens,
            args.tool_tokens,
            args.tool_fraction,
            args.length_sigma,
            args.output_tokens,
            args.output_sigma,
            args.think_s,
            args.tool_latency_s,
            args.max_context_tokens,
        )
        convs = synthetic_trace(spec)
        info: dict[str, Any] = {"source": "synthetic", "spec": asdict(spec)}
    else:
        convs = read_trace(Path(args.trace), round(args.output_tokens))[: args.conversations]
        if args.turns:
            convs = [replace(c, turns=c.turns[: args.turns]) for c in convs]
        info = {"source": str(args.trace), "spec": None}
    info |= {
        "num_conversations": len(convs),
        "num_turns": sum(len(c.turns) for c in convs),
        "sha256_16": trace_digest(convs),
    }
    if args.write_trace:
        write_trace(args.write_trace, convs, args.trace_format)
    return convs, info


def extra_body_from_args(args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = json.loads(args.extra_body) if args.extra_body else {}
    if args.ignore_eos:
        extra["ignore_eos"] = True
    if args.no_prefix_cache:
        extra["prefix_cache"] = False
    return extra


def load_points(args: argparse.Namespace) -> list[tuple[int | None, float | None]]:
    """(concurrency, request rate) of each run; one of the two may be a sweep."""
    cs = [None if c is None else int(c) for c in _floats(args.concurrency)]
    rs = _floats(args.request_rate)
    if len(cs) > 1 and len(rs) > 1:
        raise SystemExit("sweep either --concurrency or --request-rate, not both")
    if cs == [None] and rs == [None]:
        cs = [8]
    return [(c, r) for c in cs for r in rs]


def run_salt(name: str, point: int) -> str:
    """A marker in front of a run's first user messages: a sweep's or a comparison's runs never hit
    prefix-cache entries that an earlier run left (the same length for every run)."""
    return f"[{hashlib.sha1(f'{name}/{point}'.encode()).hexdigest()[:8]}] "


def point_label(c: int | None, r: float | None) -> str:
    return " ".join(x for x in (f"c={c}" if c else "", f"rate={r:g}/s" if r else "") if x)
