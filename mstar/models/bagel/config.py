"""BAGEL shapes: the MoT LLM (llm_config.json), the SigLIP NaViT (vit_config.json), the FLUX VAE and the glue.

The checkpoint folder (ByteDance-Seed/BAGEL-7B-MoT) holds `llm_config.json` (a Qwen2 config: the Qwen2.5-7B
shape), `vit_config.json` (SigLIP so400m, patch 14) and two weight files: `ema.safetensors` (LLM, ViT,
connector and the generation heads) and `ae.safetensors` (the FLUX autoencoder, whose shape is fixed).
BAGEL runs the ViT without its last layer, always with the understanding and generation experts and
qk-norm, whatever the config files say; those choices are made here, once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mstar.layers.siglip import SiglipShape

LLM_CONFIG, VIT_CONFIG = "llm_config.json", "vit_config.json"
EMA_WEIGHTS, VAE_WEIGHTS = "ema.safetensors", "ae.safetensors"


@dataclass(frozen=True)
class LLMConfig:
    """The Qwen2 decoder both experts share the shape of."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_layers: int = 28
    num_heads: int = 28
    num_kv_heads: int = 4
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LLMConfig:
        return cls(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
                   num_heads=cfg["num_attention_heads"], num_kv_heads=cfg.get("num_key_value_heads") or
                   cfg["num_attention_heads"], rope_theta=float(cfg.get("rope_theta", 10000.0)),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)))


BAGEL_VIT = SiglipShape(num_layers=26, image_size=980)  # vit_config.json's 27 layers less the last


def vit_from_hf(cfg: dict[str, Any]) -> SiglipShape:
    """SigLIP's shape from vit_config.json, one layer fewer: BAGEL uses the penultimate layer's output and
    a position table over the `image_size / patch_size` grid, without the pooling head."""
    shape = SiglipShape.from_hf(cfg)
    return replace(shape, num_layers=shape.num_layers - 1)


@dataclass(frozen=True)
class VAEConfig:
    """The FLUX autoencoder (`ae.safetensors`): 8x smaller images with 16 latent channels."""

    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    scale_factor: float = 0.3611
    shift_factor: float = 0.1159

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


@dataclass(frozen=True)
class BagelConfig:
    """Every shape of one BAGEL model and the glue between its parts."""

    llm: LLMConfig = field(default_factory=LLMConfig)
    vit: SiglipShape = BAGEL_VIT
    vae: VAEConfig = field(default_factory=VAEConfig)
    latent_patch_size: int = 2  # VAE latents enter the LLM as 2x2 patches
    max_latent_size: int = 64  # patches per side of the latent position-embedding grid (1024 px)
    vit_max_patches_per_side: int = 70  # of the ViT position-embedding grid the connector's output uses
    timestep_dim: int = 256  # sinusoidal features of a flow timestep

    @property
    def latent_downsample(self) -> int:
        """Pixels per latent patch side (16: the VAE's 8 times the 2x2 patch)."""
        return self.vae.downsample * self.latent_patch_size

    @property
    def patch_latent_dim(self) -> int:
        """Features of one latent patch: 2 * 2 * 16 = 64."""
        return self.latent_patch_size**2 * self.vae.z_channels

    @classmethod
    def from_folder(cls, folder: str | Path, vae: VAEConfig | None = None) -> BagelConfig:
        """Read llm_config.json and vit_config.json of a checkpoint folder (the VAE's shape is fixed)."""
        folder = Path(folder)
        configs = []
        for name in (LLM_CONFIG, VIT_CONFIG):
            path = folder / name
            if not path.is_file():
                raise FileNotFoundError(f"no {name} in {folder}; pass --model-path with a BAGEL-7B-MoT folder "
                                        "(llm_config.json, vit_config.json, ema.safetensors, ae.safetensors)")
            configs.append(json.loads(path.read_text()))
        vit = vit_from_hf(configs[1])
        return cls(llm=LLMConfig.from_hf(configs[0]), vit=vit, vae=vae or VAEConfig(), vit_max_patches_per_side=vit.grid_side)


@dataclass(frozen=True)
class TokenIds:
    """The special tokens BAGEL frames its sequence with."""

    bos: int  # <|im_start|>: opens every text segment and starts a text answer
    eos: int  # <|im_end|>: closes every text segment and ends a text answer
    start_of_image: int  # <|vision_start|>
    end_of_image: int  # <|vision_end|>

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenIds:
        names = {"bos": "<|im_start|>", "eos": "<|im_end|>", "start_of_image": "<|vision_start|>",
                 "end_of_image": "<|vision_end|>"}
        ids = {key: tokenizer.token_to_id(text) for key, text in names.items()}
        missing = [names[k] for k, v in ids.items() if v is None]
        if missing:
            raise ValueError(f"the tokenizer lacks BAGEL's special tokens {missing}; use the checkpoint's tokenizer")
        return cls(**ids)
