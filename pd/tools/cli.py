"""`pdserve`: one command for the server, the P/D cluster, the models and the benchmarks.

    pdserve serve MODEL [server flags] [--config FILE.yaml]   python -m pd.server --model MODEL ...
    pdserve pd start|stop|status ...                         deploy/pd_run.sh start|stop|status ...
    pdserve download MODEL [--revision R] [--download-dir D]  python -m engine.checkpoints download MODEL ...
    pdserve router --decode-url URL[,URL...] [flags]         python -m pd.router.server ...
    pdserve models fetch|list|path ...                       python -m engine.checkpoints ...
    pdserve bench load|compare|serve|mooncake ...            bench/load/replay.py, compare.py, serve.py, mooncake.py

Everything after the subcommand goes to the tool it names, unchanged; its exit status is pdserve's.
`pdserve --version` prints the installed version.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

COMMANDS = {
    "serve": "the OpenAI-compatible server (python -m pd.server; `pdserve serve --help`: its flags)",
    "pd": "a P/D cluster across hosts: start|stop|status (deploy/pd_run.sh)",
    "download": "a Hugging Face hub model (ORG/NAME[@REVISION]) into the cache, ahead of `serve` "
    "(python -m engine.checkpoints download)",
    "router": "an HTTP front over the CEs: conversation affinity, failover (python -m pd.router.server)",
    "models": "the model catalogue: fetch|list|path (python -m engine.checkpoints)",
    "bench": "benchmarks against running endpoints: load|compare|serve|mooncake (bench/load/replay.py, "
    "bench/load/compare.py, bench/load/serve.py: vLLM's `vllm bench serve`, bench/load/mooncake.py: a Mooncake trace's "
    "prefix reuse)",
}
BENCHES = {
    "load": "bench.load.replay", "compare": "bench.load.compare", "serve": "bench.load.serve", "mooncake": "bench.load.mooncake",
}  # fmt: skip  # name: module


def _parser() -> argparse.ArgumentParser:
    """For --help and usage errors only: a subcommand parses its own arguments."""
    parser = argparse.ArgumentParser(
        prog="pdserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS.items():
        commands.add_parser(name, help=text)
    return parser


def pd_run_script() -> Path:
    """deploy/pd_run.sh of the checkout the pd package is installed from (pip install -e), else the copy a
    wheel installs under the environment's share/pdserve/deploy (pyproject.toml's data-files)."""
    checkout = Path(__file__).resolve().parents[2] / "deploy" / "pd_run.sh"
    if checkout.is_file():
        return checkout
    return Path(sys.prefix) / "share" / "pdserve" / "deploy" / "pd_run.sh"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; its exit status (`pdserve serve`, `pdserve router` and `pdserve pd` do not return)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["--version"], ["-V"]):
        from pd import __version__

        print(f"pdserve {__version__}")
        return 0
    if not args or args[0] not in COMMANDS:
        _parser().parse_args(args)  # help (exit 0) or a usage error (exit 2)
        return 2
    command, rest = args[0], args[1:]
    if command == "serve":
        from pd import server
        from pd.lifecycle import exit_now

        # as `python -m pd.server`: no interpreter teardown once the ranks are stopped
        exit_now(server.main(rest, prog="pdserve serve", is_model_positional=True))
    if command == "router":
        from pd.lifecycle import exit_now
        from pd.router import server as router

        exit_now(router.main(rest, prog="pdserve router"))
    if command == "pd":
        script = pd_run_script()
        if not script.is_file():
            print(f"pdserve pd: no {script}: reinstall pdserve (or pip install -e a checkout)", file=sys.stderr)
            return 2
        if script.is_relative_to(Path(sys.prefix) / "share"):  # a wheel's copy: its servers run on this interpreter
            os.environ.setdefault("PDSERVE_PYTHON", sys.executable)
        os.execv("/bin/bash", ["bash", str(script), *rest])
    if command in ("models", "download"):
        from engine.checkpoints.__main__ import main as models_main

        if command == "models":
            return models_main(rest, prog="pdserve models")
        return models_main(["download", *rest], prog="pdserve")
    if not rest or rest[0] not in BENCHES:
        is_help = rest[:1] in (["-h"], ["--help"])
        print(
            f"usage: pdserve bench {{{','.join(BENCHES)}}} [flags] (--help after one: its flags)",
            file=sys.stdout if is_help else sys.stderr,
        )
        return 0 if is_help else 2
    # NOTE: imported by name: bench sits above pd in the layers (tests/test_layers.py), and only this
    # entry point reaches up to it
    bench = importlib.import_module(BENCHES[rest[0]])
    sys.argv[0] = f"pdserve bench {rest[0]}"  # the prog its argparse usage shows
    return int(bench.main(rest[1:]))


if __name__ == "__main__":
    sys.exit(main())
