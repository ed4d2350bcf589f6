"""Multi-head latent attention (MLA: DeepSeek-V3, transformers' DeepseekV3Attention) over the paged pool.

A token keeps one latent per layer in the pages (KVLayout.page_kind "latent", engine/core/kv_cache.py):

    latent = | c_kv = kv_a_layernorm(kv_a_proj_with_mqa(h)[:R]) | k_rot = rope(kv_a_proj_with_mqa(h)[R:]) |
               R = kv_lora_rank                                   Dr = qk_rope_head_dim

Every head's key and value come from it through kv_b_proj ([H * (Dn + Dv), R]; Dn = qk_nope_head_dim,
Dv = v_head_dim), W_UK[h] its rows [h * (Dn + Dv), h * (Dn + Dv) + Dn), W_UV[h] the Dv rows after them:

    k_h = | W_UK[h] c_kv | k_rot |      v_h = W_UV[h] c_kv      (k_rot shared by every head)

Two ways to attend, equal up to rounding:

    expanded  the chunk's visible latents made per-head K [L, H, Dn + Dr] and V [L, H, Dv], plain attention
    absorbed  W_UK folded into the query and W_UV into the output (as SGLang and vLLM decode): the query
              | W_UK[h]^T q_nope_h | q_rot_h | (R + Dr wide) against the latents themselves, one key shared by
              every head (MQA), values c_kv; the head's R-wide result o_h becomes W_UV[h] o_h

Expanding costs about H R (Dn + Dv) multiply-adds per visible key once per chunk, plus n H (Dn + Dr + Dv) for
its n queries; absorbing n H (2 R + Dr). Default mode takes the cheaper per chunk (`absorbs`): decode rows
and short chunks read only the latent (DeepSeek-V3's shape: chunks under 171 queries), long prefill chunks
expand. Deterministic mode absorbs every chunk, so a row's arithmetic never depends on its chunk's size: the
row-local products (projections, norms, rotary, absorbing and un-absorbing) run under the step's numerics
(engine/layers/numerics.py), the attention in tiled_attend (engine/layers/attention.py), as for the other families.

Rotary: DeepSeek pairs its rotary dims as (0, 1), (2, 3), ... (config.rope_interleave, true in its
releases); transformers rotates each pair and writes the pairs' first elements, then their second ones (a
de-interleaved order, the same for q and k, so q.k is unchanged). This module does the same, so the cached
k_rot is in that order, as transformers' cache holds it.

On CUDA a step's decode rows (the last rows, ctx.decode: engine/layers/decode.py) go through pdkernels/mla_decode.py:
their latents stored through their block tables, the query absorbed, the paged latent kernel, the output
un-absorbed; device tensors only, so CUDA graphs capture the step. Prompt chunks run this module's torch code
everywhere (they never take the Triton prefill kernel).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.arch import ModelArch
from engine.layers import fp8
from engine.layers.attention import AttnSpec, tiled_attend
from engine.layers.context import ForwardContext, SeqChunk, current_context, get_context
from engine.layers.numerics import Numerics, run_rows


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_interleaved: bool) -> torch.Tensor:
    """x [tokens, heads, Dr] rotated by cos/sin [tokens, Dr] (cat(freqs, freqs), as engine/models/decoder.py's Rotary
    builds them), in transformers' order of operations: halves (rotate_half), or interleaved pairs written
    de-interleaved (apply_rotary_pos_emb_interleave)."""
    if is_interleaved:
        half = cos.shape[-1] // 2
        c, s = cos[:, None, :half], sin[:, None, :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def per_head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, heads, a] by w [heads, a, b] -> [n, heads, b]: head h's rows times w[h]. Row-local. Under
    BATCH_INVARIANT (CUDA deterministic) one 2-D product per head, which that mode routes through its
    batch-invariant matmul (it refuses batched products)."""
    ctx = current_context()
    if ctx is not None and ctx.numerics is Numerics.BATCH_INVARIANT:
        return torch.stack([x[:, h] @ w[h].contiguous() for h in range(w.shape[0])], dim=1)
    return torch.matmul(x.transpose(0, 1), w).transpose(0, 1)


