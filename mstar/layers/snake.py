"""SnakeBeta, the periodic activation of the Qwen3-Omni Code2Wav and Cosmos3 AVAE audio decoders.

x + sin^2(x * e^alpha) / e^beta per channel on [B, channels, time]; parameter names follow both checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.layers.fused import FUSED


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel (alpha, beta stored in log scale).

    On CUDA (fused kernels on, x contiguous) one Triton kernel (`kernels/snake.py`) computes it in float32
    and rounds once; the PyTorch form (CPU, kernels off) is five passes, rounding after each.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.is_contiguous() and FUSED.ops_for(x) is not None:
            from mstar.kernels.snake import snake_beta

            return snake_beta(x, self.alpha, self.beta)
        alpha = self.alpha.exp()[None, :, None]
        inv_beta = 1.0 / (self.beta.exp()[None, :, None] + 1e-9)
        return x + inv_beta * torch.sin(x * alpha).pow(2)
