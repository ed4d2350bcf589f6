"""Modules built on the meta device with nothing initialized: the engine's weights come from the checkpoint
(or are drawn at random once they are on their device, engine/models/loader.py), so torch.nn.init's work on empty
meta tensors is skipped, and with it the first use of torch's reference implementations, which imports
torch._dynamo (about a second in every engine process, for nothing)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class _SkipInit(torch.overrides.TorchFunctionMode):
    """torch.nn.init's functions return their tensor untouched."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {}).get("tensor")
        return func(*args, **(kwargs or {}))


def on_meta() -> contextlib.ExitStack:
    """A context that builds modules on the meta device without initializing their (empty) weights."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device("meta"))
    stack.enter_context(_SkipInit())
    return stack
