"""Which failures the engine serves on after. A request's fault (its sampling, its grammar, its
detokenizing, its prefix copy, a batch's forward) ends that request, or that batch, with finish_reason
"error"; a fatal one ends the process, since what it broke is shared by every request.

Fatal is decided by the exception's type alone, never by its message: messages carry text a client
chose (a grammar library quotes the request's grammar in its errors), and a client must not be able
to end a rank by writing "CUDA error" into a regex."""

from __future__ import annotations

import torch

# torch raises CUDA (and other accelerator) errors as torch.AcceleratorError from 2.8 on: the reason
# pyproject.toml asks for torch>=2.8.
FATAL_TYPES: tuple[type[BaseException], ...] = (MemoryError, torch.cuda.OutOfMemoryError, torch.AcceleratorError)


def is_fatal(error: BaseException) -> bool:
    """An error the process cannot serve on after: out of device or host memory, an accelerator error
    (the CUDA context is likely unusable), or no Exception at all (KeyboardInterrupt, SystemExit). The
    rank exits on these (pd/rank/worker.py sends RankFatal)."""
    return not isinstance(error, Exception) or isinstance(error, FATAL_TYPES)


def raise_if_fatal(error: Exception) -> None:
    """Re-raises a fatal error; the caller's handler goes on to fail only its request(s) otherwise."""
    if is_fatal(error):
        raise error
