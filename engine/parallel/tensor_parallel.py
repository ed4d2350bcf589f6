"""Tensor parallelism (`--tp N`): N processes hold one copy of the model, split Megatron-style.

What each rank holds (`TpShard`, the loader reads only these slices of the checkpoint):

    q/k/v_proj       column-parallel: rank r's query heads [r H/N, (r+1) H/N) and the KV heads they read
                     (KV heads split when N divides them, replicated when N is a multiple of them)
    o_proj           row-parallel: the input columns of rank r's heads; its bias on rank 0 only
    gate/up_proj     column-parallel: rows [r I/N, (r+1) I/N) of the intermediate size
    down_proj        row-parallel: the same columns
    sinks            rank r's heads
    embed_tokens     replicated: a lookup is an exact gather that needs no communication (a vocab-split
                     table would need one all-reduce of [tokens, hidden] per step); its cost is
                     vocab x hidden per rank (2.1 GB for a 70B's 128k x 8192 in bf16)
    lm_head          vocab-parallel: rows [r V', (r+1) V') with V' = ceil(V / N), the logits gathered to
                     rank 0 (the head is a decode step's largest matmul, and only rank 0 samples); a
                     tied head is the matching rows of the replicated embedding
    norms, q/k norms replicated
    MoE experts      every expert's intermediate rows split as a dense MLP's (gate/up rows, down columns:
                     rows [r I'/N, (r+1) I'/N) of each expert's I'), the router replicated (every rank
                     routes the same replicated hidden state alike), the down bias on rank 0 only; one
                     all-reduce after the block, as after a dense MLP. Not expert parallelism inside
                     the group: every rank already holds every token, so splitting each expert needs
                     no token exchange, keeps the ranks' work equal whatever the routing (hot experts
                     would stall one rank of an EP split), and computes a token's result as --tp 1
                     does up to the order of one sum. Its limit: I' / N rows per expert per rank (small
                     matmuls at a large N, and FP8 experts need I' / N to be whole 128-blocks).
                     With --ep (engine/parallel/world.py, TpShard.splits_experts False) the experts are instead held
                     whole and split across every process of every group, each process routing its share
                     of the group's tokens.

A layer then communicates twice: one all-reduce (sum) of o_proj's partial [tokens, hidden], one of
down_proj's. In deterministic mode the sum is an all-gather and an add in rank order, so a row's
value does not depend on the tensor's size (gloo's ring splits a large tensor into per-rank chunks:
beyond two ranks the order of a row's adds would follow the batch).

FP8 weights (engine/layers/fp8.py) are split along their 128-wide blocks, their scales with them: a TP size
whose split would cut a block is refused at load (`check_fp8_blocks`).

One scheduler per group (lockstep by broadcast): rank 0 runs the whole engine (admission, scheduler,
block pools, sampling, detokenizing); before every forward it broadcasts the step's plan
(engine/execution/runner.py StepPlan: the flattened token ids and positions, each sequence's chunk with its
block table and state slot, the rows whose logits are wanted) and the other ranks run exactly that
forward on their own KV heads (`LLMEngine.follow`). Pages, block tables and slots are rank 0's, so
they are the same on every rank; only rank 0 samples, and the tokens reach the other ranks as the
next plan's input ids. The host prefix cache's copies (engine/core/host_prefix_cache.py) rank 0 made since
the last forward go before it (PLAN_COPY), and every rank makes them on its own host pool and KV
heads. A P/D handoff's export and import go the same way (PLAN_EXPORT, PLAN_IMPORT: engine/handoff/kv_shards.py
gathers and scatters the sequence's pages and SWA state, so a handoff carries every KV head of the model
whatever the group's size). An idle rank 0 broadcasts an idle plan now and then (`LLMEngine.heartbeat`: a follower's wait
in the broadcast would otherwise time out), and a stop plan when it closes.

The plan travels over a gloo group (on CUDA a second group beside the NCCL one: the plan is host
data), msgpack-encoded (a size, then the bytes). A process that dies breaks its peers' next collective;
the server's rank process, rank 0, then exits and is restarted with new followers (pd/rank/worker.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import msgpack
import torch

from engine import quantization
from engine.arch import ModelArch
from engine.errors import InvalidRequestError
from engine.parallel.rank_group import join_group, leave_group

PLAN_STEP, PLAN_IDLE, PLAN_STOP, PLAN_COPY, PLAN_EXPORT, PLAN_IMPORT = 0, 1, 2, 3, 4, 5  # kinds of broadcast
# under --ep (engine/parallel/world.py): an empty MoE exchange; expert rebalancing; the MoE counters gathered for stats
PLAN_EXCHANGE, PLAN_REBALANCE, PLAN_COUNTERS = 6, 7, 8


def kv_heads_of(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """[first, first + count) of the model's KV heads that rank `rank` of `size` holds: an equal share
    when size divides them, else (size a multiple of them) the one KV head its query heads read."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, per
    return rank * num_kv_heads // size, 1


