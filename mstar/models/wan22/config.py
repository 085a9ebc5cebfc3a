"""Configs of the Wan2.2-TI2V-5B components, parsed from the Diffusers checkpoint layout.

The pipeline folder holds one sub-folder per component: `text_encoder/config.json` (transformers
UMT5EncoderModel), `transformer/config.json` (diffusers WanTransformer3DModel) and
`scheduler/scheduler_config.json` (diffusers UniPCMultistepScheduler). Each parser keeps only what our
modules need and rejects options we do not implement, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar.models.common.loading import read_config_json
from mstar.models.common.serve_config import checkpoint_dtype
from mstar.models.common.unipc import UniPCConfig

TEXT_LENGTH = 512  # Wan pads and truncates every prompt to 512 tokens (max_sequence_length)


@dataclass(frozen=True)
class UMT5Config:
    """The UMT5 encoder stack (google/umt5-xxl for Wan: 24 layers, d_model 4096, 64 heads)."""

    vocab_size: int = 256384
    d_model: int = 4096
    d_kv: int = 64  # per-head size; heads * d_kv need not equal d_model
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    dtype: torch.dtype = torch.bfloat16  # the checkpoint's dtype; the default serving dtype

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> UMT5Config:
        """Parse a transformers UMT5 config.json dict; only the gated-GELU encoder is supported."""
        act = cfg.get("feed_forward_proj", "gated-gelu")
        if act != "gated-gelu":
            raise ValueError(f"text encoder feed_forward_proj {act!r} is not supported; only 'gated-gelu' (UMT5)")
        return cls(
            vocab_size=cfg["vocab_size"],
            d_model=cfg["d_model"],
            d_kv=cfg["d_kv"],
            d_ff=cfg["d_ff"],
            num_layers=cfg["num_layers"],
            num_heads=cfg["num_heads"],
            relative_attention_num_buckets=cfg.get("relative_attention_num_buckets", 32),
            relative_attention_max_distance=cfg.get("relative_attention_max_distance", 128),
            layer_norm_epsilon=cfg.get("layer_norm_epsilon", 1e-6),
            dtype=checkpoint_dtype(cfg),
        )


@dataclass(frozen=True)
class WanTransformerConfig:
    """The Wan video DiT; defaults are TI2V-5B (hidden 3072 = 24 heads x 128, 30 layers, 48 channels)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)  # (frames, height, width) per token
    num_heads: int = 24
    head_dim: int = 128
    in_channels: int = 48
    out_channels: int = 48
    text_dim: int = 4096
    freq_dim: int = 256  # sinusoidal timestep features
    ffn_dim: int = 14336
    num_layers: int = 30
    cross_attn_norm: bool = True
    eps: float = 1e-6
    rope_theta: float = 10000.0
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.head_dim % 2 or self.head_dim < 6:
            # rope splits the head into (frames, height, width) parts, each of even size
            raise ValueError(f"attention_head_dim must be even and >= 6 for the 3D rope, got {self.head_dim}")

    @property
    def dim(self) -> int:
        """The hidden size (heads x head_dim)."""
        return self.num_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> WanTransformerConfig:
        """Parse a diffusers WanTransformer3DModel config.json; image-embedding (Wan2.1 I2V) is rejected."""
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if cfg.get(key) is not None:
                raise ValueError(f"transformer config {key}={cfg[key]!r} is not supported (Wan2.1 image "
                                 "conditioning); TI2V-5B conditions on the first latent frame instead")
        qk_norm = cfg.get("qk_norm", "rms_norm_across_heads")
        if qk_norm != "rms_norm_across_heads":
            raise ValueError(f"transformer config qk_norm={qk_norm!r} is not supported; "
                             "only 'rms_norm_across_heads'")
        return cls(
            patch_size=tuple(cfg.get("patch_size", (1, 2, 2))),
            num_heads=cfg["num_attention_heads"],
            head_dim=cfg["attention_head_dim"],
            in_channels=cfg["in_channels"],
            out_channels=cfg.get("out_channels") or cfg["in_channels"],
            text_dim=cfg["text_dim"],
            freq_dim=cfg.get("freq_dim", 256),
            ffn_dim=cfg["ffn_dim"],
            num_layers=cfg["num_layers"],
            cross_attn_norm=bool(cfg.get("cross_attn_norm", True)),
            eps=cfg.get("eps", 1e-6),
            dtype=checkpoint_dtype(cfg),
        )


@dataclass(frozen=True)
class Wan22Config:
    """The three denoising-side components of one Wan2.2 checkpoint (the VAE is configured apart)."""

    text_encoder: UMT5Config = UMT5Config()
    transformer: WanTransformerConfig = WanTransformerConfig()
    scheduler: UniPCConfig = UniPCConfig()
    text_length: int = TEXT_LENGTH

    @classmethod
    def from_folder(cls, path: str | Path) -> Wan22Config:
        """Read the Diffusers pipeline folder `path` (text_encoder/, transformer/, scheduler/)."""
        root = Path(path)
        return cls(
            text_encoder=UMT5Config.from_hf(read_config(root / "text_encoder" / "config.json")),
            transformer=WanTransformerConfig.from_hf(read_config(root / "transformer" / "config.json")),
            scheduler=UniPCConfig.from_hf(read_config(root / "scheduler" / "scheduler_config.json")),
        )


def read_config(path: Path) -> dict[str, Any]:
    """The JSON dict at `path`; FileNotFoundError says which Diffusers sub-folder is missing."""
    return read_config_json(path, "pass a Diffusers-format Wan2.2 folder (e.g. a download of "
                            "Wan-AI/Wan2.2-TI2V-5B-Diffusers) holding text_encoder/, transformer/ and scheduler/")


