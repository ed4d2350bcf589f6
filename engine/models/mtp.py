"""Multi-token prediction (MTP): a checkpoint's next-token-prediction layers (DeepSeek-V3's
num_nextn_predict_layers), which draft tokens for speculative decoding from the model's own hidden states.

MTP layer j is `model.layers.{N + j}` in the checkpoint (N = num_hidden_layers) and `CausalLM.mtp[j]` in the
model, built when build_model is asked for it (engine/models/loader.py, ModelArch.num_mtp_layers):

    checkpoint (model.layers.{N + j}.)             model
    embed_tokens.weight                            model.embed_tokens.weight (shared; the copy checked equal)
    enorm, hnorm, eh_proj, shared_head.{norm,head} mtp.{j}.enorm, .hnorm, .eh_proj, .shared_head.{norm,head}
    self_attn.*, mlp.*, input_layernorm, ...       mtp.{j}.block.self_attn.*, .block.mlp.*, ...

At position i, from the target model's hidden state h_i (CausalLM.forward's output, after the final norm) and
the next token x_{i+1}:

    e      = embed(x_{i+1}), zero at position 0
    x      = eh_proj(| enorm(e) | hnorm(h_i) |)        the embedding first: the released weights' order
    out    = block(x)                                 the family's decoder layer: attention over the
                                                      sequence's MTP positions so far, the MLP, residuals
    logits = shared_head.head(shared_head.norm(out))  a prediction of x_{i+2}

Chained drafting (k > 1) feeds out back as the next position's h, with the drafted token as its input.

The block's KV is one more full layer of the pool's pages (cache index ModelArch.mtp_cache_index(j), after
the model's own: engine/core/kv_cache.py), under the sequence's block table: MTP position i is stored at
the sequence's position i. Its MLP is routed experts where the model's last layer's is (DeepSeek-V3: every
layer from first_k_dense_replace on is sparse, and N + j is past them all); that MoE is not among
CausalLM.sparse_layers() (expert counters, rebalancing and expert-parallel exchanges are the target's).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.arch import FULL, ModelArch
from engine.layers import fp8
from engine.layers.attention import AttnSpec
from engine.layers.context import rowwise
from engine.layers.linear import linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rotary

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
_OWN = ("enorm", "hnorm", "eh_proj", "shared_head")  # the MTP layer's own modules; the rest is its block's
EMBEDDING = "model.embed_tokens.weight"  # the model's embedding, which every MTP layer shares


class SharedHead(nn.Module):
    """The MTP layer's output norm and vocabulary projection (`shared_head.norm`, `shared_head.head`)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.unit_offset_norm)
        self.head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)


class MTPLayer(nn.Module):
    """One multi-token-prediction layer (the module docstring). Runs inside the step's forward_context like
    any layer: its block's attention stores the step's MTP positions' KV and attends over the chunks'
    sequences through ctx.chunks (and, on CUDA, ctx.decode's rows), as the target's layers do."""

    def __init__(
        self,
        arch: ModelArch,
        j: int,
        layer: Callable[[ModelArch, AttnSpec, bool], nn.Module],
        embed_tokens: nn.Embedding,
        rotary: Rotary,
    ) -> None:
        """layer: the family's decoder layer class (engine/models/decoder.py, which imports this module); embed_tokens, rotary: the model's own (shared modules:
        named_parameters lists the embedding once, as model.embed_tokens.weight)."""
        super().__init__()
        self.index = j
        self.embed_tokens = embed_tokens
        self.rotary = rotary
        eps, g, hidden = arch.rms_norm_eps, arch.unit_offset_norm, arch.hidden_size
        self.enorm = RMSNorm(hidden, eps, g)
        self.hnorm = RMSNorm(hidden, eps, g)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        spec = AttnSpec(False, arch.mtp_cache_index(j), None, arch.attn_scale)
        self.block = layer(arch, spec, arch.is_sparse(arch.num_layers - 1))
        self.shared_head = SharedHead(arch)

    def _project(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Row-local: eh_proj(| enorm(e) | hnorm(h) |), [tokens, hidden]."""
        return linear(self.eh_proj, torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """The MTP positions' output hidden states [tokens, hidden] (the residual stream after the block's MLP):
        row r is position positions[r] of its chunk's sequence, input_ids[r] the token after it (x_{i+1}),
        prev_hidden[r] the target's final-normed hidden state there (h_i), or for a chained draft this layer's
        own output at the position before. Rows and chunks as the forward context lays them out."""
        e = self.embed_tokens(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        x = rowwise(self._project, e, prev_hidden)
        cos, sin = self.rotary(positions, FULL)
        return self.block(x, cos, sin)

    def head_weight(self) -> torch.Tensor:
        """shared_head.head's weight in the model's dtype (an FP8 one dequantized)."""
        return fp8.dense_weight(self.shared_head.head, self.enorm.weight.dtype)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """float32 logits [tokens, vocab] of forward's output rows: each row's prediction of x_{i+2}."""
        w = self.head_weight()
        return rowwise(lambda h: F.linear(self.shared_head.norm(h), w).float(), out)

    def row_functions(self, vocab_rows: int) -> list[tuple[Callable[..., torch.Tensor], list[int]]]:
        """The row-local functions of this layer that its block does not share with the model's layers, with
        their input widths (for the numerics probe); the head's first vocab_rows rows only."""
        hidden = self.enorm.weight.shape[0]
        head = self.head_weight()[:vocab_rows]
        return [
            (self._project, [hidden, hidden]),
            (lambda h: F.linear(self.shared_head.norm(h), head).float(), [hidden]),
        ]


def model_name(arch: ModelArch, key: str) -> str | None:
    """The model's name for checkpoint tensor `key` of a built MTP layer (the module docstring's table); None
    for a tensor of any other layer, or of an MTP layer not built."""
    match = _LAYER_KEY.match(key)
    if match is None:
        return None
    j = int(match.group(1)) - arch.num_layers
    if not 0 <= j < arch.num_mtp_layers:
        return None
    rest = key[match.end() :]
    top = rest.split(".", 1)[0]
    if top == "embed_tokens":
        return EMBEDDING
    return f"mtp.{j}.{rest}" if top in _OWN else f"mtp.{j}.block.{rest}"


def checkpoint_name(arch: ModelArch, name: str) -> str:
    """The checkpoint's name for a model tensor or module name (model_name's inverse for the MTP layers'
    own names; any other name unchanged)."""
    if not name.startswith("mtp."):
        return name
    _, j, rest = name.split(".", 2)
    rest = rest.removeprefix("block.")
    return f"model.layers.{arch.num_layers + int(j)}.{rest}"
