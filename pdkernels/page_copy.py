"""Copies a list of pages (or SWA state slots) between two pools of the same layout, typically the
GPU KV pool and the pinned host pool of the prefix cache. Pools are unit-major, so one unit (a page
of every full layer, or one state slot) is one contiguous run of bytes.

On CUDA, one kernel launch moves every listed unit: each thread block copies 16-byte words of one
unit, reading or writing pinned host memory through its mapped (UVA) address, so there is no
staging copy and no launch per page. It is compiled on first use through cupy (the `cuda` extra).
Elsewhere, or without cupy, the torch path does one gather and one scatter.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

_SOURCE = r"""
extern "C" __global__ void copy_units(const int4* __restrict__ src, int4* __restrict__ dst,
                                      const long long* __restrict__ src_ids,
                                      const long long* __restrict__ dst_ids, long long unit_words) {
    const long long u = blockIdx.y;
    const int4* s = src + src_ids[u] * unit_words;
    int4* d = dst + dst_ids[u] * unit_words;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < unit_words;
         i += (long long)gridDim.x * blockDim.x) {
        d[i] = s[i];
    }
}
"""
_THREADS = 256


@cache
def _cuda_kernel() -> Any | None:
    try:
        import cupy
    except ImportError:
        return None
    return cupy.RawKernel(_SOURCE, "copy_units")


def _is_uva_pair(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """One side on a CUDA device, the other on it too or in pinned host memory."""
    devs = {t.device.type for t in (src, dst)}
    if "cuda" not in devs:
        return False
    return all(t.is_cuda or t.is_pinned() for t in (src, dst))


def copy_units(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> int:
    """dst[dst_ids[i]] = src[src_ids[i]] for every i; returns the bytes moved.

    NOTE: on CUDA the copy is queued on the current stream; a host reader of dst must wait for it.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError("src_ids and dst_ids differ in length")
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"pool layouts differ: {tuple(src.shape[1:])} {src.dtype} vs {tuple(dst.shape[1:])} {dst.dtype}")
    if not src_ids:
        return 0
    unit_bytes = src[0].numel() * src.element_size()
    kernel = _cuda_kernel() if _is_uva_pair(src, dst) else None
    if kernel is not None and unit_bytes % 16 == 0 and src.is_contiguous() and dst.is_contiguous():
        _launch(kernel, src, src_ids, dst, dst_ids, unit_bytes // 16)
    else:
        s_idx = torch.tensor(src_ids, dtype=torch.long, device=src.device)
        d_idx = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
        dst.index_copy_(0, d_idx, src.index_select(0, s_idx).to(dst.device, non_blocking=True))
    return len(src_ids) * unit_bytes


def _launch(kernel: Any, src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int], words: int) -> None:
    import cupy

    device = src.device if src.is_cuda else dst.device
    ids = torch.tensor([src_ids, dst_ids], dtype=torch.int64).pin_memory().to(device, non_blocking=True)
    stream = torch.cuda.current_stream(device)
    blocks_x = min(max(1, words // (_THREADS * 4)), 64)
    with cupy.cuda.Device(device.index or 0), cupy.cuda.ExternalStream(stream.cuda_stream):
        kernel(
            (blocks_x, len(src_ids)),
            (_THREADS,),
            (
                cupy.uint64(src.data_ptr()),
                cupy.uint64(dst.data_ptr()),
                cupy.uint64(ids[0].data_ptr()),
                cupy.uint64(ids[1].data_ptr()),
                cupy.int64(words),
            ),
        )
