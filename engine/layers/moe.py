"""A sparse mixture-of-experts MLP (Qwen3-MoE, gpt-oss, DeepSeek-V3): a router picks top-k SwiGLU experts
per token.

    route     router logits = gate(x) (+ bias) in the model dtype, then a family's ROUTERS entry:
              "softmax_topk" (Qwen3-MoE): softmax over the experts in float32; top-k; renormalized to
              sum to 1 when norm_topk_prob; weights cast back to the model dtype.
              "topk_softmax" (gpt-oss): top-k of the logits; softmax over those k in the logits' dtype
              (as transformers does; torch's softmax accumulates a bf16 input in float32 anyway)
              "sigmoid_group_topk" (DeepSeek-V3, `route_group_topk`): sigmoid scores of float32 logits
              from a float32 gate (ScoreGate: the sigmoid inside the row-local part, see there); the
              choice adds e_score_correction_bias and keeps the topk_groups groups of experts whose two
              best biased scores sum highest; the weights are the unbiased scores of the chosen k (in
              expert id order), renormalized when norm_topk_prob, times routed_scaling_factor, in float32
    shared    DeepSeek-V3's shared experts: one dense SwiGLU MLP every token runs, added to the routed
              experts' sum (computed on every expert-parallel rank for its own tokens)
    dispatch  the T*k (token, slot) assignments, flattened slot-major per token, sorted (stably) by
              expert id, so each expert's rows are one contiguous slice of the gathered tokens
    experts   one grouped matmul per projection over those slices (gate and up fused)
    combine   each weighted row goes back to its (token, slot) place; a token's k slots are added in
              slot order, in float32, then cast: deterministic on every device (an index_add_ on CUDA
              adds in atomic order) and, for k = 2, the bits of transformers' sum over slots

  sorted assignments   | e0 e0 e0 | e2 | e5 e5 |        (expert 1, 3, 4, ... got no token: empty slice)
  group_ends            3    3    4   4   4   6  6  6  (cumulative, one per local expert)

Expert weights are stacked 3-D tensors, [num_experts, 2 * intermediate, hidden] (gate rows first, then up:
transformers' fused layout) and [num_experts, hidden, intermediate], so a grouped GEMM kernel or an
expert-parallel rank (experts [first_expert, first_expert + num_local_experts)) takes a slice of them.
gpt-oss's experts have biases, [num_experts, 2 * intermediate] (the same gate-then-up order) and
[num_experts, hidden], added after each grouped matmul (gathered per sorted row by its expert), and the
clamped SwiGLU "swiglu_oai": (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
forward() with a local range returns only those experts' share of the output; assignments to other
experts sort after the local ones (a sentinel id) and are left out. Summing the shares of a partition
of the experts gives the full output (up to float rounding); the communication is not done here.

Numerics: the router linear and every expert matmul go through engine/layers/numerics.py's run_rows under
the step's numerics, so in deterministic mode a token's result does not depend on its batch (an
expert's rows are tiled or padded like any row-local matmul, and on CUDA go through the
batch-invariant matmul). On CUDA (SiLU or gpt-oss SwiGLU experts, all of them held) the whole block
after routing is pdkernels/moe_gemm.py's Triton path (grouped GEMMs with the biases and the activation
fused, combine in slot order; its batch-invariant variant in deterministic mode). Elsewhere the default
mode uses torch's grouped matmul where it runs (no host sync: CUDA graphs can capture it), else a loop
over the non-empty experts.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.arch import EXPERT_ACTIVATIONS, ROUTING_KINDS
from engine.errors import InvalidRequestError
from engine.layers import fp8
from engine.layers.numerics import Numerics, run_rows

if TYPE_CHECKING:
    from engine.parallel.expert_parallel import ExpertGroup

GroupedMM = Callable[..., torch.Tensor]
Router = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]


def route_softmax_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE: softmax over every expert in float32, top-k, optionally renormalized; cast back."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def route_topk_softmax(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: top-k of the raw logits, softmax over those k (they sum to 1: norm_topk_prob is moot)."""
    values, experts = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), experts


