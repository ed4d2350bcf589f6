from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pd.tools.server_process import ServerProcess
from tests.tiny_models import make_tiny

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
