"""One decoder-only transformer for Llama, Mistral, Qwen2, Qwen3 and Gemma 3 text checkpoints.

Parameter names follow Hugging Face's, so loading is a direct mapping. forward(input_ids, positions)
reads the step's sequence layout from the forward context (engine/context.py).

In deterministic mode every row-local computation (norms, projections, rotary, MLP, logits) runs
under batch-invariant numerics (engine/numerics.py), so a row's result never depends on how many
rows share the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttnSpec, paged_attention
from engine.context import get_context
from engine.model_config import SLIDING, ModelArch
from engine.numerics import run_rows

PROBE_VOCAB_ROWS = 8192


def rowwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """fn(*xs) for a row-local fn, under the step's numerics."""
    return run_rows(fn, xs, get_context().numerics)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, is_gemma: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.is_gemma = is_gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.is_gemma:  # (x * (1 + w)) in float32, then cast, as Gemma 3 does
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        d, h, kvh = arch.head_dim, arch.num_heads, arch.num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_proj = nn.Linear(arch.hidden_size, h * d, bias=arch.attention_bias)
        self.k_proj = nn.Linear(arch.hidden_size, kvh * d, bias=arch.attention_bias)
        self.v_proj = nn.Linear(arch.hidden_size, kvh * d, bias=arch.attention_bias)
        self.o_proj = nn.Linear(h * d, arch.hidden_size, bias=False)
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps, arch.gemma_norm)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps, arch.gemma_norm)
        self.has_qk_norm = arch.qk_norm

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Row-local: normed hidden -> q, k, v with rotary applied, packed along the head axis."""
        q = self.q_proj(h).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(-1, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return torch.cat([q, k, v], dim=1)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        act = arch.hidden_act
        if act in ("gelu_pytorch_tanh", "gelu_tanh"):
            self.act: Callable[[torch.Tensor], torch.Tensor] = lambda x: F.gelu(x, approximate="tanh")
        elif act == "gelu":
            self.act = F.gelu
        elif act == "silu":
            self.act = F.silu
        else:
            raise ValueError(f"unsupported activation {act!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, spec: AttnSpec) -> None:
        super().__init__()
        self.spec = spec
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        eps, g = arch.rms_norm_eps, arch.gemma_norm
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, g)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, g)
        self.is_sandwich = arch.sandwich_norm
        if arch.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, g)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, g)

    def _pre(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def _post(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = self.self_attn.o_proj(attn)
        if self.is_sandwich:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        qkv = rowwise(self._pre, x, cos, sin)
        q, k, v = qkv.split([a.num_heads, a.num_kv_heads, a.num_kv_heads], dim=1)
        attn = paged_attention(q, k, v, self.spec)
        return rowwise(self._post, x, attn.flatten(1))


class Rotary(nn.Module):
    """cos/sin tables per layer type for every position, computed once in float32 then cast as
    transformers does; a step gathers its rows (a gather is exact, so no row depends on the batch)."""

    def __init__(self, inv_freqs: dict[str, tuple[torch.Tensor, float]]) -> None:
        super().__init__()
        self.inv_freqs = inv_freqs
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def build(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(max_positions, device=device).float()
        for t, (inv, scale) in self.inv_freqs.items():
            freqs = positions[:, None] * inv.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.tables[t] = ((emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype))

    def forward(self, positions: torch.Tensor, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables[layer_type]
        return cos[positions], sin[positions]


class DecoderStack(nn.Module):
    """Embeddings, layers and the final norm: Hugging Face's `model.` prefix."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        full_i = sliding_i = 0
        layers = []
        for t in arch.layer_types:
            is_sliding = t == SLIDING
            idx = sliding_i if is_sliding else full_i
            spec = AttnSpec(is_sliding, idx, arch.sliding_window if is_sliding else None, arch.attn_scale)
            layers.append(DecoderLayer(arch, spec))
            sliding_i += is_sliding
            full_i += not is_sliding
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.gemma_norm)


class CausalLM(nn.Module):
    def __init__(self, arch: ModelArch, inv_freqs: dict[str, tuple[torch.Tensor, float]]) -> None:
        super().__init__()
        self.arch = arch
        self.model = DecoderStack(arch)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary = Rotary(inv_freqs)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.arch.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final norm, [tokens, hidden]."""
        x = self.model.embed_tokens(input_ids)
        if self.arch.embed_scale:
            x = x * torch.tensor(self.arch.hidden_size**0.5, dtype=x.dtype)
        tables = {t: self.rotary(positions, t) for t in set(self.arch.layer_types)}
        for layer, t in zip(self.model.layers, self.arch.layer_types):
            cos, sin = tables[t]
            x = layer(x, cos, sin)
        return rowwise(self.model.norm, x)

    def row_functions(self) -> list[tuple[Callable[..., torch.Tensor], list[int]]]:
        """Every kind of row-local function this model runs, with its input widths (for the probe)."""
        a = self.arch
        fns: list[tuple[Callable[..., torch.Tensor], list[int]]] = []
        for t in sorted(set(a.layer_types)):
            layer = cast(DecoderLayer, self.model.layers[a.layer_types.index(t)])
            fns.append((lambda x, c, s, lyr=layer: lyr._pre(x, c, s).flatten(1), [a.hidden_size, a.head_dim, a.head_dim]))
            fns.append((layer._post, [a.hidden_size, a.num_heads * a.head_dim]))
        head = self.lm_head_weight[:PROBE_VOCAB_ROWS]  # a slice keeps the probe cheap for 262k vocabularies
        fns.append((self.model.norm, [a.hidden_size]))
        fns.append((lambda h: F.linear(h, head).float(), [a.hidden_size]))
        return fns

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits for the given rows."""
        w = self.lm_head_weight
        return rowwise(lambda h: F.linear(h, w).float(), hidden)
