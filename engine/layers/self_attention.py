"""A layer's per-head attention module: the q/k/v projections (stacked into one qkv_proj on CUDA), optional
q/k norms, rotary, and the paged attention call (engine/layers/attention.py). A decode row's q/k norms and
rotary may run inside the decode attention kernel instead (ForwardConfig.decode_rope). Attention sinks
(`sinks`, one logit per query head, when ModelArch.attn_sinks) travel to every attention path."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.arch import ModelArch
from engine.layers import fp8
from engine.layers.attention import AttnSpec, paged_attention
from engine.layers.context import current_context
from engine.layers.linear import fused_ops_for, linear
from engine.layers.mlp import fuse_linears
from engine.layers.norm import RMSNorm
from engine.layers.rotary import rotate_half

if TYPE_CHECKING:  # the kernel module imports triton
    from pdkernels.decode_attention import Rope


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        d, h, kvh = arch.head_dim, arch.num_heads, arch.num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_proj = nn.Linear(arch.hidden_size, h * d, bias=arch.attention_bias)
        self.k_proj = nn.Linear(arch.hidden_size, kvh * d, bias=arch.attention_bias)
        self.v_proj = nn.Linear(arch.hidden_size, kvh * d, bias=arch.attention_bias)
        self.o_proj = nn.Linear(h * d, arch.hidden_size, bias=arch.o_proj_bias)
        self.sinks: nn.Parameter | None = nn.Parameter(torch.empty(h)) if arch.attn_sinks else None
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps, arch.unit_offset_norm)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps, arch.unit_offset_norm)
        self.has_qk_norm = arch.qk_norm
        self.qkv_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        """q/k/v as one qkv_proj (kept apart where FP8 blocks do not stack: fp8.can_concat)."""
        if not fp8.can_concat([self.q_proj, self.k_proj, self.v_proj]):
            return
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    @property
    def out_width(self) -> int:
        """o_proj's input: every head's value."""
        return self.num_heads * self.head_dim

    def row_functions(self) -> list[tuple[Callable[..., torch.Tensor], list[int]]]:
        """Row-local functions attend() runs besides qkv(): none."""
        return []

    def attend(
        self, qkv: torch.Tensor, spec: AttnSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """qkv()'s output -> [tokens, heads * head_dim]: stores the new K/V and attends (paged_attention); x,
        cos, sin: the layer's input and rotary rows, for the decode rows qkv() left raw (decode_rope)."""
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return paged_attention(q, k, v, spec, self.sinks, self.decode_rope(x, cos, sin)).flatten(1)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Row-local: normed hidden -> q, k, v with rotary applied, packed along the head axis."""
        if self.qkv_proj is not None:
            return self._fused_qkv(h, cos, sin)
        q = self.q_proj(h).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(-1, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return torch.cat([q, k, v], dim=1)

    def _decode_rows_raw(self, x: torch.Tensor) -> int:
        """How many rows (the step's last) leave qkv() unnormed and unrotated, for the decode kernel to do
        (CUDA with fused projections: every decode row; 0 elsewhere)."""
        ctx = current_context()
        dec = ctx.decode if ctx is not None else None
        if ctx is None or dec is None or not ctx.config.decode_rope or self.qkv_proj is None or fused_ops_for(x) is None:
            return 0
        if dec.is_verify:  # every row's key is stored rotated before any row attends
            return 0
        if self.has_qk_norm and ctx.numerics.is_deterministic:
            # NOTE: the kernel sums a row's squares over another tile shape than fused_ops' qk_rope_, so
            # its norms may differ in the last bit (H200, hybrid8b); a verify's rows take qk_rope_, and a
            # deterministic sequence's tokens must not depend on which of the two its step used
            return 0
        return dec.num_rows

    def decode_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Rope | None:
        """The decode kernel's Rope (pdkernels/decode_attention.py) for the rows qkv() left raw, or None."""
        rows = self._decode_rows_raw(x)
        if not rows:
            return None
        from pdkernels.decode_attention import Rope

        if not self.has_qk_norm:
            return Rope(cos[-rows:], sin[-rows:])
        qn, kn = self.q_norm, self.k_norm
        return Rope(cos[-rows:], sin[-rows:], qn.weight, kn.weight, qn.eps, qn.unit_offset)

    def _fused_qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        assert self.qkv_proj is not None
        h_q, h_k = self.num_heads, self.num_kv_heads
        qkv = linear(self.qkv_proj, h).view(-1, h_q + 2 * h_k, self.head_dim)
        ops = fused_ops_for(h)
        if ops is not None:  # one kernel: qk norms and rotary; the decode rows' in the attention kernel
            n = qkv.shape[0] - self._decode_rows_raw(h)
            if n and self.has_qk_norm:
                qn, kn = self.q_norm, self.k_norm
                ops.qk_rope_(qkv[:n, : h_q + h_k], h_q, cos[:n], sin[:n], qn.weight, kn.weight, qn.eps, qn.unit_offset)
            elif n:
                ops.qk_rope_(qkv[:n, : h_q + h_k], h_q, cos[:n], sin[:n])
            return qkv
        if self.has_qk_norm:
            qkv[:, :h_q] = self.q_norm(qkv[:, :h_q])
            qkv[:, h_q : h_q + h_k] = self.k_norm(qkv[:, h_q : h_q + h_k])
        qk = qkv[:, : h_q + h_k]
        qk.copy_(qk * cos[:, None] + rotate_half(qk) * sin[:, None])
        return qkv