def route_group_topk(
    scores: torch.Tensor, top_k: int, norm_topk_prob: bool, score_bias: torch.Tensor, num_groups: int,
    topk_groups: int, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 (transformers' DeepseekV3TopkRouter) from the sigmoid scores [tokens, experts] (float32):
    score_bias ([experts], e_score_correction_bias) shifts the choice only: experts of the topk_groups
    groups whose two best shifted scores sum highest, their top-k by shifted score (in expert id order);
    weights are the unshifted scores (renormalized when norm_topk_prob) times scaling, in float32.
    Every operation is exact or elementwise, so a token's result does not depend on the other rows."""
    num_tokens, num_experts = scores.shape
    choice = scores + score_bias.float()
    if topk_groups < num_groups:
        per_group = choice.view(num_tokens, num_groups, num_experts // num_groups)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.unsqueeze(-1).expand_as(per_group).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    # NOTE: the chosen experts in id order: torch's unsorted top-k order varies with the number of rows,
    # and the slots' order is the order their weights and outputs are added in
    experts = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1].sort(dim=-1).values
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        # NOTE: added slot by slot: torch's sum over a small last axis may order its adds by the row count
        total = weights[:, 0]
        for slot in range(1, top_k):
            total = total + weights[:, slot]
        weights = weights / (total[:, None] + 1e-20)
    return weights * scaling, experts


# ModelArch.routing -> (router logits [tokens, experts], k, norm_topk_prob) -> (weights, expert ids) [tokens, k];
# "sigmoid_group_topk" takes the gate's bias and the groups too (route_group_topk, through ScoreGate)
ROUTERS: dict[str, Router] = {"softmax_topk": route_softmax_topk, "topk_softmax": route_topk_softmax}
_FUSED_ROUTERS = (route_softmax_topk, route_topk_softmax)  # what pdkernels/moe_route.py's route() computes
# ModelArch.expert_activation, pdkernels/moe_gemm.py's names: "swiglu" is act(gate) * up (act: the
# config's hidden_act; the Triton path fuses SiLU only), "swiglu_oai" gpt-oss's clamped one (swiglu_oai)
assert (*ROUTERS, "sigmoid_group_topk") == ROUTING_KINDS and EXPERT_ACTIVATIONS == ("swiglu", "swiglu_oai")


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU, in transformers' order of operations (so float32 rounds alike)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@cache
def _kernels() -> ModuleType | None:
    """pdkernels.moe_gemm where triton is installed (CUDA paths), else None."""
    try:
        from pdkernels import moe_gemm
    except ImportError:
        return None
    return moe_gemm


@cache
def _route_kernels() -> ModuleType | None:
    """pdkernels.moe_route where triton is installed (CUDA), else None."""
    try:
        from pdkernels import moe_route
    except ImportError:
        return None
    return moe_route


@cache
def _grouped_mm_fn() -> GroupedMM | None:
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@cache
def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped matmul runs here: no CPU kernel before torch 2.9; on CUDA only bf16 (SM80+)
    has a kernel (other dtypes take a fallback that copies the offsets to the host: no CUDA graphs)."""
    fn = _grouped_mm_fn()
    if fn is None or (device.type == "cuda" and dtype != torch.bfloat16):
        return False
    try:
        a = torch.ones(4, 16, device=device, dtype=dtype)
        b = torch.ones(2, 16, 16, device=device, dtype=dtype)
        out = fn(a, b, offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return bool((out == 16).all())


def can_use_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's grouped matmul for x [rows, K] by weight [groups, N, K]: it needs 16-byte aligned rows."""
    size = x.element_size()
    is_aligned = (weight.shape[1] * size) % 16 == 0 and (weight.shape[2] * size) % 16 == 0
    return is_aligned and x.dtype == weight.dtype and _grouped_mm_runs(x.device, x.dtype)


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, numerics: Numerics
) -> torch.Tensor:
    """x [rows, K] sorted by group, weight [groups, N, K], group_ends [groups] (cumulative row counts)
    -> [rows, N]: row r of group g is x[r] @ weight[g].T. Rows past group_ends[-1] are left unspecified."""
    if numerics is Numerics.DEFAULT and can_use_grouped_mm(x, weight):
        fn = _grouped_mm_fn()
        assert fn is not None
        return fn(x, weight.transpose(1, 2), offs=group_ends.to(torch.int32))
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the MoE's per-expert loop (deterministic mode, or no torch grouped matmul for this dtype) reads "
            "the group sizes on the host, which a CUDA graph cannot capture: run with enforce_eager"
        )
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for g, end in enumerate(group_ends.tolist()):  # NOTE: a host sync, once per projection
        if end > start:
            out[start:end] = run_rows(partial(F.linear, weight=weight[g]), (x[start:end],), numerics)
        start = end
    return out


