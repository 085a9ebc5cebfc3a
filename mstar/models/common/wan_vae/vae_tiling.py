"""Spatially tiled VAE decoding: overlapping tiles decoded one by one, seams blended linearly.

Peak activation memory then depends on the tile size, not the frame size. The tiling and blending
follow Diffusers' `AutoencoderKLWan.tiled_decode`, so tiled outputs match it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mstar.models.common.wan_vae.vae_config import WanVAEConfig


@dataclass(frozen=True)
class TileSpec:
    """Tile size and stride in output pixels (multiples of the VAE's spatial factor, 16 for Wan2.2).

    Frames no larger than one tile are decoded whole. Tiles overlap by tile - stride pixels.
    """

    tile_height: int = 256
    tile_width: int = 256
    stride_height: int = 192
    stride_width: int = 192

    def check(self, spatial_factor: int) -> None:
        """ValueError naming the field when the spec cannot tile a VAE of this spatial factor."""
        for name in ("tile_height", "tile_width", "stride_height", "stride_width"):
            value = getattr(self, name)
            if value <= 0 or value % spatial_factor:
                raise ValueError(f"TileSpec.{name}={value} must be a positive multiple of {spatial_factor}")
        if self.stride_height > self.tile_height or self.stride_width > self.tile_width:
            raise ValueError(f"TileSpec strides must not exceed the tile size: {self}")


def decode_tiled(
    decode_frames: Callable[[torch.Tensor], torch.Tensor],
    z: torch.Tensor,
    spec: TileSpec,
    config: WanVAEConfig,
) -> torch.Tensor:
    """Latents z [B, C, F', H', W'] -> patchified frames, via `decode_frames` on each tile of z."""
    spec.check(config.scale_factor_spatial)
    s, p = config.scale_factor_spatial, config.patch_size
    tile_h, tile_w = spec.tile_height // s, spec.tile_width // s
    step_h, step_w = spec.stride_height // s, spec.stride_width // s
    height, width = z.shape[-2:]
    if height <= tile_h and width <= tile_w:
        return decode_frames(z)
    out_step_h, out_step_w = spec.stride_height // p, spec.stride_width // p
    blend_h, blend_w = spec.tile_height // p - out_step_h, spec.tile_width // p - out_step_w
    rows = [
        [decode_frames(z[..., i : i + tile_h, j : j + tile_w]) for j in range(0, width, step_w)]
        for i in range(0, height, step_h)
    ]
    for i, row in enumerate(rows):
        for j, tile in enumerate(row):
            if i:
                _blend_into(rows[i - 1][j], tile, blend_h, dim=-2)
            if j:
                _blend_into(row[j - 1], tile, blend_w, dim=-1)
    out = torch.cat(
        [torch.cat([tile[..., :out_step_h, :out_step_w] for tile in row], dim=-1) for row in rows], dim=-2
    )
    return out[..., : height * s // p, : width * s // p]


def _blend_into(before: torch.Tensor, tile: torch.Tensor, extent: int, dim: int) -> None:
    """Fade the first `extent` rows (dim -2) or columns (dim -1) of `tile` in from the end of `before`."""
    extent = min(before.shape[dim], tile.shape[dim], extent)
    if extent <= 0:
        return
    ramp = torch.arange(extent, device=tile.device, dtype=torch.float32) / extent
    ramp = ramp.view(-1, 1) if dim == -2 else ramp
    head = tile.narrow(dim, 0, extent)
    tail = before.narrow(dim, before.shape[dim] - extent, extent)
    head.copy_(tail * (1 - ramp) + head * ramp)
