#!/usr/bin/env python3
"""`pdserve bench serve`: vLLM's `vllm bench serve` against any OpenAI-compatible server, with its flag names,
its datasets (bench/load/loadgen/datasets.py), its arrivals and its report (bench/load/loadgen/serving.py).

    pdserve bench serve --base-url http://127.0.0.1:8888 --dataset-name random --random-input-len 1024 \\
        --random-output-len 128 --num-prompts 200 --request-rate 8 --ignore-eos --save-result
    pdserve bench serve --endpoint /v1/chat/completions --dataset-name sharegpt \\
        --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --max-concurrency 16

--model defaults to the first model /v1/models lists; the tokenizer (prompt sampling and counting, as vLLM
uses its own) is --tokenizer, else that model's `root` (the --model the server was started with), else
--model: a local folder, a catalogue name or a hub id. Random prompts go to /v1/completions as token ids
(their lengths exact); to a chat endpoint as their decoded text, whose length the chat template and a
second tokenization change a little (the report counts what the server's usage says). Without
--ignore-eos an answer may end before its --random-output-len. Differences from vLLM: the default
--percentile-metrics adds e2el; no goodput, no sampling flags (temperature 0, as vLLM's default). With
--save-result the plot is written beside the result JSON (the same name, .svg; --no-plot: none): the CDF of
each of TTFT, TPOT, ITL and E2EL with its median and p99 (bench/load/loadgen/serve_plot.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.load.loadgen import datasets  # noqa: E402
from bench.load.loadgen.serve_plot import write_serve_svg  # noqa: E402
from bench.load.loadgen.serving import (  # noqa: E402
    METRICS,
    ServeConfig,
    format_report,
    metric_values,
    run_serving,
    serving_metrics,
)

DEFAULT_PORT = 8888  # pdserve's (vLLM's is 8000)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdserve bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    a = p.add_argument
    a("--base-url", help="the server, e.g. http://127.0.0.1:8888 (default: http://--host:--port)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=DEFAULT_PORT)
    a("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    a("--model", help="the served name; default: the first model /v1/models lists")
    a("--tokenizer", help="default: the model's root as /v1/models gives it, else --model")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token; default: $OPENAI_API_KEY")
    a("--header", action="append", default=[], metavar="KEY=VALUE", help="an HTTP header of every request (repeatable)")
    a("--dataset-name", default="random", choices=[*datasets.DATASETS, *datasets.ALIASES])
    a("--dataset-path", type=Path, help="sharegpt: a local ShareGPT-format JSON file")
    a("--num-prompts", type=int, default=1000)
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a("--random-prefix-len", type=int, default=0)
    a("--prefix-repetition-prefix-len", type=int, default=256)
    a("--prefix-repetition-suffix-len", type=int, default=256)
    a("--prefix-repetition-num-prefixes", type=int, default=10)
    a("--prefix-repetition-output-len", type=int, default=128)
    a("--sharegpt-output-len", type=int, help="sharegpt: every output this long instead of its answer's length")
    a("--request-rate", type=float, default=math.inf, help="requests per second; inf (the default): all at once")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier")
    a("--max-concurrency", type=int)
    a("--seed", type=int, default=0)
    a("--ignore-eos", action="store_true", help="answers run to their output length (vLLM's ignore_eos)")
    a("--percentile-metrics", default="ttft,tpot,itl,e2el", help=f"comma list of {','.join(METRICS)}")
    a("--metric-percentiles", default="99", help="comma list of percentiles, e.g. 50,90,99")
    a("--disable-tqdm", action="store_true", help="no progress bar (there is none when stderr is no terminal)")
    a("--save-result", action="store_true", help="write the result JSON, and its plot beside it (.svg)")
    a("--no-plot", action="store_true", help="with --save-result: no .svg")
    a("--result-dir", type=Path, default=Path("."))
    a("--result-filename", help="default: pdserve-{rate}qps[-concurrency{N}]-{model}-{date}.json")
    return p.parse_args(argv)


def headers_of(args: argparse.Namespace) -> dict[str, str]:
    out = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--header {item!r}: KEY=VALUE expected")
        out[key.strip()] = value.strip()
    return out


def get_json(url: str, headers: dict[str, str]) -> Any:
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def served_model(base_url: str, headers: dict[str, str]) -> tuple[str, str | None]:
    """(id, root) of the first model /v1/models lists."""
    try:
        cards = get_json(base_url + "/v1/models", headers)["data"]
    except urllib.error.HTTPError as e:
        raise ValueError(f"GET {base_url}/v1/models answered {e.code}: {e.read()[:200].decode(errors='replace')}") from e
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"GET {base_url}/v1/models: {e}") from e
    if not cards:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return cards[0]["id"], cards[0].get("root")


def sample(args: argparse.Namespace, tokenizer: Any, as_text: bool) -> list[datasets.SampleRequest]:
    name = datasets.ALIASES.get(args.dataset_name, args.dataset_name)
    if name == "random":
        return datasets.random_requests(
            tokenizer, args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
            args.random_prefix_len, args.seed, as_text,
        )  # fmt: skip
    if name == "prefix_repetition":
        return datasets.prefix_repetition_requests(
            tokenizer, args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, args.seed, as_text,
        )  # fmt: skip
    if args.dataset_path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    return datasets.sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len, args.seed)


def result_path(args: argparse.Namespace, cfg: ServeConfig, date: str) -> Path:
    if args.result_filename:
        return args.result_dir / args.result_filename
    concurrency = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency else ""
    model = cfg.model.rstrip("/").split("/")[-1]
    return args.result_dir / f"pdserve-{cfg.request_rate:g}qps{concurrency}-{model}-{date}.json"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    prog = "pdserve bench serve"
    try:
        metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
        unknown = [m for m in metrics if m not in METRICS]
        if unknown:
            raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {','.join(METRICS)}")
        ps = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
        if not all(0 < p < 100 for p in ps):
            raise ValueError(f"--metric-percentiles must be in (0, 100), got {args.metric_percentiles}")
        if args.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
        base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
        headers = headers_of(args)
        model, root = args.model, None
        if model is None:
            model, root = served_model(base_url, headers)
        cfg = ServeConfig(
            base_url + "/" + args.endpoint.lstrip("/"), model, headers, args.request_rate, args.burstiness,
            args.max_concurrency, args.ignore_eos, seed=args.seed,
            show_progress=sys.stderr.isatty() and not args.disable_tqdm,
        )  # fmt: skip
        from pd.frontend.coordinator import load_tokenizer

        tokenizer_id = args.tokenizer or root or model
        try:
            tokenizer = load_tokenizer(tokenizer_id)
        except Exception as e:  # noqa: BLE001 - any failure to load is the flag's
            raise ValueError(f"cannot load the tokenizer {tokenizer_id!r} ({e}): pass --tokenizer") from e
        requests = sample(args, tokenizer, as_text=cfg.is_chat)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(f"{prog}: {len(requests)} prompts ({args.dataset_name}) to {cfg.url}, model {model}", file=sys.stderr)
    result = asyncio.run(run_serving(cfg, requests))
    doc = serving_metrics(result, requests, metrics, ps)
    print(format_report(doc, metrics, ps, cfg))
    errors = sorted({e for e in doc["errors"] if e})
    for e in errors[:5]:
        print(f"error: {e}", file=sys.stderr)
    if args.save_result:
        date = time.strftime("%Y%m%d-%H%M%S")
        meta = {
            "date": date, "endpoint_type": "openai-chat" if cfg.is_chat else "openai", "backend": "pdserve",
            "base_url": base_url, "endpoint": args.endpoint, "model_id": model, "tokenizer_id": tokenizer_id,
            "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
            "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
            "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency, "seed": args.seed,
        }  # fmt: skip
        path = result_path(args, cfg, date)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**meta, **doc}, indent=2) + "\n")
        print(f"{prog}: wrote {path}", file=sys.stderr)
        if not args.no_plot:
            rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
            title = f"{model}, {args.dataset_name}, {doc['completed']} requests at {rate} req/s ({date})"
            svg = write_serve_svg(path.with_suffix(".svg"), metric_values(result), title)
            print(f"{prog}: wrote {svg}", file=sys.stderr)
    return 0 if doc["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
