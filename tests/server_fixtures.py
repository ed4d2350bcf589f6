"""What the server tests share: a module-scoped `python -m pd.server` and the real openai client for a URL."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import re
import socket
import urllib.request
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from openai import OpenAI

from pd.tools.server_process import PDPair, ServerProcess, wait_idle

T = TypeVar("T")

# A small deterministic server: what the identity tests (single engine and P/D pairs) run with.
SMALL_DETERMINISTIC = (
    "--deterministic",
    "--max-model-len",
    "2048",
    "--kv-cache-gb",
    "0.25",
    "--max-num-seqs",
    "32",
)


def module_server(*args: str) -> Callable[..., Iterator[ServerProcess]]:
    """A fixture named `server` for the module: one server with these flags, stopped after the module."""

    @pytest.fixture(scope="module")
    def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
        with ServerProcess(*args, log_path=tmp_path_factory.mktemp("server") / "server.log") as s:
            yield s

    return server


def openai_client(url: str, timeout_s: float = 600) -> OpenAI:
    """No retries: a test sees every error the server gives."""
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)


@contextlib.contextmanager
def serving(*servers: ServerProcess | PDPair) -> Iterator[None]:
    """Starts the servers side by side (they load at once), waits for each; ends them all on exit."""
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        yield
    finally:
        for s in servers:
            s.terminate()
        for s in servers:
            s.stop()


def skip_unless_bindable(*hosts: str) -> None:
    """Skips the test (or fixture) unless each loopback "host" (127.0.0.x) can be bound here."""
    missing = []
    for host in hosts:
        try:
            with socket.socket() as s:
                s.bind((host, 0))
        except OSError:
            missing.append(host)
    if missing:
        pytest.skip(f"cannot bind {', '.join(missing)}: this machine's loopback is only 127.0.0.1")


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of name's samples at url/metrics whose labels include these."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def at_once(*calls: Callable[[], T]) -> list[T]:
    """Each call's result, the calls run at once (requests to --deterministic servers: sharing batches
    changes no token)."""
    with cf.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def story_prompts(n: int) -> list[str]:
    """n short prompts whose greedy answers differ."""
    return [f"Story {i}: the cat and the {'dog ' * (1 + i % 4)}" for i in range(n)]


def greedy_completions(url: str, model: str, prompts: list[str], concurrency: int) -> list[tuple[str, list[float]]]:
    """Each prompt's 16 greedy tokens and their logprobs, `concurrency` requests at a time."""
    client = openai_client(url)

    def one(prompt: str) -> tuple[str, list[float]]:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=1)
        assert r.choices[0].logprobs is not None
        return r.choices[0].text, list(r.choices[0].logprobs.token_logprobs or [])

    with cf.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def module_ref_and_pair(
    *args: str, pe_args: tuple[str, ...] = ()
) -> Callable[..., Iterator[tuple[ServerProcess, PDPair]]]:
    """A fixture named `servers` for the module: a single-engine reference server and a P/D pair with the
    same flags (pe_args: the PE's own, after them), started side by side, stopped after the module."""

    @pytest.fixture(scope="module")
    def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, PDPair]]:
        logs = tmp_path_factory.mktemp("pd")
        ref = ServerProcess(*args, log_path=logs / "ref.log")
        pair = PDPair(*args, log_dir=logs, pe_args=pe_args)
        with serving(ref, pair):
            yield ref, pair

    return servers


def run_check_pd(ref: ServerProcess, pair: PDPair, *args: str) -> int:
    """bench/check_pd.py's exit code, reference against pair, 8 tokens a request."""
    from bench import check_pd

    return int(check_pd.main(["--ref", ref.url, "--pd", pair.url, "--max-tokens", "8", *args]))


def wait_pair_idle(pair: PDPair) -> None:
    wait_idle(pair.ce.port, timeout_s=60)
    wait_idle(pair.pe.port, timeout_s=60)
