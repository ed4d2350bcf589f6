"""`python -m engine.checkpoints fetch NAME [NAME...] | list | path NAME | download MODEL [--revision R]
[--download-dir DIR]`."""

from __future__ import annotations

import argparse
import sys

from engine.checkpoints import CATALOG, fetch, models_home, resolve_model
from engine.checkpoints.store import is_converted
from engine.errors import ModelNotFoundError


def main(argv: list[str] | None = None, prog: str = "python -m engine.checkpoints") -> int:
    """Runs one subcommand; returns the process exit status. prog: the command shown in usage lines."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_cmd = commands.add_parser("fetch", help="install and convert catalogue models (once)")
    fetch_cmd.add_argument("names", nargs="+", metavar="NAME")
    commands.add_parser("list", help="catalogue models, and whether each is converted")
    path_cmd = commands.add_parser("path", help="print a model's folder, converting it first if needed")
    path_cmd.add_argument("name", metavar="NAME")
    download_cmd = commands.add_parser(
        "download",
        help="a hub model (ORG/NAME[@REVISION]) into huggingface_hub's cache, only the files the engine reads, "
        "then its folder on stdout (a catalogue name is fetched, a local folder printed)",
    )
    download_cmd.add_argument("model", metavar="MODEL")
    download_cmd.add_argument("--revision", default=None, help="a branch, tag or commit; default: main")
    download_cmd.add_argument(
        "--download-dir", default=None, help="the huggingface_hub cache to use; default: $HF_HUB_CACHE"
    )
    args = parser.parse_args(argv)

    if args.command == "download":
        try:
            print(resolve_model(args.model, args.revision, args.download_dir))
        except ModelNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "list":
        for spec in CATALOG.values():
            state = "converted" if is_converted(models_home() / spec.name) else "not fetched"
            print(f"{spec.name:<24} {state:<12} {spec.description}")
        return 0
    names = args.names if args.command == "fetch" else [args.name]
    unknown = [name for name in names if name not in CATALOG]
    if unknown:
        print(f"error: unknown model(s) {', '.join(unknown)}; known: {', '.join(CATALOG)}", file=sys.stderr)
        return 2
    for name in names:
        folder = fetch(name, quiet=args.command == "path")
    if args.command == "path":
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
