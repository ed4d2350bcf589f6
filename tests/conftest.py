from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd.tools.server_process import ServerProcess
from tests.tiny_models import make_tiny

# The servers a test starts (and their engine ranks) wait for work without spinning. The tests run several
# engines at once on few cores (a reference, a PE and a CE, each CPU rank with cores // ranks threads);
# OpenMP's default wait spins a thread that has no work on its core for a while, taking it from the engine
# next to it. Measured on 2 shared cores, tests/pd/disagg/test_pair_gemma.py: 167 and 255 CPU-s (127 s and
# 489 s) spinning, 89 and 81 CPU-s (72 s and 47 s) passive. The numbers do not change: only how an idle
# thread waits. This process's own OpenMP (loaded above, through torch) keeps the default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# What asyncio writes when a task's failure or a coroutine is dropped unseen: a bug in the server, wherever
# it shows (the request it belonged to may well have been answered).
ASYNCIO_COMPLAINTS = ("exception was never retrieved", "destroyed but it is pending", "was never awaited")
_read_upto: dict[Path, int] = {}  # how far each server log has been read


def asyncio_complaints() -> list[str]:
    """The lines of ASYNCIO_COMPLAINTS written to any server log (ServerProcess.log_paths) since the last call."""
    found = []
    for path in sorted(ServerProcess.log_paths):
        if not path.exists():
            continue
        with path.open("rb") as f:
            f.seek(_read_upto.get(path, 0))
            text = f.read()
            _read_upto[path] = f.tell()
        found += [f"{path}: {line}" for line in text.decode(errors="replace").splitlines() if any(c in line for c in ASYNCIO_COMPLAINTS)]
    return found


@pytest.fixture(autouse=True)
def no_asyncio_complaints() -> Iterator[None]:
    """Fails a test during which a server logged an asyncio complaint."""
    yield
    found = asyncio_complaints()
    assert not found, "asyncio complained in a server's log:\n" + "\n".join(found)


@pytest.fixture(scope="session", autouse=True)
def no_asyncio_complaints_at_shutdown() -> Iterator[None]:
    """The same, for what servers logged while they stopped after their last test (module fixtures)."""
    yield
    found = asyncio_complaints()
    assert not found, "asyncio complained in a server's log:\n" + "\n".join(found)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """family -> folder of a tiny random checkpoint (made once per session)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_tiny(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get
