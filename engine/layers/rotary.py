"""Rotary position embeddings: cos/sin tables per layer type, and rotate_half (the halves pairing)."""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """cos/sin tables per layer type for every position, computed once in float32 then cast as
    transformers does; a step gathers its rows (a gather is exact, so no row depends on the batch)."""

    def __init__(self, inv_freqs: dict[str, tuple[torch.Tensor, float]]) -> None:
        super().__init__()
        self.inv_freqs = inv_freqs
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def build(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(max_positions, device=device).float()
        for t, (inv, scale) in self.inv_freqs.items():
            freqs = positions[:, None] * inv.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.tables[t] = ((emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype))

    def forward(self, positions: torch.Tensor, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables[layer_type]
        return cos[positions], sin[positions]
