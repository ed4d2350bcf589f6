"""RMSNorm, plain (w * x / rms) or with a unit offset ((1 + w) * x / rms in float32, then cast), and the
activations the MLPs use. On CUDA the norm is one Triton kernel (pdkernels/fused_ops.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import fused_ops_for


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops_for(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # (x * (1 + w)) in float32, then cast
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.to(x.dtype)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported activation {name!r}")