class ExpertWeights(nn.Module):
    """Every expert's SwiGLU weights, stacked: Hugging Face's `mlp.experts.gate_up_proj` / `down_proj`, and
    with has_bias gpt-oss's `gate_up_proj_bias` / `down_proj_bias` (None without)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, has_bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if has_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        # FP8 weights (engine/layers/fp8.py, to_fp8): the block scales of gate_up_proj and down_proj
        self.gate_up_proj_scale_inv: nn.Parameter | None = None
        self.down_proj_scale_inv: nn.Parameter | None = None

    @property
    def is_fp8(self) -> bool:
        return self.gate_up_proj_scale_inv is not None

    def to_fp8(self) -> None:
        """Replaces the (not yet loaded) weights with empty FP8 ones and their block scales, on their
        device. Gate and up rows stack, so the intermediate width must be a whole number of blocks."""
        intermediate = self.down_proj.shape[2]
        if intermediate % fp8.BLOCK:
            raise InvalidRequestError(
                f"FP8 experts need an expert intermediate size that is a multiple of {fp8.BLOCK} (gate and up "
                f"blocks stack), not {intermediate}"
            )
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(old.shape, dtype=fp8.FP8_DTYPE, device=old.device),
                                             requires_grad=False))  # fmt: skip
            scale = torch.empty(fp8.scale_shape(old.shape), dtype=torch.float32, device=old.device)
            setattr(self, name + fp8.SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))

    def dense(self, name: str, first: int, num: int, dtype: torch.dtype) -> torch.Tensor:
        """Experts [first, first + num) of `gate_up_proj` or `down_proj` as float weights of dtype (FP8 ones
        dequantized: only those experts)."""
        w = getattr(self, name)[first : first + num]
        if not self.is_fp8:
            return w
        return fp8.dequantize(w, getattr(self, name + fp8.SCALE_SUFFIX)[first : first + num], dtype)


class ScoreGate(nn.Linear):
    """DeepSeek-V3's router (Hugging Face's `mlp.gate`): a linear without bias, kept in float32 as
    transformers keeps it (the loader casts it back after the model's dtype), plus
    e_score_correction_bias [experts], which shifts the expert choice only. Its forward gives the sigmoid
    scores, not the logits: a row-local function runs in fixed-shape tiles in deterministic mode, and
    torch's vectorized sigmoid rounds differently from its scalar tail on the CPU (a token's scores
    changed in the last bit with the batch's size when the sigmoid ran over the whole batch)."""

    def __init__(self, hidden_size: int, num_experts: int, num_groups: int, topk_groups: int, scaling: float) -> None:
        super().__init__(hidden_size, num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))
        self.num_groups, self.topk_groups, self.scaling = num_groups, topk_groups, scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Row-local: float32 sigmoid scores [tokens, experts]."""
        return F.linear(x.float(), self.weight.float()).sigmoid()

    def route(self, scores: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return route_group_topk(
            scores, top_k, norm_topk_prob, self.e_score_correction_bias, self.num_groups, self.topk_groups, self.scaling
        )


class SharedExperts(nn.Module):
    """DeepSeek-V3's shared experts, Hugging Face's `mlp.shared_experts`: one dense SwiGLU MLP (the experts'
    widths side by side) that every token runs."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE's, gpt-oss's and DeepSeek-V3's sparse blocks; see the module
    docstring). routing: a ROUTING_KINDS name; activation: "swiglu" (act(gate) * up) or "swiglu_oai"
    (alpha, limit); has_bias: the router and the experts have biases, and the router is Hugging Face's
    `mlp.router` (gpt-oss) instead of `mlp.gate`. "sigmoid_group_topk" (DeepSeek-V3): the gate is a
    ScoreGate (num_groups, topk_groups, scaling), and shared_intermediate_size > 0 adds SharedExperts.

    Under --tp with --ep (tp_share, engine/parallel/world.py) each process of a tensor-parallel group computes the
    routed experts of its share of the group's tokens only (forward_share), the group's all-reduce
    after the block adding the shares.

    In an expert-parallel group (engine/parallel/expert_parallel.py) the module holds only its rank's slots,
    `experts` [num_local, ...], and forward() exchanges rows with the other ranks; `placement` maps
    each logical expert to its physical slot (slot s lives on rank s // num_local), the identity until
    expert rebalancing (engine/layers/eplb.py) moves experts. `tokens_per_expert` counts this rank's
    assignments per logical expert (the /metrics expert load; rebalancing takes what it gained since
    the last rebalancing, take_window)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        act: Callable[[torch.Tensor], torch.Tensor],
        ep: ExpertGroup | None = None,
        *,
        routing: str = "softmax_topk",
        activation: str = "swiglu",
        has_bias: bool = False,
        alpha: float = 1.702,
        limit: float = 7.0,
        num_groups: int = 1,
        topk_groups: int = 1,
        scaling: float = 1.0,
        shared_intermediate_size: int = 0,
        tp_share: tuple[int, int] = (0, 1),
        product: Callable[[nn.Linear, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        # the router's matrix product: the model passes its forward pass's (engine/layers/linear.py: a decode
        # step's few rows through the GEMV); on its own, the layer calls the linear
        self.product = product or (lambda lin, x: F.linear(x, lin.weight, lin.bias))
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        if routing not in ROUTING_KINDS or activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"routing {routing!r}, activation {activation!r}: one of {ROUTING_KINDS}, "
                             f"{EXPERT_ACTIVATIONS}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.router_fn: Router | None = ROUTERS.get(routing)  # None: the gate routes (ScoreGate)
        self.act = act
        self.activation = activation
        self.alpha, self.limit = alpha, limit
        # the Triton path fuses SiLU-SwiGLU and gpt-oss's (pdkernels/moe_gemm.py ACTIVATIONS)
        self.can_fuse = activation == "swiglu_oai" or act is F.silu
        self.ep = ep
        # --tp with --ep (engine/parallel/world.py): (this process, of how many) of its tensor-parallel group, which all
        # hold the same tokens; each routes and dispatches its share of them (forward_share)
        self.tp_share = tp_share
        self.first_local, self.num_local = (
            ep.local_experts(num_experts) if ep is not None else (0, num_experts)
        )
        # Hugging Face's name: Qwen3-MoE's `mlp.gate`, gpt-oss's `mlp.router` (with a bias)
        self.router_name = "router" if has_bias else "gate"
        gate = (
            nn.Linear(hidden_size, num_experts, bias=has_bias) if self.router_fn is not None
            else ScoreGate(hidden_size, num_experts, num_groups, topk_groups, scaling)
        )  # fmt: skip
        self.add_module(self.router_name, gate)
        self.experts = ExpertWeights(self.num_local, hidden_size, intermediate_size, has_bias)
        self.shared_experts: SharedExperts | None = None
        if shared_intermediate_size:
            self.shared_experts = SharedExperts(hidden_size, shared_intermediate_size, act)
        # made on first use, on the activations' device (meta-device construction leaves buffers empty)
        self.placement: torch.Tensor | None = None  # [num_experts] logical expert -> physical slot
        self.tokens_per_expert: torch.Tensor | None = None  # [num_experts] int64, since the start
        self._counted_at_rebalance: torch.Tensor | None = None  # tokens_per_expert then
        self.rows_computed = 0  # (token, slot) rows this module's experts computed, since the start

    def fuse_projections(self) -> None:
        """Nothing to do: gate and up are stored fused already (CausalLM.fuse_projections calls every MLP)."""

    @property
    def router_linear(self) -> nn.Linear:
        """The router's linear, under its Hugging Face name (`gate` or `router`)."""
        linear = getattr(self, self.router_name)
        assert isinstance(linear, nn.Linear)
        return linear

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Row-local: [tokens, hidden] -> [tokens, num_experts], in the model dtype (a ScoreGate's: its float32
        sigmoid scores, which its route() takes)."""
        router = self.router_linear
        if isinstance(router, ScoreGate):
            return router(x)
        return self.product(router, x)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits -> (weights [tokens, k] in the logits' dtype, expert ids [tokens, k])."""
        if self.router_fn is None:
            return cast(ScoreGate, self.router_linear).route(logits, self.top_k, self.norm_topk_prob)
        return self.router_fn(logits, self.top_k, self.norm_topk_prob)

    def counters(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(placement, tokens_per_expert), made on device the first time."""
        if self.placement is None or self.placement.device != device:
            self.placement = torch.arange(self.num_experts, device=device)
            self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        assert self.tokens_per_expert is not None
        return self.placement, self.tokens_per_expert

    def take_window(self, device: torch.device) -> torch.Tensor:
        """This rank's tokens per logical expert since the last call (rebalancing's load window)."""
        _, total = self.counters(device)
        since = total if self._counted_at_rebalance is None else total - self._counted_at_rebalance
        self._counted_at_rebalance = total.clone()
        return since.clone()

    def _route(self, x: torch.Tensor, numerics: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
        """Routes x's tokens and counts their assignments (int adds: exact in any order; graph-safe). On
        CUDA, softmax-top-k and top-k-softmax routing run as one kernel per layer (pdkernels/moe_route.py:
        one program per token, so batch-invariant in every mode; the torch path's experts, ties to the lower id)."""
        logits = run_rows(self.router_logits, (x,), numerics)
        _, total = self.counters(x.device)
        fast = _route_kernels() if logits.is_cuda and self.router_fn in _FUSED_ROUTERS else None
        if fast is not None:
            return fast.route(logits, self.top_k, self.norm_topk_prob, self.router_fn is route_softmax_topk, total)
        weights, experts = self.route(logits)
        total.index_add_(0, experts.flatten(), torch.ones(experts.numel(), dtype=torch.int64, device=x.device))
        return weights, experts

    def forward(
        self,
        x: torch.Tensor,
        numerics: Numerics = Numerics.DEFAULT,
        first_expert: int = 0,
        num_local_experts: int | None = None,
    ) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden]. Without a group: the share of experts [first_expert,
        first_expert + num_local_experts) (default: all of them) in each token's MLP output. In a
        group: the whole output (every rank must call it, in the same layer order). Shared experts, if
        any, are added to the routed experts' sum (to every share of it: a share is then not a part of
        a partition)."""
        routed = self._forward_routed(x, numerics, first_expert, num_local_experts)
        if self.shared_experts is None:
            return routed
        return routed + run_rows(self.shared_experts, (x,), numerics)

    def forward_share(self, x: torch.Tensor, numerics: Numerics) -> torch.Tensor:
        """Under --tp with --ep: the routed experts' output for this process's share of x's tokens (rows
        [t T / N, (t + 1) T / N) for process t of N), zeros for the other rows; shared experts left out.
        Summed over the tensor-parallel group (one value and zeros: exact) it is every token's routed
        output, each (token, expert) computed once in the whole expert-parallel group. A collective:
        every process of the expert-parallel group calls it, in the same layer order."""
        assert self.ep is not None
        t, n = self.tp_share
        lo, hi = t * x.shape[0] // n, (t + 1) * x.shape[0] // n
        out = x.new_zeros(x.shape)
        out[lo:hi] = self._forward_ep(x[lo:hi], numerics)
        return out

    def _forward_routed(
        self, x: torch.Tensor, numerics: Numerics, first_expert: int, num_local_experts: int | None
    ) -> torch.Tensor:
        if self.ep is not None:
            return self._forward_ep(x, numerics)
        num_local = self.num_experts - first_expert if num_local_experts is None else num_local_experts
        if first_expert < 0 or num_local < 1 or first_expert + num_local > self.num_experts:
            raise ValueError(f"experts [{first_expert}, +{num_local}) are not within {self.num_experts}")
        num_tokens, k = x.shape[0], self.top_k
        weights, experts = self._route(x, numerics)
        self.rows_computed += num_tokens * k
        is_fusable = self.can_fuse and num_local == self.num_experts
        kernels = _kernels() if x.is_cuda and is_fusable else None
        if kernels is not None and numerics in (Numerics.DEFAULT, Numerics.BATCH_INVARIANT):
            return self.fused_experts(kernels, x, experts, weights, numerics is Numerics.BATCH_INVARIANT)
        # dispatch: local ids, others to a sentinel that sorts after them
        ids = experts.flatten() - first_expert
        ids = torch.where((ids >= 0) & (ids < num_local), ids, num_local)
        sorted_ids, order = torch.sort(ids, stable=True)
        out = self._experts_sorted(x[order // k], sorted_ids, first_expert, num_local, numerics)
        out = out * weights.flatten()[order, None]
        if num_local < self.num_experts:  # the sentinel rows were not computed
            out = torch.where((sorted_ids < num_local)[:, None], out, 0.0)
        return self._combine(torch.empty_like(out).index_copy_(0, order, out), num_tokens, x.dtype)

    def fused_experts(
        self, kernels: ModuleType, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
        batch_invariant: bool,
    ) -> torch.Tensor:
        """The block after routing through pdkernels/moe_gemm.py (`kernels`): sort, gate/up (+ bias) and the
        activation, down (+ bias), combine in slot order; no host sync (graphs capture it). Every expert
        must be held. FP8 experts take the dense layers' policy (fp8.compute_path): beyond the few tokens that
        run as GEMVs, where the dense products run in FP8 on the tensor cores, the rows are quantized per
        128-column group and both products run in FP8 (w8a8); elsewhere (--deterministic, fp8_gemm
        "dequantize") each weight tile is dequantized to x's dtype."""
        w = self.experts
        fp8_x = (
            w.is_fp8 and x.shape[0] > kernels.MAX_GEMV_TOKENS and not batch_invariant
            and x.shape[1] % fp8.BLOCK == 0 and fp8.compute_path(x) in ("triton", "cublas")
        )  # fmt: skip
        return kernels.fused_moe(
            x, experts, weights, w.gate_up_proj, w.down_proj, w.gate_up_proj_bias, w.down_proj_bias,
            activation=self.activation, batch_invariant=batch_invariant, alpha=self.alpha, limit=self.limit,
            w_gate_up_scale=w.gate_up_proj_scale_inv, w_down_scale=w.down_proj_scale_inv, fp8_activations=fp8_x,
        )  # fmt: skip

    def _experts_sorted(
        self, rows: torch.Tensor, sorted_ids: torch.Tensor, first: int, num: int, numerics: Numerics
    ) -> torch.Tensor:
        """Unweighted SwiGLU outputs of rows sorted by expert id (ids relative to `first` of the held
        experts; rows with ids >= num are left unspecified)."""
        bounds = torch.arange(1, num + 1, device=rows.device, dtype=sorted_ids.dtype)
        group_ends = torch.searchsorted(sorted_ids, bounds)  # rows of experts < e + 1
        w = self.experts
        # each row's expert among the held ones, for the bias gather (a sentinel row takes the last one's)
        held = (first + sorted_ids.clamp(max=num - 1)) if w.gate_up_proj_bias is not None else None
        gate_up = grouped_linear(rows, w.dense("gate_up_proj", first, num, rows.dtype), group_ends, numerics)
        if w.gate_up_proj_bias is not None:
            gate_up = gate_up + w.gate_up_proj_bias[held]
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "swiglu_oai":
            h = swiglu_oai(gate, up, self.alpha, self.limit)
        else:
            h = self.act(gate) * up
        out = grouped_linear(h, w.dense("down_proj", first, num, h.dtype), group_ends, numerics)
        if w.down_proj_bias is not None:
            out = out + w.down_proj_bias[held]
        return out

    def _combine(self, per_assignment: torch.Tensor, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """[tokens * k, hidden] weighted rows in (token, slot) order -> [tokens, hidden]: a token's k
        slots added in slot order, in float32."""
        # (the width given: a process's share of the tokens may be empty, engine/parallel/world.py)
        per_slot = per_assignment.view(num_tokens, self.top_k, per_assignment.shape[-1])
        total = per_slot[:, 0].float()
        for slot in range(1, self.top_k):
            total = total + per_slot[:, slot]
        return total.to(dtype)

    # ---- expert parallelism ----------------------------------------------------------------------

    def _forward_ep(self, x: torch.Tensor, numerics: Numerics) -> torch.Tensor:
        """Route here, compute each assignment on the rank holding its expert, combine here."""
        ep = self.ep
        assert ep is not None
        num_tokens, k = x.shape[0], self.top_k
        weights, experts = self._route(x, numerics)
        placement, _ = self.counters(x.device)
        slot = placement[experts.flatten()]
        dest = torch.div(slot, self.num_local, rounding_mode="floor")
        dest_sorted, order = torch.sort(dest, stable=True)
        send_counts = torch.zeros(ep.size, dtype=torch.int64, device=x.device)
        send_counts.index_add_(0, dest_sorted, torch.ones_like(dest_sorted))
        back = self._exchange(x[order // k], (slot[order] % self.num_local), send_counts, numerics)
        out = back * weights.flatten()[order, None]
        return self._combine(torch.empty_like(out).index_copy_(0, order, out), num_tokens, x.dtype)

    def _exchange(
        self, rows: torch.Tensor, local_ids: torch.Tensor, send_counts: torch.Tensor, numerics: Numerics
    ) -> torch.Tensor:
        """Sends rows (sorted by destination rank, send_counts per rank) with their experts' local
        slots, computes what this rank receives, returns the results in the rows' order."""
        ep = self.ep
        assert ep is not None
        sends = [int(n) for n in send_counts.tolist()]
        recvs = ep.exchange_counts(send_counts)
        got_rows = ep.all_to_all(rows, sends, recvs)
        self.rows_computed += got_rows.shape[0]
        got_ids = ep.all_to_all(local_ids, sends, recvs)
        sorted_ids, order = torch.sort(got_ids, stable=True)
        out = self._experts_sorted(got_rows[order], sorted_ids, 0, self.num_local, numerics)
        results = torch.empty_like(out).index_copy_(0, order, out)
        return ep.all_to_all(results, recvs, sends)

    def idle_exchange(
        self, hidden_size: int, dtype: torch.dtype, device: torch.device, numerics: Numerics
    ) -> None:
        """This rank's part in an exchange when it has no tokens: its peers wait for it, and it computes
        their rows for its experts (under the engine's numerics, as in a forward)."""
        rows = torch.empty(0, hidden_size, dtype=dtype, device=device)
        ids = torch.empty(0, dtype=torch.int64, device=device)
        assert self.ep is not None
        self._exchange(rows, ids, torch.zeros(self.ep.size, dtype=torch.int64, device=device), numerics)

    def row_functions(self) -> list[tuple[Callable[..., torch.Tensor], list[int]]]:
        """The row-local matmuls forward() runs under the step's numerics, with their input widths (for
        the deterministic-mode probe); every expert has the shapes of expert 0."""
        w = self.experts
        gate_up, down = w.gate_up_proj[0], w.down_proj[0]

        def expert0(name: str, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, w.dense(name, 0, 1, x.dtype)[0])

        fns: list[tuple[Callable[..., torch.Tensor], list[int]]] = [
            (self.router_logits, [self.router_linear.in_features]),
            (partial(expert0, "gate_up_proj"), [gate_up.shape[1]]),
            (partial(expert0, "down_proj"), [down.shape[1]]),
        ]
        if self.shared_experts is not None:
            fns.append((self.shared_experts, [self.router_linear.in_features]))
        return fns
