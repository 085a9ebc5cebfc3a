"""Multimodal rotary position embedding (M-RoPE) of Qwen3-Omni: three position rows (time, height, width).

Each rotary frequency takes its angle from one of the three rows. With `interleaved` (Qwen3-Omni)
the frequencies cycle t, h, w, t, h, w, ... until the h and w sections are used up, the rest going
to t; without it (Qwen2-VL style) the first `sections[0]` frequencies use t, the next h, then w.
Text tokens have three equal rows, which reduces to ordinary RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MRopeSpec:
    """Rotary frequencies and how they are split over the (t, h, w) position rows."""

    head_dim: int
    theta: float = 1_000_000.0
    sections: tuple[int, int, int] = (24, 20, 20)  # frequencies per row; sum = head_dim // 2
    interleaved: bool = True

    def __post_init__(self) -> None:
        if self.head_dim % 2 or sum(self.sections) != self.head_dim // 2:
            raise ValueError(f"mrope_section {list(self.sections)} must sum to head_dim // 2 = "
                             f"{self.head_dim // 2} (head_dim {self.head_dim})")


def row_of_frequency(spec: MRopeSpec) -> torch.Tensor:
    """Long [head_dim // 2]: which position row (0 = t, 1 = h, 2 = w) drives each frequency."""
    half = spec.head_dim // 2
    if not spec.interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(spec.sections))
    rows = torch.zeros(half, dtype=torch.long)
    for row in (1, 2):
        rows[row : spec.sections[row] * 3 : 3] = row
    return rows


class MRotaryEmbedding(nn.Module):
    """positions [T] or [3, T] (int or float) -> (cos, sin) [T, head_dim] float32, for `apply_rotary`."""

    def __init__(self, spec: MRopeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.register_buffer("rows", row_of_frequency(spec), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        d = self.spec.head_dim
        return 1.0 / (self.spec.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # `model.to(bfloat16)` would round the frequencies; keep them float32 on whatever device.
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)
        self.rows = row_of_frequency(self.spec).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        # angle[t, f] = position[row(f), t] * inv_freq[f]: one multiply, as the reference's float32 matmul
        freqs = positions.float()[self.rows].T * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
