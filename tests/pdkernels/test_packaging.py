"""Our Triton kernels live in `pdkernels`, so the import name `kernels` stays free for Hugging Face's
kernel hub (`pip install kernels`, a dependency of transformers >= 5.25).

transformers probes `importlib.util.find_spec("kernels")` and, where something is found, imports it as
the hub package. When ours was a top-level `kernels/`, that probe found ours (from the repo root as a
plain directory, elsewhere through the editable install) and transformers failed on it. The probe
below checks, from the repo root and from elsewhere, that the name `kernels` does not lead into this
project (neither on sys.path nor in the installed pdserve metadata), and that importing transformers
and its hub integration does not import our kernels.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

repo = Path(sys.argv[1])
spec = importlib.util.find_spec("kernels")
origins = [] if spec is None else [spec.origin, *(spec.submodule_search_locations or [])]
env = Path(sys.prefix).resolve()  # an installed hub package may sit in a venv inside the repo
ours = [o for o in origins if o and repo in Path(o).resolve().parents and env not in Path(o).resolve().parents]
assert not ours, f"`kernels` leads into this project: {ours}"
owners = importlib.metadata.packages_distributions()
assert "pdserve" not in owners.get("kernels", []), "pdserve's installed metadata still lists `kernels`"
assert "pdserve" in owners.get("pdkernels", []), f"pdserve's metadata lacks pdkernels: {owners.get('pdkernels')}"

import transformers
from transformers import LlamaForCausalLM, Gemma3ForCausalLM
import transformers.integrations.hub_kernels
from transformers.utils import import_utils
print(transformers.__version__, import_utils._is_package_available("kernels", return_version=True))
assert "pdkernels" not in sys.modules, "importing transformers imported our pdkernels/ package"
"""


@pytest.mark.parametrize("where", ["repo", "elsewhere"])
def test_kernels_name_is_free_for_the_hub(where: str, tmp_path: Path) -> None:
    # From the repo root the repo is also on sys.path as a plain directory; elsewhere only the install is.
    cwd = REPO if where == "repo" else tmp_path
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(REPO.resolve())], cwd=cwd, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
