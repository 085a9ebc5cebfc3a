"""Configs of the Cosmos3 generator, parsed from the Diffusers checkpoint layout.

A Cosmos3 pipeline folder holds `model_index.json` (pipeline flags), `transformer/config.json`
(diffusers Cosmos3OmniTransformer: both towers, the sound and action towers), `vae/config.json` (the
Wan2.2 VAE), `scheduler/scheduler_config.json` (flow UniPC) and the Qwen tokenizer in `text_tokenizer/`.
Parsers keep what our modules read and refuse options we do not implement, naming the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mstar.models.common.loading import read_config_json
from mstar.models.common.serve_config import checkpoint_dtype
from mstar.models.common.unipc import UniPCConfig


@dataclass(frozen=True)
class Cosmos3TransformerConfig:
    """The MoT generator; defaults are Cosmos3-Nano's (each tower a Qwen3-VL-8B text model)."""

    hidden_size: int = 4096
    head_dim: int = 128
    num_heads: int = 32
    num_kv_heads: int = 8
    intermediate_size: int = 12288
    num_layers: int = 36
    vocab_size: int = 151936
    latent_channel: int = 48  # Wan2.2 VAE latent channels
    latent_patch_size: int = 2  # latent pixels per token side
    rope_theta: float = 5000000.0
    rope_axes_dim: tuple[int, int, int] = (24, 20, 20)  # interleaved mRoPE frequencies on (t, h, w)
    base_fps: float = 24.0
    enable_fps_modulation: bool = True  # video and sound positions in seconds at base_fps, not in frames
    reset_spatial_ids: bool = True  # h, w positions start at 0 for every modality
    modality_margin: int = 15000  # temporal position gap between the text and the generated tokens
    rms_norm_eps: float = 1e-6
    timestep_scale: float = 0.001
    attention_bias: bool = False
    action_dim: int | None = 64  # None: no action tower
    num_embodiment_domains: int = 32
    sound_dim: int | None = 64  # None: no sound tower
    sound_latent_fps: float = 25.0
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if sum(self.rope_axes_dim) * 2 != self.head_dim:
            raise ValueError(f"rope_axes_dim {self.rope_axes_dim} must sum to head_dim/2={self.head_dim // 2}")

    @property
    def patch_dim(self) -> int:
        """Features of one vision token: patch x patch latent pixels of every channel."""
        return self.latent_patch_size**2 * self.latent_channel

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Cosmos3TransformerConfig:
        """Parse a diffusers Cosmos3OmniTransformer config.json; variants we do not run raise, naming the key."""
        unsupported = {"hidden_act": "silu", "qk_norm_for_text": True, "use_und_k_norm_for_gen": False}
        for key, value in unsupported.items():
            if cfg.get(key, value) != value:
                raise ValueError(f"transformer config {key}={cfg[key]!r} is not supported; Cosmos3 Nano and "
                                 f"Super use {key}={value!r}")
        axes = cfg.get("rope_axes_dim") or (cfg.get("rope_scaling") or {}).get("mrope_section") or (24, 20, 20)
        patch = cfg.get("latent_patch_size", 2)
        channels = cfg.get("latent_channel", 48)
        if cfg.get("patch_latent_dim", patch * patch * channels) != patch * patch * channels:
            raise ValueError(f"transformer config patch_latent_dim={cfg['patch_latent_dim']} must be "
                             f"latent_patch_size**2 * latent_channel = {patch * patch * channels}")
        return cls(
            hidden_size=cfg["hidden_size"], head_dim=cfg.get("head_dim", 128), num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"], intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"], latent_channel=channels,
            latent_patch_size=patch, rope_theta=float(cfg.get("rope_theta", 5000000.0)),
            rope_axes_dim=tuple(axes), base_fps=float(cfg.get("base_fps", 24)),
            enable_fps_modulation=bool(cfg.get("enable_fps_modulation", True)),
            reset_spatial_ids=bool(cfg.get("unified_3d_mrope_reset_spatial_ids", True)),
            modality_margin=int(cfg.get("unified_3d_mrope_temporal_modality_margin", 15000)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), timestep_scale=cfg.get("timestep_scale", 0.001),
            attention_bias=bool(cfg.get("attention_bias", False)),
            action_dim=cfg.get("action_dim") if cfg.get("action_gen") else None,
            num_embodiment_domains=cfg.get("num_embodiment_domains", 32),
            sound_dim=cfg.get("sound_dim") if cfg.get("sound_gen") else None,
            sound_latent_fps=float(cfg.get("sound_latent_fps", 25.0)),
            dtype=checkpoint_dtype(cfg),
        )

    def to_hf(self) -> dict[str, Any]:
        """The diffusers config.json dict of this config (round-trips through `from_hf`)."""
        return {
            "_class_name": "Cosmos3OmniTransformer", "hidden_size": self.hidden_size, "head_dim": self.head_dim,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "vocab_size": self.vocab_size, "latent_channel": self.latent_channel,
            "latent_patch_size": self.latent_patch_size, "patch_latent_dim": self.patch_dim,
            "rope_theta": self.rope_theta, "rope_axes_dim": list(self.rope_axes_dim), "base_fps": self.base_fps,
            "enable_fps_modulation": self.enable_fps_modulation,
            "unified_3d_mrope_reset_spatial_ids": self.reset_spatial_ids,
            "unified_3d_mrope_temporal_modality_margin": self.modality_margin, "rms_norm_eps": self.rms_norm_eps,
            "timestep_scale": self.timestep_scale, "attention_bias": self.attention_bias,
            "action_gen": self.action_dim is not None, "action_dim": self.action_dim,
            "num_embodiment_domains": self.num_embodiment_domains, "sound_gen": self.sound_dim is not None,
            "sound_dim": self.sound_dim, "sound_latent_fps": self.sound_latent_fps,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


# Full-size shapes: each tower of Nano is a Qwen3-VL-8B text model, of Super a Qwen3-VL-32B one.
NANO = Cosmos3TransformerConfig()
SUPER = replace(NANO, hidden_size=5120, num_heads=64, intermediate_size=25600, num_layers=64)


@dataclass(frozen=True)
class PipelineFlags:
    """What `model_index.json` sets for the pipeline (Diffusers' Cosmos3OmniPipeline config)."""

    use_system_prompt: bool = True  # prepend the image / video system turn to every prompt
    native_flow_schedule: bool = False  # base sigmas from 1 - 1/T down to 0 instead of 1 down to 1/T

    @classmethod
    def from_file(cls, path: Path) -> PipelineFlags:
        """Read `path` (model_index.json); defaults when the file is missing."""
        if not path.is_file():
            return cls()
        cfg = json.loads(path.read_text())
        return cls(use_system_prompt=bool(cfg.get("default_use_system_prompt", True)),
                   native_flow_schedule=bool(cfg.get("use_native_flow_schedule", False)))


@dataclass(frozen=True)
class Cosmos3Config:
    """The generator side of one Cosmos3 checkpoint (the VAE is configured apart)."""

    transformer: Cosmos3TransformerConfig = NANO
    scheduler: UniPCConfig = UniPCConfig()
    flags: PipelineFlags = PipelineFlags()

    @classmethod
    def from_folder(cls, path: str | Path) -> Cosmos3Config:
        """Read the Diffusers pipeline folder `path` (transformer/, scheduler/, model_index.json)."""
        root = Path(path)
        fix = ("pass a Diffusers-format Cosmos3 folder (e.g. a download of nvidia/Cosmos3-Nano) holding "
               "transformer/, vae/, scheduler/ and text_tokenizer/")
        flags = PipelineFlags.from_file(root / "model_index.json")
        scheduler = UniPCConfig.from_hf(read_config_json(root / "scheduler" / "scheduler_config.json", fix))
        return cls(transformer=Cosmos3TransformerConfig.from_hf(read_config_json(root / "transformer", fix)),
                   scheduler=replace(scheduler, native_flow=flags.native_flow_schedule), flags=flags)
