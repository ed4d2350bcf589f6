"""The parts a model family composes, and what runs them. No module here names a family: a family's
module (engine/models/) picks these parts and their switches.

    context.py     the step's forward context (which rows are which sequence, block tables, numerics)
    numerics.py    how row-local math runs (deterministic mode's fixed row tiles, and the probe)
    meta.py        modules built on the meta device, materialized by the loader
    norm.py        RMSNorm (plain or (1 + w)), activations
    rotary.py      rotary tables per layer type (every rope scaling transformers knows)
    attention.py   attention over the paged pool and the SWA rings (prefill, decode, sinks)
    decode.py      decode rows' static metadata on CUDA and their attention kernel's call
    self_attention.py  the q/k/v projections, q/k norms and rotary of a layer (per-head K and V)
    mla.py         multi-head latent attention (one latent per token in the pages)
    mlp.py         the dense gated MLP
    moe.py         routed experts (three routers, two activations, shared experts)
    eplb.py        moving experts between the ranks of an expert-parallel group
    fp8.py         FP8 block-scaled linears (the format itself: engine/quantization.py)
    linear.py      a step's products: GEMV for few rows, the FP8 paths, the rest through torch
    sampler.py     logit processors and sampling from float32 logits
"""
