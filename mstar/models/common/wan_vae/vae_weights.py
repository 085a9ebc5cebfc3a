"""Building the Wan2.2 VAE and filling its weights: a Diffusers checkpoint, or seeded dummy weights.

Accepted sources: a Diffusers pipeline folder (its `vae/` subfolder is used), a `vae` folder itself
(config.json + diffusion_pytorch_model*.safetensors), or a Hub repo id such as
Wan-AI/Wan2.2-TI2V-5B-Diffusers (only `vae/` is downloaded). Tensor names need no mapping.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mstar.models.common import loading
from mstar.models.common.meta import build_on_meta
from mstar.models.common.wan_vae.vae import WanVAE
from mstar.models.common.wan_vae.vae_config import WAN22_TI2V_5B_VAE, WanVAEConfig, tiny_vae_config

logger = logging.getLogger(__name__)

VAE_SUBFOLDER = "vae"
_HUB_PATTERNS = (f"{VAE_SUBFOLDER}/*.json", f"{VAE_SUBFOLDER}/*.safetensors")


def build_vae(
    config: WanVAEConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> WanVAE:
    """A `WanVAE` in `dtype` on `device` with UNINITIALISED weights (no float32 copy is ever made)."""
    model = build_on_meta(lambda: WanVAE(config), dtype, device)
    assert isinstance(model, WanVAE)
    return model


def vae_folder(source: str | Path) -> Path:
    """The folder holding the VAE's config.json: `source/vae` for a pipeline, else `source` itself."""
    root = loading.resolve_checkpoint(source, allow_patterns=_HUB_PATTERNS)
    for folder in (root / VAE_SUBFOLDER, root):
        if (folder / "config.json").is_file():
            return folder
    raise loading.CheckpointNotFoundError(
        f"no Wan VAE config.json in {root} or {root / VAE_SUBFOLDER}. Pass a Diffusers Wan2.2 pipeline "
        "folder (e.g. a download of Wan-AI/Wan2.2-TI2V-5B-Diffusers) or its vae/ subfolder."
    )


def load_vae(
    source: str | Path | None = None,
    *,
    load_format: str = "auto",
    config: WanVAEConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> WanVAE:
    """A ready `WanVAE` (eval mode) from a checkpoint (`auto`) or with seeded random weights (`dummy`).

    `config` defaults to the checkpoint's config.json, or for `dummy` without a source to the
    Wan2.2-TI2V-5B VAE. A `config` that disagrees with the checkpoint's fails while loading.
    """
    if load_format not in loading.LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}; choose one of {loading.LOAD_FORMATS}")
    if load_format == "dummy":
        if config is None:
            config = WanVAEConfig.from_file(vae_folder(source)) if source is not None else WAN22_TI2V_5B_VAE
        model = build_vae(config, dtype, device)
        fill_dummy_vae_weights(model, seed)
        return model
    if source is None:
        raise ValueError("load_format='auto' needs a checkpoint: pass source=<folder or repo id>")
    folder = vae_folder(source)
    model = build_vae(config or WanVAEConfig.from_file(folder), dtype, device)
    _, files = loading.weight_files(folder)
    logger.info("loading the Wan VAE from %s", folder)
    loading.load_named_tensors(model, loading.iter_safetensors(files), lambda name: (name, 0))
    return model


def fill_dummy_vae_weights(model: WanVAE, seed: int = 0) -> None:
    """Seeded random weights for benchmarks and offline trials; norm gains are one, as when trained."""
    loading.fill_dummy_weights(model, seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gamma"):  # 4D gains would otherwise be drawn near zero
                param.fill_(1.0)


def deployment_vae_config(checkpoint: Path | None, tiny: bool, latent_channels: int, model: str) -> WanVAEConfig:
    """The VAE config of a deployment of `model`: its checkpoint's, else the tiny or the TI2V-5B one.

    Its latent channels must be `latent_channels` (the denoiser's); ValueError otherwise."""
    if checkpoint is not None:
        config = WanVAEConfig.from_file(vae_folder(checkpoint))
    else:
        config = tiny_vae_config(latent_channels) if tiny else WAN22_TI2V_5B_VAE
    if config.z_dim != latent_channels:
        raise ValueError(f"the VAE has {config.z_dim} latent channels but the {model} denoiser takes "
                         f"{latent_channels}; pass a matching {model} folder")
    return config


def load_deployment_vae(checkpoint: Path | None, config: WanVAEConfig, load_format: str, dtype: torch.dtype,
                        device: torch.device, seed: int) -> WanVAE:
    """The VAE of a deployment: from its checkpoint as `load_format` says, else `config` with seeded random
    weights (the same on every worker)."""
    if checkpoint is not None:
        return load_vae(checkpoint, load_format=load_format, dtype=dtype, device=device, seed=seed)
    return load_vae(load_format="dummy", config=config, dtype=dtype, device=device, seed=seed)
