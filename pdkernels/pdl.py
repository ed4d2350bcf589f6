"""Programmatic dependent launch (PDL; Hopper and later) for the forward's Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still running. Its
programs first wait (griddepcontrol.wait: every earlier kernel done, its writes visible) before they
read anything a kernel wrote or write anything themselves, then let the next kernel launch
(griddepcontrol.launch_dependents). Only constant data (weights) may be read before the wait. What it
hides is each kernel boundary's launch, ramp and the previous kernel's tail: about 1-3 us, several
hundred times in a batch-1 decode step of an 8B model. CUDA graphs keep it: stream capture records
the launch attribute as a programmatic edge.

`scope(on)` (entered by engine/layers/context.py's forward_context from ForwardConfig.pdl) sets whether the
kernels launched inside it use PDL; `active()` is what a kernel wrapper passes as its PDL flag. This
module imports no Triton: the engine asks it on machines without one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

_active = False


def active() -> bool:
    """Whether kernels launched now use PDL."""
    return _active


@cache
def supported(device: torch.device) -> bool:
    """PDL needs a CUDA device of compute capability 9.0 or later, and compiled kernels (not the interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@contextmanager
def scope(on: bool) -> Iterator[None]:
    global _active
    before, _active = _active, on
    try:
        yield
    finally:
        _active = before
