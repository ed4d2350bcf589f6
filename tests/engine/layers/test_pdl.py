"""pdkernels/pdl.py's switch: a forward context turns programmatic dependent launch on only where the
device supports it, and restores what was set before (the launches themselves: the GPU kernel tests)."""

from __future__ import annotations

import torch

from pdkernels import pdl


def test_scope_sets_and_restores() -> None:
    assert not pdl.active()
    with pdl.scope(True):
        assert pdl.active()
        with pdl.scope(False):
            assert not pdl.active()
        assert pdl.active()
    assert not pdl.active()


def test_not_on_the_cpu() -> None:
    assert not pdl.supported(torch.device("cpu"))


def test_a_cpu_forward_context_leaves_it_off(tiny_model_dir) -> None:
    from engine.config import ForwardConfig
    from engine.layers.context import forward_context
    from tests.engine_utils import small_engine

    eng = small_engine(tiny_model_dir("llama"))
    with forward_context([], eng.kv, eng.numerics, config=ForwardConfig(pdl=True)):
        assert not pdl.active()
