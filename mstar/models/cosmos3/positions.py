"""Where each token of a Cosmos3 sequence sits: 3D mRoPE positions and their rotary tables.

A generator sequence is [text | vision | sound | action]. Text tokens count 0, 1, ... on all three axes;
the generated modalities start `modality_margin` after the text on the temporal axis, side by side in
time. With fps modulation a video's frames (and the sound and action steps) sit at their time in
seconds times the base frame rate, so a clip at another fps keeps the time scale the model learnt.
The arithmetic follows diffusers' Cosmos3 pipeline step for step, so positions agree to the bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mstar.models.cosmos3.config import Cosmos3TransformerConfig


def text_positions(length: int, float_positions: bool) -> torch.Tensor:
    """[3, length]: 0 .. length-1 on every axis (float32 when fps modulation is on, as the reference)."""
    ids = torch.arange(length, dtype=torch.float32 if float_positions else torch.long)
    return ids.unsqueeze(0).expand(3, -1).contiguous()


@dataclass(frozen=True)
class GridTime:
    """How a grid's temporal index becomes a position: frames per second and compression factors."""

    fps: float | None  # None: positions count frames
    base_fps: float = 24.0
    compression: int = 4  # frames per temporal token of this modality
    base_compression: int | None = None  # the compression base_fps refers to (default: `compression`)
    start: int = 0  # index of the first token in its modality's timeline


def grid_positions(grid: tuple[int, int, int], offset: int, time: GridTime, reset_spatial: bool = True) -> torch.Tensor:
    """[3, t*h*w] positions of a (t, h, w) token grid whose first frame sits at temporal `offset`."""
    t, h, w = grid
    if time.fps is not None and t > 1:
        tps = time.fps / time.compression
        base_tps = time.base_fps / (time.base_compression or time.compression)
        frames = torch.arange(t, dtype=torch.float32)
        t_index = ((frames + time.start) / tps * base_tps + offset).view(-1, 1).expand(-1, h * w).flatten()
    else:
        frames = torch.arange(t, dtype=torch.long).view(-1, 1).expand(-1, h * w).flatten()
        t_index = frames + int(offset) + time.start
    h_index = torch.arange(h, dtype=torch.long).view(1, -1, 1).expand(t, -1, w).flatten()
    w_index = torch.arange(w, dtype=torch.long).view(1, 1, -1).expand(t, h, -1).flatten()
    if not reset_spatial:
        h_index, w_index = h_index + int(offset), w_index + int(offset)
    return torch.stack([t_index, h_index.to(t_index.dtype), w_index.to(t_index.dtype)])


@dataclass(frozen=True)
class GenLayout:
    """The generated part of one request's sequence: token grids of each modality it makes."""

    vision: tuple[int, int, int]  # (latent frames, patch rows, patch columns)
    fps: float  # the video's frame rate
    sound_len: int = 0  # sound latent steps; 0: no sound
    action_len: int = 0  # action steps; 0: no actions

    @property
    def num_vision(self) -> int:
        """Vision tokens."""
        return math.prod(self.vision)

    @property
    def num_tokens(self) -> int:
        """All generated tokens: vision, then sound, then actions."""
        return self.num_vision + self.sound_len + self.action_len


def gen_positions(config: Cosmos3TransformerConfig, layout: GenLayout, text_len: int,
                  temporal_compression: int) -> torch.Tensor:
    """[3, layout.num_tokens] positions of the generated tokens after a text of `text_len` tokens."""
    offset = text_len + config.modality_margin
    fps = config.enable_fps_modulation
    parts = [grid_positions(layout.vision, offset, GridTime(layout.fps if fps else None, config.base_fps,
                                                            temporal_compression), config.reset_spatial_ids)]
    if layout.sound_len:
        sound = GridTime(config.sound_latent_fps if fps else None, config.base_fps, 1)
        parts.append(grid_positions((layout.sound_len, 1, 1), offset, sound, config.reset_spatial_ids))
    if layout.action_len:
        action = GridTime(layout.fps if fps else None, config.base_fps, 1, temporal_compression, start=1)
        parts.append(grid_positions((layout.action_len, 1, 1), offset, action, config.reset_spatial_ids))
    # text positions are float32 under fps modulation, so the joint sequence is too
    dtype = torch.float32 if fps or any(p.is_floating_point() for p in parts) else torch.long
    return torch.cat([p.to(dtype) for p in parts], dim=1)


def rope_inv_freq(config: Cosmos3TransformerConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies."""
    d = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def rope_tables(config: Cosmos3TransformerConfig, positions: torch.Tensor, dtype: torch.dtype,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [N, head_dim] of [3, N] positions: frequency i rotates by the temporal position, except
    every third from 1 (height) and from 2 (width) within the first 3 x axes_dim slots (interleaved mRoPE)."""
    inv_freq = rope_inv_freq(config).to(device)
    freqs = positions.to(device).float()[:, :, None] * inv_freq[None, None, :]  # [3, N, half]
    out = freqs[0].clone()
    for axis, first in ((1, 1), (2, 2)):
        index = slice(first, config.rope_axes_dim[axis] * 3, 3)
        out[..., index] = freqs[axis, ..., index]
    emb = torch.cat((out, out), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