class LatentAttention(nn.Module):
    """DeepSeek-V3's attention under Hugging Face's names (q_proj, or q_a_proj / q_a_layernorm / q_b_proj;
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj). make_norm(width): the model's RMSNorm."""

    sinks = None  # no attention sinks

    def __init__(self, arch: ModelArch, make_norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        h, hidden, bias, m = arch.num_heads, arch.hidden_size, arch.attention_bias, arch.mla
        assert m is not None
        self.num_heads = h
        self.kv_lora_rank, self.q_lora_rank = m.kv_lora_rank, m.q_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = (
            m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        )  # fmt: skip
        self.qk_head_dim = m.qk_head_dim
        self.is_interleaved = m.rope_interleave
        self.scale = arch.attn_scale
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = make_norm(m.q_lora_rank)
            self.q_b_proj = nn.Linear(m.q_lora_rank, h * self.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, h * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = make_norm(m.kv_lora_rank)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * m.v_head_dim, hidden, bias=bias)

    @property
    def out_width(self) -> int:
        """o_proj's input: every head's value."""
        return self.num_heads * self.v_head_dim

    def fuse_projections(self) -> None:
        """After loading (CausalLM.fuse_projections calls every attention): an FP8 kv_b_proj dequantized once
        into the model's dtype. Absorbing, un-absorbing and expanding read W_UK and W_UV whole as slices of
        it, so an FP8 copy would be dequantized twice a layer every step (as vLLM and SGLang, the float
        copy is made at load)."""
        if isinstance(self.kv_b_proj, fp8.Fp8Linear):
            self.kv_b_proj = fp8.dequantized(self.kv_b_proj, self._model_dtype())

    def _model_dtype(self) -> torch.dtype:
        norm_weight = self.kv_a_layernorm.weight  # in the model dtype whatever kv_b_proj holds
        assert isinstance(norm_weight, torch.Tensor)
        return norm_weight.dtype

    # ---- row-local parts ---------------------------------------------------------------------------

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Row-local: normed hidden [tokens, hidden] -> [tokens, H * (Dn + Dr) + R + Dr]: every head's query
        (its rotary part rotated), then the token's latent (c_kv normed, k_rot rotated)."""
        num_heads, dn, rank = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        else:
            q = self.q_proj(h)
        q = q.view(-1, num_heads, self.qk_head_dim)
        compressed = self.kv_a_proj_with_mqa(h)
        c_kv = self.kv_a_layernorm(compressed[:, :rank].contiguous())
        q_rot = rope(q[..., dn:], cos, sin, self.is_interleaved)
        k_rot = rope(compressed[:, None, rank:], cos, sin, self.is_interleaved)
        return torch.cat([torch.cat([q[..., :dn], q_rot], dim=-1).flatten(1), c_kv, k_rot.flatten(1)], dim=1)

    def _kv_b_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """kv_b_proj's weight [H * (Dn + Dv), R] in dtype (default: the model's; an FP8 one dequantized: on
        CUDA it was at load, fuse_projections)."""
        return fp8.dense_weight(self.kv_b_proj, dtype or self._model_dtype())

    def _kv_b(self) -> torch.Tensor:
        """kv_b_proj's weight per head: [H, Dn + Dv, R] (W_UK rows, then W_UV rows)."""
        return self._kv_b_weight().view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """Row-local: [n, H * Dn] -> [n, H * R], head h's q_nope through W_UK[h]^T (a latent-space query)."""
        w_uk = self._kv_b()[:, : self.qk_nope_head_dim]  # [H, Dn, R]
        return per_head_matmul(q_nope.view(-1, self.num_heads, self.qk_nope_head_dim), w_uk).flatten(1)

    def expand_output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Row-local: [n, H * R] -> [n, H * Dv], head h's latent-space output through W_UV[h]."""
        w_uv = self._kv_b()[:, self.qk_nope_head_dim :].transpose(1, 2)  # [H, R, Dv]
        return per_head_matmul(o_latent.view(-1, self.num_heads, self.kv_lora_rank), w_uv).flatten(1)

    def row_functions(self) -> list[tuple[Callable[..., torch.Tensor], list[int]]]:
        """The row-local functions attend() runs under the step's numerics, with their input widths."""
        return [
            (self.absorb_query, [self.num_heads * self.qk_nope_head_dim]),
            (self.expand_output, [self.num_heads * self.kv_lora_rank]),
        ]

    # ---- attention ----------------------------------------------------------------------------------

    def absorbs(self, num_queries: int, numerics: Numerics) -> bool:
        """Whether a chunk of num_queries attends in latent space (the module docstring's cost rule;
        always in deterministic mode)."""
        if numerics.is_deterministic:
            return True
        rank, dn, dr, dv = self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        return num_queries * (2 * rank + dr - (dn + dr + dv)) < rank * (dn + dv)

    def attend(
        self, packed: torch.Tensor, spec: AttnSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """qkv()'s output for the step's tokens -> [tokens, H * Dv]: stores each token's latent in its page,
        then attends every chunk over its sequence's latents [0, end). (x, cos, sin: unused here, the
        signature engine/models/decoder.py's Attention.attend shares.)"""
        ctx = get_context()
        num_heads, dq = self.num_heads, self.qk_head_dim
        q = packed[:, : num_heads * dq].view(-1, num_heads, dq)
        latents = packed[:, num_heads * dq :]
        n = q.shape[0] - (ctx.decode.num_rows if ctx.decode is not None else 0)  # the chunks' tokens
        _store_latents(ctx, spec.cache_index, latents[:n])
        out = q.new_empty(q.shape[0], num_heads, self.v_head_dim)
        if ctx.decode is not None and ctx.decode.num_rows:
            out[n:] = self._decode_rows(ctx, spec, q[n:], latents[n:].contiguous())
        absorbed: list[SeqChunk] = []
        for c in ctx.chunks:
            if self.absorbs(c.num_tokens, ctx.numerics):
                absorbed.append(c)
                continue
            rows = slice(c.token_start, c.token_start + c.num_tokens)
            keys, values = self._expand(_latents(ctx, spec.cache_index, c))
            out[rows] = causal_sdpa(q[rows], keys, values, self.scale)
        if absorbed:
            rows_of = [torch.arange(c.token_start, c.token_start + c.num_tokens) for c in absorbed]
            idx = torch.cat(rows_of).to(q.device)
            out[idx] = self._attend_absorbed(ctx, spec, q[idx], absorbed)
        return out.flatten(1)

    def _decode_rows(self, ctx: ForwardContext, spec: AttnSpec, q: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """CUDA decode rows (ctx.decode) in the paged latent kernel: their latents [rows, R + Dr] stored through
        the block tables, queries q [rows, H, Dn + Dr] absorbed -> [rows, H, Dv]."""
        from pdkernels.mla_decode import paged_latent_decode, store_latents

        dec = ctx.decode
        assert dec is not None
        num_heads, dn, rank = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        store_latents(latents, ctx.kv.pages, spec.cache_index, dec.block_table, dec.context_lens)
        q_latent = run_rows(self.absorb_query, (q[..., :dn].flatten(1),), ctx.numerics).view(-1, num_heads, rank)
        queries = torch.cat([q_latent, q[..., dn:]], dim=-1)  # [rows, H, R + Dr]
        o_latent = paged_latent_decode(queries, ctx.kv.pages, spec.cache_index, dec.block_table, dec.context_lens,
                                       rank, self.scale)  # fmt: skip
        return run_rows(self.expand_output, (o_latent.flatten(1),), ctx.numerics).view(-1, num_heads, self.v_head_dim)

    def _expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [L, R + Dr] -> per-head keys [L, H, Dn + Dr] and values [L, H, Dv] (default mode only)."""
        rank, dn = self.kv_lora_rank, self.qk_nope_head_dim
        kv = F.linear(latents[:, :rank], self._kv_b_weight(latents.dtype)).view(latents.shape[0], self.num_heads, -1)
        k_rot = latents[:, None, rank:].expand(-1, self.num_heads, -1)
        return torch.cat([kv[..., :dn], k_rot], dim=-1), kv[..., dn:]

    def _attend_absorbed(
        self, ctx: ForwardContext, spec: AttnSpec, q: torch.Tensor, chunks: list[SeqChunk]
    ) -> torch.Tensor:
        """The chunks' queries q [n, H, Dn + Dr] (their rows in chunk order) attended in latent space ->
        [n, H, Dv]."""
        num_heads, dn, rank = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        q_latent = run_rows(self.absorb_query, (q[..., :dn].flatten(1),), ctx.numerics).view(-1, num_heads, rank)
        queries = torch.cat([q_latent, q[..., dn:]], dim=-1)  # [n, H, R + Dr]
        o_latent = queries.new_empty(q.shape[0], num_heads, rank)
        first = 0
        for c in chunks:
            rows = slice(first, first + c.num_tokens)
            keys = _latents(ctx, spec.cache_index, c)  # [L, R + Dr]: one key for every head
            if ctx.numerics.is_deterministic:  # one kv head: its tiles hold every head's rows, keys not repeated
                o_latent[rows] = tiled_attend(queries[rows], keys[:, None], keys[:, None, :rank], c.start_pos, 0,
                                              None, self.scale, ctx.kv.block_size)
            else:
                o_latent[rows] = latent_sdpa(queries[rows], keys, rank, c.start_pos, self.scale)
            first += c.num_tokens
        return run_rows(self.expand_output, (o_latent.flatten(1),), ctx.numerics).view(-1, num_heads, self.v_head_dim)


def causal_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk's expanded attention: queries q [n, H, Dn + Dr], the last n of the L positions of keys
    [L, H, Dn + Dr] and values [L, H, Dv] -> [n, H, Dv]. The causal mask aligned to the bottom right
    (torch's causal_lower_right: no mask tensor, so torch's fused kernels take it); on CUDA the values padded
    to the keys' width, since torch's flash kernel wants one width for all three."""
    from torch.nn.attention.bias import causal_lower_right

    n, num_keys, dv = q.shape[0], keys.shape[0], values.shape[-1]
    if q.is_cuda and dv < q.shape[-1]:
        values = F.pad(values, (0, q.shape[-1] - dv))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=causal_lower_right(n, num_keys), scale=scale,
    )  # fmt: skip
    return out[0, ..., :dv].transpose(0, 1)


def latent_sdpa(queries: torch.Tensor, latents: torch.Tensor, rank: int, q_pos0: int, scale: float) -> torch.Tensor:
    """Causal attention of queries [n, H, R + Dr] at positions q_pos0.. over latents [L, R + Dr] at positions
    0..L-1, values their first R columns -> [n, H, R]. The heads fold into the query rows (row token * H +
    head) of one attention head: every head shares the keys, which are never repeated per head."""
    n, num_heads, width = queries.shape
    num_keys = latents.shape[0]
    q_pos = torch.arange(q_pos0, q_pos0 + n, device=queries.device).repeat_interleave(num_heads)
    mask = torch.arange(num_keys, device=queries.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        queries.reshape(1, 1, n * num_heads, width),
        latents[None, None],
        latents[None, None, :, :rank],
        attn_mask=None if q_pos0 + 1 >= num_keys else mask,  # every row sees every key: no mask
        scale=scale,
    )
    return out.view(n, num_heads, rank)


def _store_latents(ctx: ForwardContext, layer: int, latents: torch.Tensor) -> None:
    """The step's new tokens' latents [tokens, R + Dr] into their pages (pages [.., layer, 0, offset, 0])."""
    if ctx.page_ids.numel():
        ctx.kv.pages[ctx.page_ids, layer, 0, ctx.page_offsets] = latents[:, None]


def _latents(ctx: ForwardContext, layer: int, c: SeqChunk) -> torch.Tensor:
    """The latents of positions [0, end) of a chunk's sequence, [end, R + Dr], in position order (the
    chunk's own were stored before)."""
    bs = ctx.kv.block_size
    ids = torch.tensor(c.block_ids[: math.ceil(c.end_pos / bs)], dtype=torch.long, device=ctx.kv.device)
    pages = ctx.kv.pages[ids, layer, 0]  # [pages, block_size, 1, R + Dr]
    return pages.reshape(-1, pages.shape[-1])[: c.end_pos]
