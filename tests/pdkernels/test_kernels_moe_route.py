"""pdkernels/moe_route.py: the routing kernel against engine/layers/moe.py's torch routers (the same experts in
the same order, weights to float32 rounding, the expert counters), its ties, NaNs and batch invariance,
and the one-program counting sort against torch's stable sort bit for bit. Skipped without CUDA;
TRITON_INTERPRET=1 runs it on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_support import DEVICE, require_triton

require_triton()

from engine.layers.moe import route_softmax_topk, route_topk_softmax  # noqa: E402
from pdkernels import moe_route  # noqa: E402
from pdkernels.moe_gemm import _sort_assignments  # noqa: E402

pytestmark = pytest.mark.cuda


def _torch_sort(ids: torch.Tensor, first: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_gemm's torch path for the assignments' sort."""
    flat = torch.remainder((ids.reshape(-1) - first).clamp(-1, num_local), num_local + 1)
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_local + 1, device=flat.device, dtype=flat.dtype)
    return order, torch.searchsorted(sorted_ids, bounds, out_int32=True)


@pytest.mark.parametrize("softmax_first, norm", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (5, 128, 8), (33, 32, 4), (7, 60, 6)])
def test_route_is_the_torch_routers(softmax_first: bool, norm: bool, num_tokens: int, num_experts: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens * num_experts + top_k)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 3).to(DEVICE)
    counts = torch.full((num_experts,), 5, dtype=torch.int64, device=DEVICE)
    weights, ids = moe_route.route(logits, top_k, norm, softmax_first, counts)
    router = route_softmax_topk if softmax_first else route_topk_softmax
    want_w, want_ids = router(logits.cpu(), top_k, norm)
    assert ids.dtype == torch.int64 and weights.dtype == logits.dtype
    assert torch.equal(ids.cpu(), want_ids)  # the same experts, in descending order of weight
    torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-7)
    assert torch.equal(counts.cpu(), 5 + torch.bincount(want_ids.flatten(), minlength=num_experts))
    # in bf16 (the logits' dtype on a GPU), where equal logits are common: a top-k in descending order,
    # ties to the lower id (torch's order among equals is its own), weights within a bf16 rounding
    w16, ids16 = moe_route.route(logits.bfloat16(), top_k, norm, softmax_first)
    want16_w, want16_ids = router(logits.bfloat16().cpu(), top_k, norm)
    assert w16.dtype == torch.bfloat16
    scores = logits.bfloat16().float().cpu()
    for row, chosen in zip(scores, ids16.cpu().tolist()):
        ranked = sorted(range(num_experts), key=lambda e: (-row[e].item(), e))
        assert chosen == ranked[:top_k]
    by_id = ids16.cpu().argsort(dim=1)
    want_by_id = want16_ids.argsort(dim=1)
    if torch.equal(ids16.cpu().gather(1, by_id), want16_ids.gather(1, want_by_id)):  # the same set
        torch.testing.assert_close(
            w16.cpu().float().gather(1, by_id), want16_w.float().gather(1, want_by_id), rtol=8e-3, atol=1e-4
        )


def test_ties_go_to_the_lower_expert_and_nan_stays_in_range() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], [float("nan"), 0.0, 1.0, 1.0, 0.5, 0.0]], device=DEVICE)
    _, ids = moe_route.route(logits, 3, True, True)
    assert ids[0].tolist() == [1, 2, 4]
    assert ids[1, 0].item() == 0 and ((ids >= 0) & (ids < 6)).all()  # NaN ranks first, as in torch.topk
    _, ids = moe_route.route(logits[:1], 2, False, False)
    assert ids[0].tolist() == [1, 2]
    # every logit -inf: still k distinct experts
    _, ids = moe_route.route(torch.full((1, 6), float("-inf"), device=DEVICE), 3, False, False)
    assert ids[0].tolist() == [0, 1, 2]


def test_a_token_routes_alike_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 64, generator=gen).to(DEVICE, torch.bfloat16)
    for softmax_first in (True, False):
        w_all, ids_all = moe_route.route(logits, 4, True, softmax_first)
        for rows in (slice(0, 1), slice(7, 8), slice(3, 20)):
            w, ids = moe_route.route(logits[rows], 4, True, softmax_first)
            assert torch.equal(w, w_all[rows]) and torch.equal(ids, ids_all[rows])


@pytest.mark.parametrize("num_tokens, top_k, num_experts, first, num_local", [
    (1, 8, 128, 0, 128), (32, 8, 128, 0, 128), (37, 3, 8, 3, 3), (24, 8, 128, 32, 64), (9, 4, 16, 0, 16),
])  # fmt: skip
def test_align_is_torchs_stable_sort(num_tokens: int, top_k: int, num_experts: int, first: int, num_local: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens + first)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    ids[0, 0] = -1  # a padding slot
    ids = ids.to(DEVICE)
    got = moe_route.align(ids, first, num_local)
    assert got is not None
    order, offsets = got
    want_order, want_offsets = _torch_sort(ids, first, num_local)
    assert order.dtype == torch.int64 and offsets.dtype == torch.int32
    assert torch.equal(order.cpu(), want_order.cpu()) and torch.equal(offsets.cpu(), want_offsets.cpu())
    # and moe_gemm takes it
    order2, offsets2 = _sort_assignments(ids, first, num_local)
    assert torch.equal(order2, order) and torch.equal(offsets2, offsets)


def test_align_leaves_many_assignments_to_torch() -> None:
    ids = torch.zeros(moe_route.MAX_ALIGN // 8 + 1, 8, dtype=torch.int64, device=DEVICE)
    assert moe_route.align(ids, 0, 4) is None
    order, offsets = _sort_assignments(ids, 0, 4)  # torch's sort
    assert offsets.tolist() == [0] + [ids.numel()] * 4 and torch.equal(order.cpu(), torch.arange(ids.numel()))
