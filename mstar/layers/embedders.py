"""The embedders of diffusion transformers: sinusoidal timestep features and the two-layer MLP that lifts
them (and Wan2.2's text states) to the model width. Wan2.2's DiT and Cosmos3's generator share both;
parameter names follow their diffusers checkpoints (`linear_1`, `linear_2`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def timestep_features(timestep: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features [N, dim] of timesteps [N] (cos half first, max period 10000), float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    angles = timestep.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class MLP(nn.Module):
    """Linear -> activation ("silu" or "gelu_tanh") -> Linear; the time and text embedders."""

    def __init__(self, in_dim: int, dim: int, act: str) -> None:
        super().__init__()
        self.act = act
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_1(x)
        h = F.silu(h) if self.act == "silu" else F.gelu(h, approximate="tanh")
        return self.linear_2(h)
