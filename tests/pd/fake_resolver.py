"""Runs `python -m pd.server ARGS` with its peers' names resolved from a JSON file instead of DNS, so that
a test can change a dns+http://NAME:PORT membership (a --prefill-url's PEs, a router's CEs) of a real
server process while it runs, as Kubernetes changes a headless Service's addresses:

    python -m tests.pd.fake_resolver HOSTS.json pd.server|pd.router.server ARGS...

HOSTS.json: {"NAME": ["127.0.0.2", ...]}, read at every lookup (pd.disagg.membership.resolve, the one
resolver of both hops); a name it lacks fails to resolve, as a lookup that fails (the members are kept)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    hosts_path, module, args = Path(argv[0]), argv[1], argv[2:]
    from pd.disagg import membership

    async def resolve(host: str, port: int) -> list[str]:
        if membership._is_ip(host):
            return [host]
        answers = json.loads(hosts_path.read_text())
        if host not in answers:
            raise OSError(f"cannot resolve {host} ({hosts_path})")
        return sorted(answers[host])

    membership.resolve = resolve  # type: ignore[assignment]
    return int(importlib.import_module(module).main(args))


if __name__ == "__main__":
    from pd.lifecycle import exit_now

    exit_now(main(sys.argv[1:]))
