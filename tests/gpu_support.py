"""What the Triton kernel tests share: where they run and the skip that guards them.

On CUDA they test in bf16. With TRITON_INTERPRET=1 (and triton installed) they run on the CPU under
Triton's interpreter in float32, slowly: how the kernels are debugged without a GPU. CI has neither
triton nor a GPU, and skips them."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def require_triton() -> None:
    """Skips the calling test module without triton, or without a CUDA GPU unless TRITON_INTERPRET=1.
    NOTE: call it at import, before importing a kernel (the kernel modules import triton)."""
    pytest.importorskip("triton")
    if not (torch.cuda.is_available() or INTERPRET):
        pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)
