"""GPU kernels against plain torch references (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from pdkernels.page_copy import _cuda_kernel, copy_units

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
@pytest.mark.parametrize("unit_shape", [(3, 2, 128, 1, 256), (4, 2, 16, 8, 128), (2, 2, 24, 2, 64)])
def test_copy_units_matches_torch(direction: str, unit_shape: tuple[int, ...]) -> None:
    assert _cuda_kernel() is not None, "cupy is needed for the CUDA copy kernel"
    gen = torch.Generator().manual_seed(hash((direction, unit_shape)) % 2**31)
    n_src, n_dst = 40, 50
    src = torch.randn((n_src, *unit_shape), generator=gen).to(torch.bfloat16)
    dst = torch.full((n_dst, *unit_shape), float("nan"), dtype=torch.bfloat16)  # poisoned
    if direction in ("d2h", "d2d"):
        src = src.cuda()
    else:
        src = src.pin_memory()
    dst = dst.cuda() if direction in ("h2d", "d2d") else dst.pin_memory()
    for _ in range(3):
        k = int(torch.randint(1, n_src, (1,), generator=gen))
        src_ids = torch.randperm(n_src, generator=gen)[:k].tolist()
        dst_ids = torch.randperm(n_dst, generator=gen)[:k].tolist()
        expect = dst.cpu().clone()
        expect[dst_ids] = src.cpu()[src_ids]
        moved = copy_units(src, src_ids, dst, dst_ids)
        torch.cuda.synchronize()
        assert moved == k * src[0].numel() * 2
        got = dst.cpu()
        assert torch.equal(got.isnan(), expect.isnan())  # untouched rows stay poisoned, written rows are clean
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(expect))
