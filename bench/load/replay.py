#!/usr/bin/env python3
"""Multi-turn load generator for any OpenAI-compatible chat endpoint, streamed.

Replays conversations: turn N+1 sends the whole history (system prompt, every earlier message and the
server's own answers) plus one new message, after a think time, so contexts grow turn by turn the way
an agent's do. Load is a number of concurrent conversations (`--concurrency`), or new conversations
arriving as a Poisson process (`--request-rate`, per second, as aiperf's --request-rate in multi-turn
mode), or both (the rate, capped at the concurrency). A comma list of either is a sweep. Runs are
bounded by `--max-requests` and `--duration-s`.

    python bench/load/replay.py --url http://127.0.0.1:8888 --trace synthetic --conversations 64 --turns 8 \\
        --concurrency 8 --slo-ttft-ms 2000 --slo-itl-ms 100 --out bench/results/load
    python bench/load/replay.py --trace synthetic --conversations 64 --turns 8 \\
        --write-trace conv.jsonl --trace-format multi_turn        # for aiperf; no --url: nothing is sent

Synthetic traces (`--trace synthetic`, seeded by `--seed`), per conversation; sizes are in tokens by
estimate (HEAD_TOKENS below), the server's usage has the real counts:
  system prompt  one prompt of --system-tokens shared by every conversation (an agent's instructions)
  turn 0         the user's task: lognormal, mean --user-tokens, sigma --length-sigma (of the log)
  turn k >= 1    with probability --tool-fraction a tool result (grep-like lines): lognormal, mean
                 --tool-tokens; else a user message like turn 0. Think time before it: exponential, mean
                 --tool-latency-s after a tool call, --think-s before a user message
  max_tokens     lognormal, mean --output-tokens, sigma --output-sigma, clipped to [1, 4 x mean]
  context cap    a conversation ends before a turn whose estimated prompt + max_tokens would pass
                 --max-context-tokens (earlier answers counted at their max_tokens)
A trace file (`--trace F`) is JSONL in this tool's format (`--trace-format pdserve`, below), aiperf's
`multi_turn` or aiperf's `mooncake_trace` (text_input entries grouped by session_id); the format of each
line is recognised.

Per request it records TTFT, every inter-token gap, end-to-end time, and prompt / cached / completion
tokens from the server's usage (`stream_options.include_usage`); every turn of the trace is accounted
for as ok, error, cancelled (cut at the end of --duration-s + --grace-s) or skipped (not sent: a bound
was reached or an earlier turn of its conversation failed).

ITL is the gap between chunks that carry tokens (pdserve sends one token a chunk unless text is held
back; `--logprobs` counts tokens exactly). Goodput: requests per second that are ok and meet both SLOs,
TTFT <= --slo-ttft-ms and mean inter-token gap (TPOT) <= --slo-itl-ms; a missing SLO is not applied.
Prefix-cache hit rate: cached / prompt tokens, from usage.

Long prefills: a request whose uncached prompt (prompt - cached tokens, from usage) has at least
--long-prompt-tokens is prefilled from its send to its first token; every inter-token gap of the run is
put in one of two sets, gaps that overlap some long prefill and gaps that overlap none, and the summary
has the percentiles of each (`itl_in_long_prefill_ms`, `itl_outside_long_prefill_ms`). A server whose
decode steps stall behind prefills shows it in the first set.

From the endpoint's /metrics, the difference over each run (its requests only): a P/D endpoint's TTFT phases,
and where the server speculates (--speculative-config) its drafts, draft tokens and accepted tokens (vLLM's
vllm:spec_decode_* counters), the mean accepted length (1 + accepted / drafts, vLLM's definition: tokens
gained per verifying step) and the acceptance rate (accepted / draft tokens); `speculation` in the summary.

Outputs in --out: results.json (schema `pdserve-load/1`, see `results_doc`), summary.txt (the table
printed), distributions.png (TTFT and ITL CDFs), throughput.png (output tokens/s over time) and, for a
sweep, sweep.png (latency against load).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script without the project installed
    sys.path.insert(0, str(REPO))

from bench.load.loadgen.cli import (  # noqa: E402
    add_request_args,
    add_trace_args,
    chat_url,
    extra_body_from_args,
    load_points,
    point_label,
    run_salt,
    server_model,
    trace_from_args,
)
from bench.load.loadgen.report import (  # noqa: E402
    format_itl_split,
    format_table,
    results_doc,
    server_tables,
    write_outputs,
)
from bench.load.loadgen.runner import LoadConfig, run_load, warm_up  # noqa: E402
from bench.load.loadgen.summary import summarize  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    ap.add_argument(
        "--url", default=None, help="the endpoint: http://h:p, http://h:p/v1 or the full chat URL"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="folder for results.json, summary.txt and the PNGs"
    )
    ap.add_argument("--label", default=None, help="name of the run in the table and plots")
    ap.add_argument(
        "--progress-s",
        type=float,
        default=5.0,
        help="a progress line on stderr this often during a run (requests done, in flight, tokens); 0: none",
    )
    add_trace_args(ap)
    add_request_args(ap)
    args = ap.parse_args(argv)
    convs, trace_info = trace_from_args(args)
    if args.write_trace:
        print(
            f"wrote {trace_info['num_conversations']} conversations, {trace_info['num_turns']} turns "
            f"to {args.write_trace} ({args.trace_format})"
        )
    if args.url is None:
        if not args.write_trace:
            ap.error("--url is needed to send anything")
        return 0
    url = chat_url(args.url)
    model = args.model or server_model(url)
    extra = extra_body_from_args(args)
    points = load_points(args)
    asyncio.run(warm_up(url, model, args.warmup, extra))
    runs = []
    for i, (c, r) in enumerate(points):
        label = point_label(c, r) if len(points) > 1 or not args.label else args.label
        salt = run_salt(args.label or "run", i) if len(points) > 1 else ""
        cfg = replace(LoadConfig.from_args(args, url, model, c, r, extra, label, salt), progress_s=args.progress_s)
        run = asyncio.run(run_load(cfg, convs))
        if len(points) > 1:  # progress: the table's row of each point as it ends
            lines = format_table(
                [(label, summarize(run.requests, args.slo_ttft_ms, args.slo_itl_ms, args.long_prompt_tokens))]
            ).splitlines()
            print("\n".join(lines if i == 0 else lines[-1:]), flush=True)
        runs.append(run)
    doc = results_doc(
        runs,
        trace_info,
        args.slo_ttft_ms,
        args.slo_itl_ms,
        sys.argv if argv is None else argv,
        args.long_prompt_tokens,
    )
    series = {args.label or "run": doc["runs"]}
    if args.out:
        table = write_outputs(args.out, doc, series, plots=not args.no_plots)
        print(f"\n{table}\n\nresults in {args.out}/")
    else:
        rows = [(r["label"], r["summary"]) for r in doc["runs"]]
        print("\n" + format_table(rows) + "\n\n" + format_itl_split(rows) + server_tables(rows))
    errors = sum(r["summary"]["num_errors"] for r in doc["runs"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
