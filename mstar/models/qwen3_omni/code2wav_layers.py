"""Convolutional blocks of Code2Wav: causal (transposed) convolutions, ConvNeXt, decoder blocks (with SnakeBeta).

All work on [B, channels, time]. Module and parameter names follow the HF checkpoint so weights
map one to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.snake import SnakeBeta


class CausalConv1d(nn.Module):
    """Stride-1 convolution padded on the left only: output t sees inputs <= t; length is kept."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.left_pad = (kernel_size - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.left_pad, 0)))


class CausalTransConv1d(nn.Module):
    """Transposed convolution upsampling by `stride`, `kernel - stride` samples cut from each end.

    With kernel = stride (no overlap) T steps give T * stride samples. With kernel = 2 * stride
    they give (T - 1) * stride: kept sample m mixes input steps m // stride and m // stride + 1, and
    the samples that would need step T are dropped rather than computed from a missing step.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.trim = kernel_size - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return x[..., self.trim: x.shape[-1] - self.trim] if self.trim else x


class ConvNeXtBlock(nn.Module):
    """Depthwise causal conv, LayerNorm, pointwise MLP (GELU), scaled residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).transpose(1, 2))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class ResidualUnit(nn.Module):
    """SnakeBeta, dilated causal conv (k=7), SnakeBeta, 1x1 conv, plus the input."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    """SnakeBeta, transposed conv upsampling by `rate` (halving channels), residual units (dilation 1, 3, 9)."""

    def __init__(self, in_dim: int, rate: int) -> None:
        super().__init__()
        out_dim = in_dim // 2
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalTransConv1d(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, dilation) for dilation in (1, 3, 9)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


class UpsampleStage(nn.ModuleList):
    """[transposed conv by `factor` (kernel = stride: no overlap), ConvNeXt block], as the checkpoint names them."""

    def __init__(self, dim: int, factor: int) -> None:
        super().__init__([CausalTransConv1d(dim, dim, factor, factor), ConvNeXtBlock(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x
