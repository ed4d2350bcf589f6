"""ModelArch: the shapes and switches of a decoder-only transformer, as the engine's parts read them.

A family module (engine/models/) makes one from its Hugging Face config; the memory, the layers and the
handoff read it. Nothing here knows a family by name.
"""

from __future__ import annotations

from dataclasses import dataclass

# engine/layers/moe.py's router kinds and expert activations (it checks that it implements exactly these)
ROUTING_KINDS = ("softmax_topk", "topk_softmax", "sigmoid_group_topk")
EXPERT_ACTIVATIONS = ("swiglu", "swiglu_oai")
FULL = "full_attention"
SLIDING = "sliding_attention"

# ModelArch.expert_layout, how a checkpoint stores stacked experts (engine/models/loader.py converts):
# "stacked": ours, gate_up_proj [E, 2I, H] gate rows then up rows, down_proj [E, H, I] (or per expert);
# "interleaved": gpt-oss, gate_up_proj [E, H, 2I] with gate/up alternating columns, down_proj [E, I, H]
EXPERT_LAYOUTS = ("stacked", "interleaved")


@dataclass(frozen=True)
class MoEArch:
    """A mixture-of-experts model's experts (engine/layers/moe.py): the layers whose MLP is routed experts (the
    others keep the dense MLP), the router and the experts' activation."""

    sparse_layers: tuple[int, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False  # the top-k routing weights renormalized to sum to 1
    # ROUTING_KINDS: "softmax_topk" (softmax over every expert, top-k), "topk_softmax" (softmax over the top-k
    # logits), "sigmoid_group_topk" (sigmoid scores, e_score_correction_bias for the choice only,
    # num_expert_groups groups of which the topk_groups best are eligible, weights times routed_scaling_factor)
    routing: str = "softmax_topk"
    expert_activation: str = "swiglu"  # EXPERT_ACTIVATIONS
    has_expert_bias: bool = False  # router and expert projections with biases
    swiglu_alpha: float = 1.702  # "swiglu_oai" only
    swiglu_limit: float = 7.0  # "swiglu_oai" only
    expert_layout: str = "stacked"  # EXPERT_LAYOUTS
    num_expert_groups: int = 1  # "sigmoid_group_topk" only: n_group
    topk_groups: int = 1  # "sigmoid_group_topk" only: topk_group
    routed_scaling_factor: float = 1.0  # "sigmoid_group_topk" only
    shared_intermediate_size: int = 0  # a sparse layer's always-on shared experts' width, 0: none

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
            raise ValueError("sparse layers need 1 <= num_experts_per_tok <= num_experts and a moe_intermediate_size")
        if self.num_expert_groups < 1 or not 1 <= self.topk_groups <= self.num_expert_groups:
            raise ValueError("expert groups need 1 <= topk_groups <= num_expert_groups")
        if self.num_experts % self.num_expert_groups:
            raise ValueError(f"{self.num_experts} experts do not split into {self.num_expert_groups} groups")
        for name, value, allowed in (
            ("routing", self.routing, ROUTING_KINDS),
            ("expert_activation", self.expert_activation, EXPERT_ACTIVATIONS),
            ("expert_layout", self.expert_layout, EXPERT_LAYOUTS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: one of {allowed}")


@dataclass(frozen=True)
class LatentArch:
    """Multi-head latent attention (engine/layers/mla.py): K and V come from one kv_lora_rank latent per token
    plus a shared qk_rope_head_dim rotary key; the model's head_dim is then the rotary part's width and its
    attn_scale the softmax scale of the qk_nope + qk_rope dims."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: a plain q_proj, else q_a_proj -> q_a_layernorm -> q_b_proj
    rope_interleave: bool = False  # the rotary dims pair up as (0, 1), (2, 3), ... instead of halves

    def __post_init__(self) -> None:
        if min(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) < 1:
            raise ValueError("latent attention needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim")

    @property
    def qk_head_dim(self) -> int:
        """A query's and an expanded key's width per head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelArch:
    """The shapes every family has, the switches of the shared layers a family turns (engine/models/<family>.py
    sets them), and a family's experts (moe) and latent attention (mla), None where it has none."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    sliding_window: int | None
    hidden_act: str
    attn_scale: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # the shared layers' switches
    attention_bias: bool = False  # q/k/v projections with biases
    qk_norm: bool = False  # an RMSNorm over each head's q and k before the rotary
    unit_offset_norm: bool = False  # RMSNorm scales by (1 + w), computed in float32
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    o_proj_bias: bool = False  # the output projection has a bias too (with attention_bias)
    attn_sinks: bool = False  # a learned logit per head in every softmax's denominator, no value
    # a checkpoint's multi-token-prediction (MTP) layers, model.layers.{num_layers + j}; of those, the first
    # num_mtp_layers are built (engine/models/mtp.py), each one more full layer in the KV pool; the rest skipped
    num_nextn_predict_layers: int = 0
    num_mtp_layers: int = 0
    moe: MoEArch | None = None
    mla: LatentArch | None = None

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError("layer_types must name every layer")
        if self.moe is not None and not all(0 <= i < self.num_layers for i in self.moe.sparse_layers):
            raise ValueError(f"sparse_layers {self.moe.sparse_layers} outside the {self.num_layers} layers")
        m = self.mla
        if m is not None and (self.has_sliding or m.qk_rope_head_dim % 2 or self.head_dim != m.qk_rope_head_dim):
            raise ValueError("latent attention: full-attention layers, an even rotary width, head_dim = qk_rope_head_dim")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if not 0 <= self.num_mtp_layers <= self.num_nextn_predict_layers:
            raise ValueError(
                f"{self.num_mtp_layers} multi-token-prediction layers asked for; the checkpoint has "
                f"num_nextn_predict_layers {self.num_nextn_predict_layers}"
            )

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is routed experts (none for a dense model)."""
        return () if self.moe is None else self.moe.sparse_layers

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    def mtp_cache_index(self, j: int) -> int:
        """MTP layer j's index among the KV pool's full layers: after the model's own."""
        return len(self.full_layers) + j

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == SLIDING]

    @property
    def has_full(self) -> bool:
        return FULL in self.layer_types

    @property
    def has_sliding(self) -> bool:
        return SLIDING in self.layer_types
