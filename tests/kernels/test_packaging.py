"""Our top-level `kernels` package must not pass for Hugging Face's kernel hub (`pip install kernels`).

transformers probes `importlib.util.find_spec("kernels")`, which finds ours. What keeps it out: the
installed pdserve metadata lists `kernels` in top_level.txt, so transformers attributes it to the
`pdserve` distribution and reads pdserve's version, which is outside the range it accepts for the hub
package. Without that mapping it would import our package to look for `__version__`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
import transformers
from transformers import LlamaForCausalLM, Gemma3ForCausalLM
import transformers.integrations.hub_kernels
from transformers.utils import import_utils
print(import_utils._is_package_available("kernels", return_version=True))
assert not import_utils.is_kernels_available(), "transformers takes our kernels/ for the kernel hub"
assert "kernels" not in sys.modules, "importing transformers imported our kernels/ package"
"""


@pytest.mark.parametrize("where", ["repo", "elsewhere"])
def test_transformers_ignores_our_kernels_package(where: str, tmp_path: Path) -> None:
    # From the repo root `kernels/` is also on sys.path as a plain directory; elsewhere only the install finds it.
    cwd = REPO if where == "repo" else tmp_path
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
