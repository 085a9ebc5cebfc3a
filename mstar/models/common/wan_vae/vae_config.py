"""Config of the Wan2.2 VAE, parsed from a Diffusers `vae/config.json` (`AutoencoderKLWan`).

Only the residual Wan2.2 variant (48 latent channels, 16x spatial and 4x temporal compression, pixels
patchified 2x2 into 12 channels) is supported; the Wan2.1 VAE raises with a clear message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mstar.models.common.loading import read_config_json

logger = logging.getLogger(__name__)

# Per-channel statistics of the Wan2.2 latent space (vae/config.json of Wan-AI/Wan2.2-TI2V-5B-Diffusers).
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip

# config.json keys that do not change inference (training options, Diffusers bookkeeping).
_IGNORED_KEYS = {"dropout", "clip_output", "_class_name", "_diffusers_version", "_name_or_path"}


@dataclass(frozen=True)
class WanVAEConfig:
    """Shape of the Wan2.2 VAE. Field names follow Diffusers' `AutoencoderKLWan` config."""

    base_dim: int = 160  # encoder channels at full resolution
    decoder_base_dim: int = 256  # decoder channels at full resolution
    z_dim: int = 48  # latent channels
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)  # channel multiplier per resolution level
    num_res_blocks: int = 2  # residual blocks per encoder level (the decoder has one more)
    temperal_downsample: tuple[bool, ...] = (False, True, True)  # [sic] Diffusers' spelling
    in_channels: int = 12  # 3 RGB channels x patch_size**2
    out_channels: int = 12
    patch_size: int = 2
    scale_factor_temporal: int = 4
    scale_factor_spatial: int = 16
    latents_mean: tuple[float, ...] = WAN22_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN22_LATENTS_STD

    def __post_init__(self) -> None:
        levels = len(self.dim_mult) - 1
        if len(self.temperal_downsample) != levels:
            raise ValueError(
                f"temperal_downsample {self.temperal_downsample} needs one entry per downsampling level "
                f"({levels} for dim_mult {self.dim_mult})"
            )
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ValueError(
                f"latents_mean/latents_std have {len(self.latents_mean)}/{len(self.latents_std)} entries; "
                f"both need z_dim={self.z_dim}"
            )
        if self.in_channels != 3 * self.patch_size**2 or self.out_channels != self.in_channels:
            raise ValueError(
                f"in_channels={self.in_channels}, out_channels={self.out_channels} do not match RGB patchified "
                f"by patch_size={self.patch_size}; both must be {3 * self.patch_size**2}"
            )
        spatial = self.patch_size * 2**levels
        temporal = 2 ** sum(self.temperal_downsample)
        if (self.scale_factor_spatial, self.scale_factor_temporal) != (spatial, temporal):
            raise ValueError(
                f"scale_factor_spatial={self.scale_factor_spatial}, scale_factor_temporal="
                f"{self.scale_factor_temporal} disagree with the architecture ({spatial}, {temporal})"
            )

    @property
    def temperal_upsample(self) -> tuple[bool, ...]:
        """Temporal upsampling per decoder level: the encoder's downsampling, mirrored."""
        return tuple(reversed(self.temperal_downsample))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> WanVAEConfig:
        """Parse a Diffusers `AutoencoderKLWan` config.json dict; ValueError names unsupported options."""
        if not cfg.get("is_residual", False):
            raise ValueError(
                "is_residual=False is the Wan2.1 VAE, which is not supported; pass the Wan2.2 VAE "
                "(Wan-AI/Wan2.2-TI2V-5B-Diffusers, subfolder vae)"
            )
        if cfg.get("attn_scales"):
            raise ValueError(f"attn_scales={cfg['attn_scales']} is not supported; Wan2.2 uses []")
        fields = set(cls.__dataclass_fields__)
        known = fields | _IGNORED_KEYS | {"is_residual", "attn_scales"}
        if unknown := sorted(set(cfg) - known):
            logger.warning("ignoring unknown Wan VAE config keys %s", unknown)
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in fields}
        kwargs.setdefault("decoder_base_dim", cfg.get("base_dim", cls.base_dim))
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> WanVAEConfig:
        """Read `path` (a config.json, or a folder holding one)."""
        return cls.from_hf(read_config_json(path, "pass the Diffusers `vae` folder of Wan2.2"))

    def to_hf(self) -> dict[str, Any]:
        """The Diffusers config.json dict of this config (round-trips through `from_hf`)."""
        out: dict[str, Any] = {"_class_name": "AutoencoderKLWan", "is_residual": True, "attn_scales": []}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out


WAN22_TI2V_5B_VAE = WanVAEConfig()  # Wan-AI/Wan2.2-TI2V-5B-Diffusers, subfolder vae


def tiny_vae_config(z_dim: int = 8) -> WanVAEConfig:
    """A few-thousand-parameter config with the full architecture (all levels, temporal and spatial)."""
    return WanVAEConfig(
        base_dim=4,
        decoder_base_dim=8,
        z_dim=z_dim,
        num_res_blocks=1,
        # Non-trivial statistics so tests catch a swapped or missing normalisation.
        latents_mean=tuple(0.1 * (i % 5) - 0.2 for i in range(z_dim)),
        latents_std=tuple(0.5 + 0.1 * (i % 7) for i in range(z_dim)),
    )