@dataclass
class TensorGroup:
    """This process's place in its tensor-parallel group."""

    rank: int
    size: int
    device: torch.device
    group: Any = None  # the torch.distributed group of the collectives (None: the default group)
    control: Any = None  # the gloo group the plans travel on (None: the default group, a gloo one)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor, is_deterministic: bool) -> torch.Tensor:
        """The sum of every rank's x (a collective). Deterministic: gathered, then added in rank order."""
        import torch.distributed as dist

        if not is_deterministic:
            dist.all_reduce(x, group=self.group)
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def gather_vocab(self, part: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's logits [rows, V'] of its vocabulary rows -> [rows, vocab_size] on rank 0, None on
        the others (a collective). The last rank's part is padded to V' for the gather."""
        per = math.ceil(vocab_size / self.size)
        if part.shape[-1] < per:
            part = torch.nn.functional.pad(part, (0, per - part.shape[-1]))
        parts = self.gather(part)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest value over the ranks (a collective)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def gather(self, part: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's part (the same shape on each), in rank order, on rank 0; None on the others (a
        collective)."""
        import torch.distributed as dist

        part = part.contiguous()
        if self.rank != 0:
            dist.gather(part, None, group=self.group, group_dst=0)
            return None
        parts = [torch.empty_like(part) for _ in range(self.size)]
        dist.gather(part, parts, group=self.group, group_dst=0)
        return parts

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None) -> torch.Tensor:
        """Rank r's out filled with rank 0's parts[r] (parts: rank 0's, one per rank, shaped as out; None
        on the others); a collective."""
        import torch.distributed as dist

        if self.rank != 0:
            dist.scatter(out, None, group=self.group, group_src=0)
        else:
            assert parts is not None and len(parts) == self.size
            dist.scatter(out, [p.contiguous() for p in parts], group=self.group, group_src=0)
        return out

    def send_plan(self, kind: int, plan: Any = None) -> None:
        """Rank 0: broadcasts a plan (msgpack-encodable) of the given kind."""
        import torch.distributed as dist

        data = msgpack.packb(plan) if plan is not None else b""
        dist.broadcast(torch.tensor([kind, len(data)], dtype=torch.int64), group=self.control, group_src=0)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), group=self.control, group_src=0)

    def receive_plan(self) -> tuple[int, Any]:
        """The other ranks: the next plan rank 0 broadcasts, (kind, plan or None)."""
        import torch.distributed as dist

        head = torch.empty(2, dtype=torch.int64)
        dist.broadcast(head, group=self.control, group_src=0)
        kind, size = (int(v) for v in head.tolist())
        if not size:
            return kind, None
        data = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(data, group=self.control, group_src=0)
        return kind, msgpack.unpackb(data.numpy().tobytes())


