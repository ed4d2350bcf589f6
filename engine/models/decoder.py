"""One decoder-only transformer for Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, gpt-oss, Gemma 3 text and
DeepSeek-V3 checkpoints.

Parameter names follow Hugging Face's, so loading is a direct mapping. forward(input_ids, positions)
reads the step's sequence layout from the forward context (engine/layers/context.py).

In deterministic mode every row-local computation (norms, projections, rotary, MLP, logits) runs
under batch-invariant numerics (engine/layers/numerics.py), so a row's result never depends on how many
rows share the call.

On CUDA, after loading, `fuse_projections()` stacks q/k/v into one `qkv_proj` and gate/up into one
`gate_up_proj` (one matrix-vector product each instead of three and two in a decode step), and the
norms, rotary (with the q/k norms) and SiLU-and-mul run as one Triton kernel each (pdkernels/fused_ops.py).
A decode row's q/k norms and rotary run inside the decode attention kernel instead
(ForwardConfig.decode_rope), and a projection of few rows may take pdkernels/gemv.py
(ForwardConfig.gemv_rows, engine/layers/linear.py). Loading, the KV layout and everything outside the model are unchanged.

A sparse layer's MLP (engine/layers/moe.py) groups tokens by expert, so it is not row-local: it runs outside
`rowwise`, after the row-local attention output and norm, and applies the step's numerics to its own
matmuls.

gpt-oss's attention sinks (`self_attn.sinks`, one logit per query head) travel to every attention path
with the layer's q, k, v (engine/layers/attention.py); None for the other families.

A layer's attention is `Attention` (per-head K and V in the pages) or, for DeepSeek-V3, engine/layers/mla.py's
`LatentAttention` (one latent per token in the pages); both give the layer `qkv` (row-local: everything
attention needs from the normed hidden state, packed in one tensor), `attend` (stores the step's tokens'
KV and attends: [tokens, out_width]) and `o_proj`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.arch import SLIDING, ModelArch
from engine.layers import fp8
from engine.layers.attention import AttnSpec
from engine.layers.context import get_context, rowwise
from engine.layers.linear import fused_ops_for, linear
from engine.layers.mla import LatentAttention
from engine.layers.mlp import MLP
from engine.layers.moe import SparseMoE
from engine.layers.norm import RMSNorm, activation
from engine.layers.numerics import Numerics, run_rows
from engine.layers.rotary import Rotary
from engine.layers.self_attention import Attention
from engine.models.mtp import MTPLayer
from engine.parallel import expert_parallel

if TYPE_CHECKING:  # the kernel module imports triton
    from engine.parallel.tensor_parallel import TensorGroup, TpShard

PROBE_VOCAB_ROWS = 8192


class DecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArch, spec: AttnSpec, is_sparse: bool = False, tp: TensorGroup | None = None
    ) -> None:
        """tp: the tensor-parallel group (arch is then this rank's share: its heads, its intermediate size)."""
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.self_attn: Attention | LatentAttention
        if arch.is_mla:
            self.self_attn = LatentAttention(arch, lambda width: RMSNorm(width, arch.rms_norm_eps, False))
        else:
            self.self_attn = Attention(arch)
        self.is_sparse = is_sparse
        self.mlp: MLP | SparseMoE
        if is_sparse:
            moe = arch.moe
            assert moe is not None
            self.mlp = SparseMoE(
                arch.hidden_size,
                moe.moe_intermediate_size,
                moe.num_experts,
                moe.num_experts_per_tok,
                moe.norm_topk_prob,
                activation(arch.hidden_act),
                expert_parallel.current(),
                routing=moe.routing,
                activation=moe.expert_activation,
                has_bias=moe.has_expert_bias,
                alpha=moe.swiglu_alpha,
                limit=moe.swiglu_limit,
                num_groups=moe.num_expert_groups,
                topk_groups=moe.topk_groups,
                scaling=moe.routed_scaling_factor,
                shared_intermediate_size=moe.shared_intermediate_size,
                tp_share=(tp.rank, tp.size) if tp is not None else (0, 1),
                product=linear,
            )
        else:
            self.mlp = MLP(arch)
        eps, g = arch.rms_norm_eps, arch.unit_offset_norm
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, g)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, g)

    def _pre(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def _add_norm(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, post_attention_layernorm(x + h))."""
        norm = self.post_attention_layernorm
        ops = fused_ops_for(x)
        if ops is not None:
            return ops.add_rms_norm(x, h, norm.weight, norm.eps, norm.unit_offset)
        x = x + h
        return x, norm(x)

    def _post(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """A dense layer's row-local part after attention: the residual adds, the norm and the MLP."""
        x, normed = self._add_norm(x, linear(self.self_attn.o_proj, attn))
        return x + self.mlp(normed)

    def _post_sparse(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """A sparse layer's row-local part after attention: [x + o_proj(attn) | its norm] side by side."""
        return torch.cat(self._add_norm(x, linear(self.self_attn.o_proj, attn)), dim=1)

    def _sparse_mlp(self, normed: torch.Tensor) -> torch.Tensor:
        return self.mlp(normed, get_context().numerics)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = rowwise(self._pre, x, cos, sin)
        attn = self.self_attn.attend(qkv, self.spec, x, cos, sin)
        if self.tp is not None:
            return self._post_tp(x, attn)
        if not self.is_sparse:
            return rowwise(self._post, x, attn)
        x, normed = rowwise(self._post_sparse, x, attn).chunk(2, dim=1)
        return x + self._sparse_mlp(normed)

    def _o_proj(self, attn: torch.Tensor) -> torch.Tensor:
        return linear(self.self_attn.o_proj, attn)

    def _attn_residual(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Row-local: the attention output h added to the residual x, and the MLP's normed input, side by side."""
        return torch.cat(self._add_norm(x, h), dim=1)

    def _mlp_residual(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """The MLP's output m added to the residual x (a layer with an output norm runs it row-local)."""
        return x + m

    def _residual_row_functions(self, hidden: int) -> list[tuple[Callable[..., torch.Tensor], list[int]]]:
        """The row-local functions of _post_tp after the MLP, with their input widths: none here."""
        return []

    def _post_tp(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel rank's layer after its heads' attention: o_proj and down_proj (every routed
        expert's, in a sparse layer) give partial sums, each all-reduced (engine/parallel/tensor_parallel.py);
        everything between them is row-local, or the MoE block's own numerics."""
        tp = self.tp
        assert tp is not None
        is_det = get_context().numerics.is_deterministic
        h = tp.all_reduce(rowwise(self._o_proj, attn), is_det)
        x, normed = rowwise(self._attn_residual, x, h).chunk(2, dim=1)
        if isinstance(self.mlp, SparseMoE) and self.mlp.ep is not None:
            m = self._expert_parallel_mlp(self.mlp, normed, is_det)
        else:
            m = tp.all_reduce(self._sparse_mlp(normed) if self.is_sparse else rowwise(self.mlp, normed), is_det)
        return self._mlp_residual(x, m)

    def _expert_parallel_mlp(self, moe: SparseMoE, normed: torch.Tensor, is_det: bool) -> torch.Tensor:
        """A sparse layer under --tp with --ep (engine/parallel/world.py): each process's routed share of the tokens
        (whole experts, across the expert-parallel group) and its split of the shared experts, both summed
        over the group in one all-reduce, then added as a single rank adds them (routed + shared): the
        routed sum is one value and zeros, so a token's result does not depend on which process had it."""
        tp = self.tp
        assert tp is not None
        numerics = get_context().numerics
        routed = moe.forward_share(normed, numerics)
        if moe.shared_experts is None:
            return tp.all_reduce(routed, is_det)
        shared = run_rows(moe.shared_experts, (normed,), numerics)
        summed_routed, summed_shared = tp.all_reduce(torch.cat([routed, shared], dim=1), is_det).chunk(2, dim=1)
        return summed_routed + summed_shared

    def tp_row_functions(self, hidden: int) -> list[tuple[Callable[..., torch.Tensor], list[int]]]:
        """The row-local functions _post_tp runs, with their input widths (for the probe)."""
        fns: list[tuple[Callable[..., torch.Tensor], list[int]]] = [
            (self._o_proj, [self.self_attn.out_width]),
            (self._attn_residual, [hidden, hidden]),
        ]
        fns += self.mlp.row_functions() if isinstance(self.mlp, SparseMoE) else [(self.mlp, [hidden])]
        return fns + self._residual_row_functions(hidden)

    def forward_chained(
        self, ops: ModuleType, x: torch.Tensor, pending: Pending | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, Pending]:
        """forward() with the residual adds moved into the norms that follow them (CUDA kernels): x is
        the residual stream without the previous layer's MLP output (`pending`: that output, and for
        sandwich norms the output norm it still needs; None for the first layer); returns
        (x + attention, this layer's pending MLP output), whose add the next layer's input norm (or
        the final norm) does. The same roundings as forward(): each add (and each sandwich output norm)
        is rounded to the dtype before it is normed, so the result is bit-identical, with fewer launches."""
        a, norm = self.self_attn, self.input_layernorm
        rows_to = fp8.input_rows_to(getattr(a, "qkv_proj", None), x)  # FP8 qkv: its input quantized in the norm
        if pending is None:
            normed, quantized = ops.rms_norm_quant(x, norm.weight, norm.eps, norm.unit_offset, rows_to)
            normed = fp8.with_quantized(normed, quantized, rows_to)
        else:
            x, normed = pending.add_norm(ops, x, norm, rows_to)
        qkv = rowwise(a.qkv, normed, cos, sin)
        attn = a.attend(qkv, self.spec, x, cos, sin)
        return self._chained_post(ops, x, rowwise(lambda t: linear(a.o_proj, t), attn))

    def _chained_post(self, ops: ModuleType, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, Pending]:
        """forward_chained after the attention's output projection h: (x + h, this layer's pending MLP output)."""
        norm = self.post_attention_layernorm
        if self.is_sparse:
            x, normed = ops.add_rms_norm(x, h, norm.weight, norm.eps, norm.unit_offset)
            return x, Pending(self._sparse_mlp(normed), None)
        rows_to = fp8.input_rows_to(cast(MLP, self.mlp).gate_up_proj, x)
        x, normed, quantized = ops.add_rms_norm_quant(x, h, norm.weight, norm.eps, norm.unit_offset, quant_rows=rows_to)
        return x, Pending(rowwise(self.mlp, fp8.with_quantized(normed, quantized, rows_to)), None)


class Pending:
    """A layer's MLP output not yet added to the residual stream (DecoderLayer.forward_chained), with
    the sandwich output norm it gets first (None without sandwich norms)."""

    def __init__(self, out: torch.Tensor, out_norm: RMSNorm | None) -> None:
        self.out = out
        self.out_norm = out_norm

    def add_norm(
        self, ops: ModuleType, x: torch.Tensor, norm: RMSNorm, rows_to: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + out, norm(x + out)), out passed through out_norm first if any (one kernel); rows_to > 0: the
        norm's output carries its FP8 quantization too (fp8.with_quantized), made in the same pass."""
        w = None if self.out_norm is None else self.out_norm.weight
        x, normed, quantized = ops.add_rms_norm_quant(
            x, self.out, norm.weight, norm.eps, norm.unit_offset, h_weight=w, quant_rows=rows_to
        )
        return x, fp8.with_quantized(normed, quantized, rows_to)


class DecoderStack(nn.Module):
    """Embeddings, layers and the final norm: Hugging Face's `model.` prefix."""

    def __init__(self, arch: ModelArch, tp: TensorGroup | None = None, layer: type[DecoderLayer] | None = None) -> None:
        """layer: the family's decoder layer (DecoderLayer, or a family's variant of it)."""
        super().__init__()
        make_layer = DecoderLayer if layer is None else layer
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        full_i = sliding_i = 0
        layers = []
        for i, t in enumerate(arch.layer_types):
            is_sliding = t == SLIDING
            idx = sliding_i if is_sliding else full_i
            spec = AttnSpec(is_sliding, idx, arch.sliding_window if is_sliding else None, arch.attn_scale)
            layers.append(make_layer(arch, spec, arch.is_sparse(i), tp))
            sliding_i += is_sliding
            full_i += not is_sliding
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.unit_offset_norm)


class CausalLM(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        inv_freqs: dict[str, tuple[torch.Tensor, float]],
        tp: TensorGroup | None = None,
        shard: TpShard | None = None,
        layer: type[DecoderLayer] | None = None,
    ) -> None:
        """tp and shard: a tensor-parallel rank's group and share of the model (engine/parallel/tensor_parallel.py):
        its layers hold their heads and intermediate rows, the LM head its vocabulary rows. layer: the family's
        decoder layer (Family.layer), DecoderLayer if None. arch.num_mtp_layers: the multi-token-prediction
        layers built in `mtp` (engine/models/mtp.py; None without them), which forward() does not run."""
        super().__init__()
        self.tp = tp
        self.vocab_rows = shard.vocab_rows if shard is not None else (0, arch.vocab_size)
        self.vocab_size = arch.vocab_size
        if shard is not None:
            arch = shard.local_arch
        self.arch = arch
        self.model = DecoderStack(arch, tp, layer)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, self.vocab_rows[1] - self.vocab_rows[0], bias=False)
        self.rotary = Rotary(inv_freqs)
        self.mtp: nn.ModuleList | None = None
        if arch.num_mtp_layers:
            if tp is not None or expert_parallel.current() is not None:
                raise ValueError("multi-token-prediction layers are not built under tensor or expert parallelism")
            make_layer = DecoderLayer if layer is None else layer
            self.mtp = nn.ModuleList(
                MTPLayer(arch, j, make_layer, self.model.embed_tokens, self.rotary) for j in range(arch.num_mtp_layers)
            )

    def fuse_projections(self) -> None:
        """Stacks each layer's q/k/v and gate/up weights (after loading: parameter names change)."""
        for layer in [*self.model.layers, *self.mtp_blocks()]:
            layer = cast(DecoderLayer, layer)
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection's weight in the model's dtype (an FP8 lm_head dequantized); a
        tensor-parallel rank's: its vocabulary rows."""
        if self.arch.tie_word_embeddings:
            start, stop = self.vocab_rows
            w = self.model.embed_tokens.weight
            return w if stop - start == w.shape[0] else w[start:stop]
        return fp8.dense_weight(self.lm_head, self.model.embed_tokens.weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final norm, [tokens, hidden]."""
        x = self.model.embed_tokens(input_ids)
        if self.arch.embed_scale:
            x = x * torch.tensor(self.arch.hidden_size**0.5, dtype=x.dtype)
        tables = {t: self.rotary(positions, t) for t in set(self.arch.layer_types)}
        ops = fused_ops_for(x)
        # CUDA: residual adds inside the following norms (DecoderLayer.forward_chained), as the step's
        # ForwardConfig says
        if ops is not None and get_context().config.chain_residuals and self.tp is None:
            pending: Pending | None = None
            for layer, t in zip(self.model.layers, self.arch.layer_types):
                x, pending = cast(DecoderLayer, layer).forward_chained(ops, x, pending, *tables[t])
            norm = self.model.norm
            if pending is None:
                return norm(x)
            return pending.add_norm(ops, x, norm)[1]
        for layer, t in zip(self.model.layers, self.arch.layer_types):
            cos, sin = tables[t]
            x = layer(x, cos, sin)
        return rowwise(self.model.norm, x)

    def mtp_blocks(self) -> list[DecoderLayer]:
        """The multi-token-prediction layers' decoder layers (none without them)."""
        return [cast(DecoderLayer, cast(MTPLayer, m).block) for m in self.mtp] if self.mtp is not None else []

    def sparse_layers(self) -> list[SparseMoE]:
        return [m for m in (cast(DecoderLayer, layer).mlp for layer in self.model.layers) if isinstance(m, SparseMoE)]

    @torch.inference_mode()
    def idle_exchange(self, numerics: Numerics) -> None:
        """An expert-parallel rank with nothing scheduled: its part, with no rows, in every MoE layer's
        exchange of this step (in layer order, as a forward would)."""
        w = self.model.embed_tokens.weight
        for moe in self.sparse_layers():
            moe.idle_exchange(self.arch.hidden_size, w.dtype, w.device, numerics)

    def row_functions(self) -> list[tuple[Callable[..., torch.Tensor], list[int]]]:
        """Every kind of row-local function this model runs, with its input widths (for the probe)."""
        a = self.arch
        fns: list[tuple[Callable[..., torch.Tensor], list[int]]] = []
        kinds = {(t, a.is_sparse(i)): i for i, t in reversed(list(enumerate(a.layer_types)))}  # first layer of each
        for i in sorted(kinds.values()):
            layer = cast(DecoderLayer, self.model.layers[i])
            fns.append((lambda x, c, s, lyr=layer: lyr._pre(x, c, s).flatten(1), [a.hidden_size, a.head_dim, a.head_dim]))
            fns += layer.self_attn.row_functions()
            width = layer.self_attn.out_width
            if self.tp is not None:
                fns += layer.tp_row_functions(a.hidden_size)
            elif isinstance(layer.mlp, SparseMoE):
                fns.append((layer._post_sparse, [a.hidden_size, width]))
                fns += layer.mlp.row_functions()
            else:
                fns.append((layer._post, [a.hidden_size, width]))
        head = self.lm_head_weight[:PROBE_VOCAB_ROWS]  # a slice keeps the probe cheap for 262k vocabularies
        fns.append((self.model.norm, [a.hidden_size]))
        fns.append((lambda h: F.linear(h, head).float(), [a.hidden_size]))
        for mtp in self.mtp or []:  # its block is of a kind above
            fns += cast(MTPLayer, mtp).row_functions(PROBE_VOCAB_ROWS)
        return fns

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits for the given rows. A tensor-parallel group's: a collective, whose rank 0
        gets every vocabulary row's logits and whose other ranks get their own rows' only (unused)."""
        w = self.lm_head_weight
        out = rowwise(lambda h: F.linear(h, w).float(), hidden)
        if self.tp is None:
            return out
        whole = self.tp.gather_vocab(out, self.vocab_size)
        return out if whole is None else whole
