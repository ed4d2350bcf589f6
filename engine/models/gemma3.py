"""Gemma 3 (text): RMSNorms that scale by (1 + w) in float32, q/k norms, "sandwich" norms (after attention,
and before and after the MLP: SandwichDecoderLayer), embeddings scaled by sqrt(hidden_size), a GELU-tanh MLP,
the softmax scale query_pre_attn_scalar^-0.5, and sliding and full layers each with its own rope base
(layer_types)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from engine.arch import ModelArch
from engine.layers.attention import AttnSpec
from engine.layers.context import rowwise
from engine.layers.linear import linear
from engine.layers.norm import RMSNorm
from engine.models.decoder import DecoderLayer, Pending
from engine.models.family import Family
from engine.models.hf_config import arch_fields
from engine.parallel.tensor_parallel import TensorGroup


class SandwichDecoderLayer(DecoderLayer):
    """A dense layer whose attention output is normed before its residual add (post_attention_layernorm),
    whose MLP input has its own norm (pre_feedforward_layernorm) and whose MLP output is normed before its
    add (post_feedforward_layernorm):

        x = x + post_attention_layernorm(o_proj(attention(input_layernorm(x))))
        x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    """

    def __init__(self, arch: ModelArch, spec: AttnSpec, is_sparse: bool = False, tp: TensorGroup | None = None) -> None:
        if is_sparse:
            raise ValueError("sparse layers with sandwich norms are not supported")
        super().__init__(arch, spec, is_sparse, tp)
        eps, g = arch.rms_norm_eps, arch.unit_offset_norm
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, g)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, g)

    def _post(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(linear(self.self_attn.o_proj, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def _attn_residual(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[x + post_attention_layernorm(h) | pre_feedforward_layernorm of it] side by side."""
        x = x + self.post_attention_layernorm(h)
        return torch.cat([x, self.pre_feedforward_layernorm(x)], dim=1)

    def _sandwich_mlp(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return x + self.post_feedforward_layernorm(m)

    def _mlp_residual(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return rowwise(self._sandwich_mlp, x, m)

    def _residual_row_functions(self, hidden: int) -> list[tuple[Callable[..., torch.Tensor], list[int]]]:
        return [(self._sandwich_mlp, [hidden, hidden])]

    def _chained_post(self, ops: ModuleType, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, Pending]:
        """x + post_attention_layernorm(h) and its pre_feedforward_layernorm in one kernel; the MLP's output
        pending with the output norm it gets before its add (in the next layer's input norm)."""
        norm = self.input_layernorm  # every norm of the layer has its eps and unit offset
        x, normed = ops.add_rms_norm(x, h, self.pre_feedforward_layernorm.weight, norm.eps, norm.unit_offset,
                                     h_weight=self.post_attention_layernorm.weight)  # fmt: skip
        return x, Pending(rowwise(self.mlp, normed), self.post_feedforward_layernorm)


def arch(hf: Any) -> ModelArch:
    return ModelArch(**arch_fields(
        hf,
        qk_norm=True,
        unit_offset_norm=True,
        embed_scale=True,
        attn_scale=float(hf.query_pre_attn_scalar) ** -0.5,
    ))  # fmt: skip


FAMILY = Family("gemma3_text", arch, layer=SandwichDecoderLayer)
