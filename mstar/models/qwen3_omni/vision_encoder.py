"""Qwen3-Omni's vision encoder: patches of images and video frames -> thinker-width visual tokens.

Patches (C x 2 frames x 16 x 16, laid out in 2x2 merge blocks by `features._patchify`) are embedded
linearly, get a learned position table resampled to each grid plus 2D rotary (row, column) angles,
and run through ViT blocks in which every temporal slice of an input attends only to itself. A patch
merger joins each 2x2 block into one thinker token; deepstack mergers do the same to the outputs of a
few early blocks, which the thinker adds to its first layers' hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.segment_attention import SegmentPlan, segment_attention
from mstar.models.qwen3_omni.encoder_config import VisionEncoderConfig


@dataclass(frozen=True)
class VisionOutput:
    """Merged visual tokens of a packed batch of images/videos, input after input."""

    embeds: torch.Tensor  # [sum(t*h*w) / merge^2, out_hidden_size]
    deepstack: tuple[torch.Tensor, ...]  # one tensor like `embeds` per deepstack_visual_indexes entry


def _gelu(x: torch.Tensor, kind: str) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if kind == "gelu_pytorch_tanh" else "none")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on [T, H, D] in float32 (as the checkpoint's code does), back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]).to(x.dtype)


class VisionBlock(nn.Module):
    """Pre-LayerNorm ViT block: segment attention with 2D rotary, then a GELU MLP."""

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads, self.activation = config.num_heads, config.activation
        self.norm1 = nn.LayerNorm(d, eps=1e-6)
        self.norm2 = nn.LayerNorm(d, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.linear_fc1 = nn.Linear(d, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, d)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        x = x + self.proj(segment_attention(q, k, v, plan).reshape(t, -1))
        return x + self.linear_fc2(_gelu(self.linear_fc1(self.norm2(x)), self.activation))


class PatchMerger(nn.Module):
    """LayerNorm, then an MLP over each 2x2 block of patches (4 * hidden wide) to the thinker width.

    The main merger normalises each patch before joining; deepstack mergers (`postshuffle_norm`)
    normalise the joined block.
    """

    def __init__(self, config: VisionEncoderConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.block_dim = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.ln_q = nn.LayerNorm(self.block_dim if postshuffle_norm else config.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.block_dim, self.block_dim),
            nn.GELU(),
            nn.Linear(self.block_dim, config.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            return self.mlp(self.ln_q(x.reshape(-1, self.block_dim)))
        return self.mlp(self.ln_q(x).reshape(-1, self.block_dim))


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride, applied as one matmul over flattened patches."""

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class VisionEncoder(nn.Module):
    """Vision tower: `forward(pixel_values, grid_thw)` encodes every image/video of a packed batch."""

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.merger_list = nn.ModuleList(
            PatchMerger(config, postshuffle_norm=True) for _ in config.deepstack_visual_indexes
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        """pixel_values [sum(t*h*w), patch_dim], grid_thw [num_inputs, 3] (see `features`) -> VisionOutput."""
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        self._check(pixel_values, grids)
        x = self.patch_embed(pixel_values)
        x = x + self._position_embeddings(grids, x.device).to(x.dtype)
        cos, sin = self._rotary(grids, x.device)
        plan = SegmentPlan([h * w for t, h, w in grids for _ in range(t)], x.device)
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, plan)
            if index in self.config.deepstack_visual_indexes:
                deepstack.append(self.merger_list[self.config.deepstack_visual_indexes.index(index)](x))
        return VisionOutput(embeds=self.merger(x), deepstack=tuple(deepstack))

    def _check(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> None:
        m = self.config.spatial_merge_size
        bad = [g for g in grids if min(g) <= 0 or g[1] % m or g[2] % m]
        if bad:
            raise ValueError(f"vision grids {bad} must be positive with h and w multiples of {m}")
        expected = (sum(t * h * w for t, h, w in grids), self.config.patch_dim)
        if tuple(pixel_values.shape) != expected:
            raise ValueError(
                f"pixel_values shaped {tuple(pixel_values.shape)}; grid_thw {grids} needs {expected}"
            )

    def _block_order(self, grid: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h, w, ...] in raster order -> [h * w, ...] in 2x2 merge-block order (the patch order)."""
        m = self.config.spatial_merge_size
        x = grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2)
        return x.reshape(h * w, *grid.shape[2:])

    def _position_embeddings(self, grids: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """The square learned table bilinearly resampled (corners aligned) to each grid, float32."""
        side = int(round(self.config.num_position_embeddings**0.5))
        table = self.pos_embed.weight.float().view(side, side, -1)
        out = []
        for t, h, w in grids:
            rows, row_w = _bilinear_taps(h, side, device)
            cols, col_w = _bilinear_taps(w, side, device)
            taps = table[rows][:, :, cols]  # [h, 2, w, 2, D]
            weights = row_w[:, :, None, None] * col_w[None, None]  # [h, 2, w, 2]
            grid = (taps * weights[..., None]).sum(dim=(1, 3))  # [h, w, D]
            out.append(self._block_order(grid, h, w).repeat(t, 1))
        return torch.cat(out)

    def _rotary(
        self, grids: list[tuple[int, int, int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [sum(t*h*w), head_dim] float32: a quarter of the head turns with the row, a quarter
        with the column, and the halves repeat (rotate-half convention)."""
        quarter = self.config.head_dim // 2
        inv_freq = 1.0 / (
            self.config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)
        )
        positions = []
        for t, h, w in grids:
            hw = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)
            positions.append(self._block_order(hw, h, w).repeat(t, 1))
        pos = torch.cat(positions).to(device)
        freqs = pos[:, :, None].float() * inv_freq.to(device)  # [N, 2, quarter / 2]
        angles = freqs.reshape(pos.shape[0], -1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def _bilinear_taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For `size` output positions spread over `side` table entries (ends aligned): the two table
    indices [size, 2] each reads and their weights [size, 2]."""
    src = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    low = src.floor()
    frac = src - low
    index = torch.stack([low, low + 1], dim=1).long().clamp(max=side - 1)
    return index, torch.stack([1 - frac, frac], dim=1)
