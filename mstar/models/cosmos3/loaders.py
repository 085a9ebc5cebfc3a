"""Building the loaded Cosmos3 generator of one deployment: from its Diffusers folder, or random weights.

Random weights (tiny, or `--load-format dummy`) are seeded, so every worker of a deployment (and every
process) builds the same model. The VAE is Wan2.2's, loaded by `common.wan_vae.vae_weights`.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.models.common.loading import fill_dummy_weights
from mstar.models.cosmos3.transformer import Cosmos3Generator


def generator(model: Any, dtype: torch.dtype, device: torch.device) -> Cosmos3Generator:
    """The generator of `model` (a Cosmos3Model) in `dtype` (the timestep embedder float32) on `device`."""
    from mstar.models.cosmos3.weights import build_generator, load_generator

    if model.checkpoint is not None:
        return load_generator(model.checkpoint, model.load_format, dtype, device)
    module = build_generator(model.components.transformer, dtype, device)
    fill_dummy_weights(module, seed=model.config.seed, std=model.tiny_std)
    return module
