"""Copies a list of pages (or SWA state slots) between two pools of the same layout, typically the
GPU KV pool and the pinned host pool of the prefix cache. Rows are whole units: pools are laid out
unit-major, so one unit is one contiguous run of bytes.

The torch path (CPU, and any device pair) is one gather and one scatter. On CUDA the gather runs
on the GPU and reaches pinned host memory through its mapped address, without a staging copy.
"""

from __future__ import annotations

import torch


def copy_units(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> int:
    """dst[dst_ids[i]] = src[src_ids[i]] for every i; returns the bytes moved."""
    if len(src_ids) != len(dst_ids):
        raise ValueError("src_ids and dst_ids differ in length")
    if not src_ids:
        return 0
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"pool layouts differ: {tuple(src.shape[1:])} {src.dtype} vs {tuple(dst.shape[1:])} {dst.dtype}")
    s_idx = torch.tensor(src_ids, dtype=torch.long, device=src.device)
    d_idx = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
    rows = src.index_select(0, s_idx)
    dst.index_copy_(0, d_idx, rows.to(dst.device, non_blocking=True))
    return rows.numel() * rows.element_size()
