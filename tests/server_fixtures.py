"""What the server tests share: a module-scoped `python -m pd.server` and the real openai client for a URL."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from openai import OpenAI

from pd.testing import ServerProcess

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
