"""The residual down- and up-sampling levels of the Wan2.2 VAE.

Each level adds a parameter-free shortcut that moves pixels into channels (down) or channels into
pixels (up) to the output of its residual blocks and resampler. Temporal resampling is causal and
treats frame 0 of the video apart: the encoder keeps it as its own latent frame and every later group
of 4 frames becomes one latent frame; the decoder mirrors that (1 + 4 (F' - 1) frames out).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from mstar.models.common.wan_vae.vae_layers import CausalConv3d, CausalStream, ResidualBlock


def space_time_to_channels(x: torch.Tensor, out_dim: int, factor_t: int, factor_s: int) -> torch.Tensor:
    """Fold factor_t x factor_s x factor_s cells into channels, then average groups down to `out_dim`.

    The time axis is zero-padded on the past side to a multiple of factor_t (frame 0 pairs with zeros).
    """
    pad_t = -x.shape[2] % factor_t
    x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
    x = rearrange(
        x, "b c (t ft) (h fh) (w fw) -> b (c ft fh fw) t h w", ft=factor_t, fh=factor_s, fw=factor_s
    )
    b, c, t, h, w = x.shape
    return x.view(b, out_dim, c // out_dim, t, h, w).mean(dim=2)


def channels_to_space_time(
    x: torch.Tensor, out_dim: int, factor_t: int, factor_s: int, starts_video: bool
) -> torch.Tensor:
    """Repeat channels up to out_dim x cells, then unfold them into factor_t x factor_s x factor_s cells.

    On the chunk that starts the video, frame 0 yields one frame, not factor_t.
    """
    repeats = out_dim * factor_t * factor_s * factor_s // x.shape[1]
    x = x.repeat_interleave(repeats, dim=1)
    x = rearrange(
        x, "b (c ft fh fw) t h w -> b c (t ft) (h fh) (w fw)", ft=factor_t, fh=factor_s, fw=factor_s
    )
    return x[:, :, factor_t - 1 :] if starts_video else x


def _per_frame(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply a 2D module to every frame of x [B, C, T, H, W]."""
    b = x.shape[0]
    y = conv(rearrange(x, "b c t h w -> (b t) c h w"))
    return rearrange(y, "(b t) c h w -> b c t h w", b=b)


class Downsample(nn.Module):
    """Halve height and width (strided conv); with `temporal`, also halve frames after frame 0."""

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        self.time_conv = nn.Conv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1)) if temporal else None

    def forward(self, x: torch.Tensor, stream: CausalStream | None = None) -> torch.Tensor:
        """[B, C, T, H, W] -> [B, C, T', H/2, W/2]; T' = 1 + (T-1)/2 on the first chunk, T/2 after."""
        x = _per_frame(self.resample, x)
        return self._downsample_time(x, stream) if self.time_conv is not None else x

    def _downsample_time(self, x: torch.Tensor, stream: CausalStream | None) -> torch.Tensor:
        tail = stream.tail(self) if stream is not None else None
        head = None
        if tail is None:  # frame 0 passes through and is the context of the first stride-2 window
            head, x = x[:, :, :1], x[:, :, 1:]
            tail = head
        if x.shape[2] % 2:
            raise ValueError(
                f"a temporal downsampler got {x.shape[2]} frames after frame 0; chunks must hold 4k frames"
            )
        out = self.time_conv(torch.cat([tail, x], dim=2)) if x.shape[2] else x
        if stream is not None:
            stream.set_tail(self, x[:, :, -1:] if x.shape[2] else tail)
        return out if head is None else torch.cat([head, out], dim=2)


class Upsample(nn.Module):
    """Double height and width (nearest + conv); with `temporal`, also double frames after frame 0."""

    def __init__(self, dim: int, out_dim: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(
            nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"), nn.Conv2d(dim, out_dim, 3, padding=1)
        )
        self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1)) if temporal else None

    def forward(self, x: torch.Tensor, stream: CausalStream | None = None) -> torch.Tensor:
        """[B, C, T, H, W] -> [B, out_dim, T', 2H, 2W]; T' = 2T - 1 on the first chunk, 2T after."""
        if self.time_conv is not None:
            x = self._upsample_time(x, stream)
        return _per_frame(self.resample, x)

    def _upsample_time(self, x: torch.Tensor, stream: CausalStream | None) -> torch.Tensor:
        head = None
        if stream is None or stream.starts(self):  # frame 0 stays one frame and is no time context
            head, x = x[:, :, :1], x[:, :, 1:]
        if x.shape[2]:
            x = rearrange(self.time_conv(x, stream), "b (two c) t h w -> b c (t two) h w", two=2)
        return x if head is None else torch.cat([head, x], dim=2)


class ResidualDownBlock(nn.Module):
    """One encoder level: residual blocks, an optional downsampler, and a pixels-to-channels shortcut."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, down: bool) -> None:
        super().__init__()
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nn.ModuleList(ResidualBlock(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.downsampler = Downsample(out_dim, temporal) if down else None
        self.out_dim = out_dim
        self.factor_t = 2 if temporal else 1
        self.factor_s = 2 if down else 1
        factor = self.factor_t * self.factor_s**2
        if in_dim * factor % out_dim:
            raise ValueError(f"level widths {in_dim} -> {out_dim} need in_dim * {factor} divisible by out_dim")

    def forward(self, x: torch.Tensor, stream: CausalStream | None = None) -> torch.Tensor:
        """[B, in_dim, T, H, W] -> [B, out_dim, T', H', W'] (downsampled when the level does)."""
        shortcut = space_time_to_channels(x, self.out_dim, self.factor_t, self.factor_s)
        for resnet in self.resnets:
            x = resnet(x, stream)
        if self.downsampler is not None:
            x = self.downsampler(x, stream)
        return x + shortcut


class ResidualUpBlock(nn.Module):
    """One decoder level: residual blocks, an optional upsampler, and a channels-to-pixels shortcut."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, up: bool) -> None:
        super().__init__()
        dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
        self.resnets = nn.ModuleList(ResidualBlock(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.upsampler = Upsample(out_dim, out_dim, temporal) if up else None
        self.out_dim = out_dim
        self.factor_t = 2 if temporal else 1
        factor = self.factor_t * 4
        if up and out_dim * factor % in_dim:
            raise ValueError(f"level widths {in_dim} -> {out_dim} need out_dim * {factor} divisible by in_dim")

    def forward(self, x: torch.Tensor, stream: CausalStream | None = None) -> torch.Tensor:
        """[B, in_dim, T, H, W] -> [B, out_dim, T', H', W'] (upsampled when the level does)."""
        starts_video = stream is None or stream.starts(self)
        x_in = x
        for resnet in self.resnets:
            x = resnet(x, stream)
        if self.upsampler is None:
            return x
        x = self.upsampler(x, stream)
        return x + channels_to_space_time(x_in, self.out_dim, self.factor_t, 2, starts_video)
