"""The small embeddings around BAGEL's LLM: flow timesteps, 2D position grids, and latent / pixel patches.

Latent patches: a VAE latent [C, h*p, w*p] becomes h*w rows of p*p*C features, row-major over the
patch grid, each row ordered (patch row, patch column, channel); pixel patches for the ViT use the
same order. A patch at grid (r, c) has the flattened position r * max_side + c (the grid of the
position table, so a smaller image reads the table's top-left corner). Pixels travel to the ViT and VAE
components as uint8 and are mapped to [-1, 1] there (`unit_pixels`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


class TimestepEmbedder(nn.Module):
    """Flow time t in [0, 1] -> [N, hidden]: sinusoidal features (cos then sin), then Linear-SiLU-Linear."""

    def __init__(self, hidden_size: int, frequency_dim: int = 256) -> None:
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class PositionEmbedding(nn.Module):
    """A fixed 2D sine-cosine table [max_side**2, hidden], indexed by flattened grid position."""

    def __init__(self, max_side: int, hidden_size: int) -> None:
        super().__init__()
        self.max_side, self.hidden_size = max_side, hidden_size
        # a parameter (never trained) because the checkpoint stores it
        self.pos_embed = nn.Parameter(torch.zeros(max_side**2, hidden_size), requires_grad=False)

    def reset(self) -> None:
        """Fill the table with its sine-cosine values (what a checkpoint holds; for random weights)."""
        with torch.no_grad():
            self.pos_embed.copy_(sincos_2d(self.hidden_size, self.max_side))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[positions]


def sincos_2d(dim: int, side: int) -> torch.Tensor:
    """[side**2, dim] float32: the first half encodes a cell's column, the second its row (sin then cos each)."""
    rows, cols = np.meshgrid(np.arange(side, dtype=np.float32), np.arange(side, dtype=np.float32), indexing="ij")
    table = np.concatenate([_sincos_1d(dim // 2, cols), _sincos_1d(dim // 2, rows)], axis=1)
    return torch.from_numpy(table).float()


def _sincos_1d(dim: int, positions: np.ndarray) -> np.ndarray:
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    angles = np.einsum("m,d->md", positions.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def grid_positions(rows: int, cols: int, max_side: int) -> torch.Tensor:
    """[rows * cols] int64 flattened positions of a rows x cols patch grid in a max_side-wide table."""
    return (torch.arange(rows)[:, None] * max_side + torch.arange(cols)).flatten()


def patchify(image: torch.Tensor, p: int) -> torch.Tensor:
    """[C, H, W] -> [(H/p) * (W/p), p * p * C], rows over the patch grid, each (patch row, col, channel)."""
    c, h, w = image.shape
    x = image.reshape(c, h // p, p, w // p, p)
    return torch.einsum("chpwq->hwpqc", x).reshape(-1, p * p * c)


def unpatchify(patches: torch.Tensor, rows: int, cols: int, p: int) -> torch.Tensor:
    """The inverse of `patchify`: [rows * cols, p * p * C] -> [C, rows * p, cols * p]."""
    c = patches.shape[-1] // (p * p)
    x = patches.reshape(rows, cols, p, p, c)
    return torch.einsum("hwpqc->chpwq", x).reshape(c, rows * p, cols * p)


def pixel_patches(image: np.ndarray, p: int) -> torch.Tensor:
    """uint8 [H, W, C] -> uint8 [(H/p) * (W/p), p * p * C] in `patchify`'s layout: a fresh buffer, one copy."""
    h, w, c = image.shape
    out = np.empty((h // p * (w // p), p * p * c), np.uint8)
    out.reshape(h // p, w // p, p, p, c)[...] = image.reshape(h // p, p, w // p, p, c).transpose(0, 2, 1, 3, 4)
    return torch.from_numpy(out)


def pixel_values() -> torch.Tensor:
    """float32 [256]: each uint8 value in [-1, 1] as the processor mapped pixels on the host, x / 127.5 - 1
    in float32 ops (a CUDA division by a scalar multiplies by its reciprocal instead: other values)."""
    return torch.arange(256, dtype=torch.float32) / 127.5 - 1.0


def unit_pixels(pixels: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in [-1, 1], same shape: a lookup in `values` (`pixel_values` on the pixels'
    device), which is exact on any device."""
    if pixels.dtype != torch.uint8:
        raise TypeError(f"bagel pixels travel as uint8, got {pixels.dtype}")
    return values.index_select(0, pixels.flatten().int()).view(pixels.shape)
