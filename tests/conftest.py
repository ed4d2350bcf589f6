from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import make_tiny


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """family -> folder of a tiny random checkpoint (made once per session)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_tiny(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get