# ---- what a rank holds ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Slice:
    """What a rank holds of a tensor whose length along dim is full: the pieces [start, stop) along dim,
    side by side (one piece, but two for stacked gate/up rows: rank r's gate rows, then its up rows)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full: int

    @classmethod
    def one(cls, dim: int, start: int, stop: int, full: int) -> Slice:
        return cls(dim, ((start, stop),), full)


PER_EXPERT = re.compile(r".+\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight")


@dataclass(frozen=True)
class TpShard:
    """Rank `rank` of `size`: the model's shapes on this rank and the checkpoint slices it loads."""

    rank: int
    size: int
    arch: ModelArch  # the whole model's
    # False under --ep (engine/parallel/world.py): the routed experts are split across the expert-parallel group,
    # each held whole, so this rank loads them unsplit (and its share of them, engine/models/loader.py)
    splits_experts: bool = True

    def __post_init__(self) -> None:
        a, n = self.arch, self.size
        if a.num_heads % n:
            raise InvalidRequestError(f"--tp {n} must divide the model's {a.num_heads} attention heads")
        if a.num_kv_heads % n and n % a.num_kv_heads:
            raise InvalidRequestError(
                f"--tp {n} must divide the model's {a.num_kv_heads} KV heads or be a multiple of them"
            )
        moe_rows = a.moe.moe_intermediate_size if a.moe is not None else 0
        shared_rows = a.moe.shared_intermediate_size if a.moe is not None else 0
        expert_rows = moe_rows if self.splits_experts else 0
        if a.intermediate_size % n or expert_rows % n or shared_rows % n:
            raise InvalidRequestError(
                f"--tp {n} must divide the model's intermediate size {a.intermediate_size}"
                + (f" and its experts' {moe_rows}" if expert_rows else "")
                + (f" and its shared experts' {shared_rows}" if shared_rows else "")
            )

    @property
    def local_arch(self) -> ModelArch:
        """The arch this rank's modules are built with: its heads, KV heads and intermediate sizes."""
        a, n = self.arch, self.size
        moe = a.moe
        if moe is not None:
            moe = replace(
                moe,
                moe_intermediate_size=moe.moe_intermediate_size // n if self.splits_experts else moe.moe_intermediate_size,
                shared_intermediate_size=moe.shared_intermediate_size // n,
            )
        return replace(
            a,
            num_heads=a.num_heads // n,
            num_kv_heads=max(1, a.num_kv_heads // n),
            intermediate_size=a.intermediate_size // n,
            moe=moe,
        )

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """[start, stop) of the LM head's rows this rank computes."""
        per = math.ceil(self.arch.vocab_size / self.size)
        start = min(self.rank * per, self.arch.vocab_size)
        return start, min(start + per, self.arch.vocab_size)

    def _heads(self, kv: bool) -> tuple[int, int]:
        """[first, first + count) of this rank's query heads (kv False) or KV heads (kv True)."""
        a, n, r = self.arch, self.size, self.rank
        if not kv:
            per = a.num_heads // n
            return r * per, per
        return kv_heads_of(r, n, a.num_kv_heads)

    def slice_of(self, name: str, expert_layout: str = "stacked") -> Slice | None:
        """The slice of tensor `name` this rank holds (the weight's for its `_scale_inv`, in elements, not
        blocks); None: the whole tensor (replicated). Stacked experts as the checkpoint's expert_layout
        stores them (engine/models/loader.py; the model's own is "stacked")."""
        a, r = self.arch, self.rank
        base = name.removesuffix(quantization.SCALE_SUFFIX)
        if a.is_mla:
            mla = self._latent_attention_slice(base)
            if mla is not None:
                return mla
        d = a.head_dim
        if base.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            first, count = self._heads(kv=False)
            return Slice.one(0, first * d, (first + count) * d, a.num_heads * d)
        if base.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                          "self_attn.v_proj.bias")):  # fmt: skip
            first, count = self._heads(kv=True)
            return Slice.one(0, first * d, (first + count) * d, a.num_kv_heads * d)
        if base.endswith("self_attn.o_proj.weight"):
            first, count = self._heads(kv=False)
            return Slice.one(1, first * d, (first + count) * d, a.num_heads * d)
        if base.endswith("self_attn.sinks"):
            first, count = self._heads(kv=False)
            return Slice.one(0, first, first + count, a.num_heads)
        per = a.intermediate_size // self.size
        if base.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return Slice.one(0, r * per, (r + 1) * per, a.intermediate_size)
        if base.endswith("mlp.down_proj.weight"):
            return Slice.one(1, r * per, (r + 1) * per, a.intermediate_size)
        shared = a.moe.shared_intermediate_size if a.moe is not None else 0
        if shared:  # shared experts: one dense SwiGLU, split like an MLP
            per_s = shared // self.size
            if base.endswith(("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")):
                return Slice.one(0, r * per_s, (r + 1) * per_s, shared)
            if base.endswith("mlp.shared_experts.down_proj.weight"):
                return Slice.one(1, r * per_s, (r + 1) * per_s, shared)
        if base == "lm_head.weight":
            start, stop = self.vocab_rows
            return Slice.one(0, start, stop, a.vocab_size)
        return self._expert_slice(base, expert_layout)

    def _latent_attention_slice(self, base: str) -> Slice | None:
        """Latent attention (engine/layers/mla.py) split by heads: the per-head query rows (q_b_proj, or q_proj
        without a query LoRA) and kv_b_proj's per-head up-projection rows, o_proj's per-head value columns;
        the latent's own projections and norms (q_a_proj, kv_a_proj_with_mqa, their layernorms) replicated,
        so every rank computes and caches the same latents. None for the names it does not split."""
        a, m = self.arch, self.arch.mla
        assert m is not None
        first, count = self._heads(kv=False)
        if base.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            dq = m.qk_head_dim
            return Slice.one(0, first * dq, (first + count) * dq, a.num_heads * dq)
        if base.endswith("self_attn.kv_b_proj.weight"):
            dkv = m.qk_nope_head_dim + m.v_head_dim
            return Slice.one(0, first * dkv, (first + count) * dkv, a.num_heads * dkv)
        if base.endswith("self_attn.o_proj.weight"):
            dv = m.v_head_dim
            return Slice.one(1, first * dv, (first + count) * dv, a.num_heads * dv)
        return None

    def _expert_slice(self, base: str, layout: str) -> Slice | None:
        """Routed experts: each expert's intermediate rows [r I', (r+1) I') (see the module docstring); None
        (whole experts) under --ep."""
        if not self.splits_experts or self.arch.moe is None:
            return None
        full = self.arch.moe.moe_intermediate_size
        per = full // self.size
        lo, hi = self.rank * per, (self.rank + 1) * per
        match = PER_EXPERT.fullmatch(base)
        if match is not None:
            return Slice.one(1 if match.group(1) == "down_proj" else 0, lo, hi, full)
        interleaved = layout == "interleaved"
        if base.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.gate_up_proj_bias")):
            is_bias = base.endswith("_bias")
            if interleaved:  # [E, H, 2I] (bias [E, 2I]), gate i and up i in columns 2i, 2i + 1: one run
                return Slice.one(1 if is_bias else 2, 2 * lo, 2 * hi, 2 * full)
            return Slice(1, ((lo, hi), (full + lo, full + hi)), 2 * full)  # [E, 2I, H]: gate rows, then up rows
        if base.endswith(".mlp.experts.down_proj"):
            return Slice.one(1 if interleaved else 2, lo, hi, full)  # [E, I, H] interleaved, [E, H, I] stacked
        return None

    def is_zero_here(self, name: str) -> bool:
        """A row-parallel projection's bias: added once, by rank 0 (the all-reduce sums the ranks)."""
        row_parallel = ("self_attn.o_proj.bias", ".mlp.experts.down_proj_bias")
        return self.rank != 0 and name.endswith(row_parallel if self.splits_experts else row_parallel[0])

    def check_fp8_blocks(self, name: str) -> None:
        """Refuses a split of FP8 weight `name` that cuts one of its 128-wide blocks."""
        s = self.slice_of(name)
        if s is None:
            return
        for edge in (e for piece in s.ranges for e in piece):
            if edge % quantization.BLOCK and edge != s.full:
                raise InvalidRequestError(
                    f"--tp {self.size} splits {name} at {edge} of {s.full}, inside a {quantization.BLOCK}-wide FP8 block: "
                    "pick a TP size that splits it at block edges, or load float weights"
                )


