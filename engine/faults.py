"""Which failures the engine serves on after. A request's fault (its sampling, its detokenizing, its
prefix copy, a batch's forward) ends that request, or that batch, with finish_reason "error"; a fatal
one ends the process, since what it broke is shared by every request."""

from __future__ import annotations

import torch


def is_fatal(error: BaseException) -> bool:
    """An error the process cannot serve on after: out of device or host memory, a CUDA error (the
    context is likely unusable). The rank exits on these (pd/rank/worker.py sends RankFatal)."""
    if not isinstance(error, Exception) or isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8: CUDA errors
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("CUDA error" in text or "CUBLAS_STATUS" in text or "CUDNN_STATUS" in text)


def raise_if_fatal(error: Exception) -> None:
    """Re-raises a fatal error; the caller's handler goes on to fail only its request(s) otherwise."""
    if is_fatal(error):
        raise error
