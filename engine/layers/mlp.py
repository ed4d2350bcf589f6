"""The dense gated MLP: down(act(gate(x)) * up(x)); on CUDA gate and up stacked into one gate_up_proj, and
the activation fused into the down projection's input (pdkernels/fused_ops.py). fuse_linears stacks
linears (plain or FP8) side by side."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.arch import ModelArch
from engine.layers import fp8
from engine.layers.linear import fused_ops_for, linear
from engine.layers.meta import on_meta
from engine.layers.norm import activation


def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the given linears' outputs side by side (fp8.can_concat must hold)."""
    if isinstance(linears[0], fp8.Fp8Linear):
        return fp8.concat(linears)
    has_bias = linears[0].bias is not None
    out_features = sum(lin.out_features for lin in linears)
    with on_meta():
        fused = nn.Linear(linears[0].in_features, out_features, bias=has_bias)
    fused.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]), requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([cast(torch.Tensor, lin.bias) for lin in linears]), requires_grad=False)
    return fused


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        act = arch.hidden_act
        self.act = activation(act)
        self.is_silu = act == "silu"
        self.fused_act = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act)
        self.gate_up_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        """gate/up as one gate_up_proj (kept apart where FP8 blocks do not stack: fp8.can_concat)."""
        if not fp8.can_concat([self.gate_proj, self.up_proj]):
            return
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(self.gate_up_proj, x)
        if fused_ops_for(x) is not None and self.fused_act is not None:
            return linear(self.down_proj, gate_up, act=self.fused_act)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