def take(t: Any, s: Slice) -> torch.Tensor:
    """Slice s of a tensor (or of a safetensors slice, read lazily: only these rows)."""
    parts = []
    for start, stop in s.ranges:
        index: list[slice] = [slice(None)] * (s.dim + 1)
        index[s.dim] = slice(start, stop)
        parts.append(t[tuple(index)])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=s.dim)


def scale_slice(s: Slice) -> Slice:
    """A weight's slice in its FP8 block scales (check_fp8_blocks has passed: block edges)."""
    b = quantization.BLOCK
    return Slice(s.dim, tuple((a // b, math.ceil(z / b)) for a, z in s.ranges), math.ceil(s.full / b))


def full_shape(shape: tuple[int, ...], s: Slice) -> tuple[int, ...]:
    out = list(shape)
    out[s.dim] = s.full
    return tuple(out)


_current: TensorGroup | None = None


def current() -> TensorGroup | None:
    """The process's tensor-parallel group, or None (`--tp 1`)."""
    return _current


def init_group(rank: int, size: int, address: str, device: torch.device, timeout_s: float = 120.0) -> TensorGroup:
    """Joins the group at address (host:port; rank 0 hosts the store), once per process."""
    import torch.distributed as dist

    if _current is not None:
        raise RuntimeError("this process is in a tensor-parallel group already")
    join_group(rank, size, address, device, timeout_s)
    control = dist.new_group(backend="gloo") if device.type == "cuda" else None
    return adopt(TensorGroup(rank, size, device, control=control))


def adopt(group: TensorGroup) -> TensorGroup:
    """Makes group the process's tensor-parallel group (its process groups made already: engine/parallel/world.py)."""
    global _current
    if _current is not None:
        raise RuntimeError("this process is in a tensor-parallel group already")
    _current = group
    return group


def close_group() -> None:
    global _current
    if _current is not None:
        leave_group()
    _current = None
