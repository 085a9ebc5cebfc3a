"""Checkpoint names of Qwen3-Omni's encoders and the entry points that build them loaded.

The HF checkpoint holds the audio encoder under `thinker.audio_tower.` and the vision encoder under
`thinker.visual.`; separate q/k/v projections of the audio layers land at row offsets of our fused
`qkv_proj`. Mappers skip every tensor outside their prefix, so a component streams the whole
(sharded) checkpoint and keeps its own tensors.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from mstar.models.common import loading
from mstar.models.common.meta import build_on_meta
from mstar.models.qwen3_omni.audio_encoder import AudioEncoder
from mstar.models.qwen3_omni.encoder_config import AudioEncoderConfig, VisionEncoderConfig
from mstar.models.qwen3_omni.vision_encoder import VisionEncoder

logger = logging.getLogger(__name__)

E = TypeVar("E", AudioEncoder, VisionEncoder)
AUDIO_PREFIX = "thinker.audio_tower."
VISION_PREFIX = "thinker.visual."


def audio_mapper(config: AudioEncoderConfig, prefix: str = AUDIO_PREFIX) -> loading.NameMapper:
    """Checkpoint name -> (parameter of `AudioEncoder`, row offset), or None for other components."""
    d = config.d_model
    attn = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", d),
        "v_proj": ("qkv_proj", 2 * d),
        "out_proj": ("out_proj", 0),
    }

    def mapper(name: str) -> tuple[str, int] | None:
        if not name.startswith(prefix):
            return None
        name = name[len(prefix) :]
        match = re.fullmatch(r"layers\.(\d+)\.self_attn\.(\w+)\.(weight|bias)", name)
        if match and match.group(2) in attn:
            target, offset = attn[match.group(2)]
            return f"layers.{match.group(1)}.{target}.{match.group(3)}", offset
        return name, 0  # everything else keeps its name; unknown ones are reported by the loader

    return mapper


def vision_mapper(prefix: str = VISION_PREFIX) -> loading.NameMapper:
    """Checkpoint name -> (parameter of `VisionEncoder`, 0), or None for other components."""
    renames = {
        ".attn.qkv.": ".qkv.",
        ".attn.proj.": ".proj.",
        ".mlp.linear_fc1.": ".linear_fc1.",
        ".mlp.linear_fc2.": ".linear_fc2.",
    }

    def mapper(name: str) -> tuple[str, int] | None:
        if not name.startswith(prefix):
            return None
        name = name[len(prefix) :]
        if name.startswith("blocks."):
            for old, new in renames.items():
                name = name.replace(old, new)
        return name, 0

    return mapper


def build_audio_encoder(
    config: AudioEncoderConfig, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> AudioEncoder:
    """An AudioEncoder in `dtype` on `device`, weights UNINITIALISED (fill them next)."""
    return _built(AudioEncoder, config, dtype, device)


def build_vision_encoder(
    config: VisionEncoderConfig, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> VisionEncoder:
    """A VisionEncoder in `dtype` on `device`, weights UNINITIALISED (fill them next)."""
    return _built(VisionEncoder, config, dtype, device)


def _built(cls: type[E], config: Any, dtype: torch.dtype, device: str | torch.device) -> E:
    model = build_on_meta(lambda: cls(config).to(dtype), dtype, device)
    assert isinstance(model, cls)
    return model


def fill_encoder_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Seeded random weights: normal(0, std) matrices and convs, LayerNorms at identity, zero biases.

    Values are drawn in float32 and cast, so a bf16 model gets the rounded weights of the float32 one.
    """
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for param in model.parameters():
            if param.is_meta:
                continue  # no storage to fill (built on the meta device to size or inspect it)
            if param.ndim >= 2:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
                noise = torch.empty(param.shape, dtype=torch.float32, device=param.device)
                param.copy_(noise.normal_(0.0, std, generator=generators[param.device]))
            else:
                param.zero_()
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)


def load_encoder(
    model: nn.Module,
    checkpoint: str | Path | None,
    load_format: str = "auto",
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    progress: bool = True,
) -> nn.Module:
    """Fill `model` (an AudioEncoder or VisionEncoder) from the Qwen3-Omni checkpoint folder or Hub id
    `checkpoint`, from `tensors` (HF names) when given, or with dummy weights; returns `model`."""
    if load_format not in loading.LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {loading.LOAD_FORMATS}")
    if load_format == "dummy":
        fill_encoder_dummy_weights(model)
        return model
    if isinstance(model, AudioEncoder):
        mapper = audio_mapper(model.config)
    elif isinstance(model, VisionEncoder):
        mapper = vision_mapper()
    else:
        raise TypeError(f"load_encoder takes an AudioEncoder or VisionEncoder, got {type(model).__name__}")
    if tensors is None:
        if checkpoint is None:
            raise ValueError("load_encoder needs a checkpoint path (or tensors) unless load_format='dummy'")
        tensors = loading.iter_checkpoint_tensors(loading.resolve_checkpoint(checkpoint), progress=progress)
    loading.load_named_tensors(model, tensors, mapper)
    logger.info("loaded %s from %s", type(model).__name__, checkpoint or "tensors")
    return model
