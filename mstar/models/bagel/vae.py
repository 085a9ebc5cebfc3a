"""The FLUX autoencoder BAGEL generates in: images [B, 3, H, W] in [-1, 1] <-> latents [B, 16, H/8, W/8].

A GroupNorm ResNet with one self-attention block in the middle of each half. Latents are normalised:
`scale * (mean - shift)` on the way in, and the inverse before decoding. Encoding takes the posterior's
mean (upstream adds a draw from its spread), so an edit depends on its seed through the noise alone.
Module names are the checkpoint's (`ae.safetensors`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.bagel.config import VAEConfig


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = _norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = _norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all pixels of a feature map (1x1 convolutions for q, k, v, out)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v = (nn.Conv2d(channels, channels, 1) for _ in range(3))
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        n = self.norm(x)
        q, k, v = (conv(n).reshape(b, 1, c, h * w).transpose(2, 3) for conv in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # pad right and bottom only, as the checkpoint was trained


class Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Mid(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.block_1, self.attn_1, self.block_2 = ResnetBlock(channels, channels), AttnBlock(channels), \
            ResnetBlock(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Level(nn.Module):
    """One resolution: its ResNet blocks, then (all but the last level) a resampler."""

    def __init__(self, cin: int, cout: int, blocks: int, resample: type[nn.Module] | None, name: str) -> None:
        super().__init__()
        self.block = nn.ModuleList(ResnetBlock(cin if i == 0 else cout, cout) for i in range(blocks))
        if resample is not None:
            setattr(self, name, resample(cout))
        self.resample_name = name if resample is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        return getattr(self, self.resample_name)(x) if self.resample_name else x


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        self.conv_in = nn.Conv2d(3, cfg.ch, 3, padding=1)
        last = len(widths) - 1
        self.down = nn.ModuleList(
            Level(cfg.ch if i == 0 else widths[i - 1], widths[i], cfg.num_res_blocks,
                  Downsample if i < last else None, "downsample") for i in range(len(widths)))
        self.mid = Mid(widths[-1])
        self.norm_out = _norm(widths[-1])
        self.conv_out = nn.Conv2d(widths[-1], 2 * cfg.z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for level in self.down:
            x = level(x)
        return self.conv_out(F.silu(self.norm_out(self.mid(x))))


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        self.conv_in = nn.Conv2d(cfg.z_channels, widths[-1], 3, padding=1)
        self.mid = Mid(widths[-1])
        # up[i] works at level i's resolution (up[0] the finest); the decoder runs them from the last down
        self.up = nn.ModuleList(
            Level(widths[min(i + 1, len(widths) - 1)], widths[i], cfg.num_res_blocks + 1,
                  Upsample if i > 0 else None, "upsample") for i in range(len(widths)))
        self.norm_out = _norm(widths[0])
        self.conv_out = nn.Conv2d(widths[0], 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            x = level(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class FluxVAE(nn.Module):
    """`encode`: images [B, 3, H, W] in [-1, 1] -> normalised latents [B, z, H/8, W/8]; `decode`: back."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder, self.decoder = Encoder(cfg), Decoder(cfg)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        mean = self.encoder(images.to(self.encoder.conv_in.weight.dtype))[:, : self.cfg.z_channels]
        return self.cfg.scale_factor * (mean - self.cfg.shift_factor)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents / self.cfg.scale_factor + self.cfg.shift_factor
        return self.decoder(z.to(self.decoder.conv_in.weight.dtype))
