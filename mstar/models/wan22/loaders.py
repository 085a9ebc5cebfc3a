"""Building the loaded Wan2.2 text encoder and DiT of a deployment: from its Diffusers folder, or random weights.

Random weights (tiny, or `--load-format dummy`) are seeded, so every worker of a deployment (and
every process) builds the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import torch

from mstar.models.common.loading import fill_dummy_weights
from mstar.models.wan22.text_encoder import UMT5Encoder
from mstar.models.wan22.transformer import WanTransformer

M = TypeVar("M", bound=torch.nn.Module)
_TINY_STD = 0.3  # tiny random weights large enough that prompts and steps visibly change the output


def text_encoder(model: Any, dtype: torch.dtype, device: torch.device) -> UMT5Encoder:
    """The UMT5 encoder of `model` (a Wan22Model) in `dtype` on `device`."""
    from mstar.models.wan22.weights import build_text_encoder, load_text_encoder

    return _loaded(model, load_text_encoder, build_text_encoder, model.components.text_encoder, dtype, device)


def transformer(model: Any, dtype: torch.dtype, device: torch.device) -> WanTransformer:
    """The video DiT of `model` in `dtype` (timestep parts stay float32) on `device`, its blocks' linears in FP8
    where the deployment quantizes "dit"."""
    from mstar.models.wan22.weights import build_transformer, load_transformer

    quantization = model.quantization.get("dit")
    return _loaded(model, partial(load_transformer, quantization=quantization),
                   partial(build_transformer, quantization=quantization), model.components.transformer, dtype, device)


def _loaded(model: Any, load: Callable[..., M], build: Callable[..., M], config: Any, dtype: torch.dtype,
            device: torch.device) -> M:
    """`load` from the deployment's checkpoint, else `build` from `config` with seeded random weights."""
    if model.checkpoint is not None:
        return load(model.checkpoint, model.load_format, dtype, device)
    module = build(config, dtype, device)
    _fill(module, model.config)
    return module


def _fill(module: torch.nn.Module, config: Any) -> None:
    fill_dummy_weights(module, seed=config.seed, std=_TINY_STD if config.tiny else 0.02)
