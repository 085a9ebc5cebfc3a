"""Checkpoint names of the Wan2.2 components and the entry points that build loaded modules.

Diffusers layout: `<root>/text_encoder/` (transformers UMT5EncoderModel safetensors),
`<root>/transformer/` (diffusers WanTransformer3DModel, usually sharded with
diffusion_pytorch_model.safetensors.index.json), `<root>/scheduler/scheduler_config.json`, and the
google/umt5-xxl tokenizer in `<root>/tokenizer/`. Separate q/k/v (and k/v, wi_0/wi_1) tensors land at
row offsets of our fused parameters.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from mstar.models.common import loading
from mstar.models.common.meta import build_on_meta
from mstar.models.common.unipc import UniPCConfig
from mstar.models.wan22.config import UMT5Config, WanTransformerConfig, read_config
from mstar.models.wan22.text_encoder import UMT5Encoder
from mstar.models.wan22.transformer import WanTransformer, build_transformer

logger = logging.getLogger(__name__)

# Diffusers' Wan checkpoints may carry this unused tensor (diffusers ignores it too).
_IGNORED = re.compile(r"norm_added_q\.")
_EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight")  # tied copies of one table


def text_encoder_mapper(config: UMT5Config) -> loading.NameMapper:
    """Maps a transformers UMT5EncoderModel tensor name to (parameter in `UMT5Encoder`, row offset)."""
    inner = config.num_heads * config.d_kv
    parts = {
        "layer.0.SelfAttention.q.": ("qkv.", 0), "layer.0.SelfAttention.k.": ("qkv.", inner),
        "layer.0.SelfAttention.v.": ("qkv.", 2 * inner), "layer.0.SelfAttention.o.": ("o.", 0),
        "layer.0.SelfAttention.relative_attention_bias.": ("rel_bias.", 0),
        "layer.0.layer_norm.": ("attn_norm.", 0), "layer.1.layer_norm.": ("ffn_norm.", 0),
        "layer.1.DenseReluDense.wi_0.": ("gate_up.", 0),
        "layer.1.DenseReluDense.wi_1.": ("gate_up.", config.d_ff),
        "layer.1.DenseReluDense.wo.": ("down.", 0),
    }

    def mapper(name: str) -> tuple[str, int] | None:
        if name in _EMBEDDINGS:
            return "embed.weight", 0
        if name == "encoder.final_layer_norm.weight":
            return "final_norm.weight", 0
        match = re.fullmatch(r"encoder\.block\.(\d+)\.(.+?)(weight|bias)", name)
        if match and match.group(2) in parts:
            target, offset = parts[match.group(2)]
            return f"layers.{match.group(1)}.{target}{match.group(3)}", offset
        return name, 0  # unknown: reported as unexpected by the loader

    return mapper


def transformer_mapper(config: WanTransformerConfig) -> loading.NameMapper:
    """Maps a diffusers WanTransformer3DModel tensor name to (parameter in `WanTransformer`, row offset)."""
    dim = config.dim
    renames = {
        "attn1.to_q.": ("attn1.to_qkv.", 0), "attn1.to_k.": ("attn1.to_qkv.", dim),
        "attn1.to_v.": ("attn1.to_qkv.", 2 * dim), "attn2.to_k.": ("attn2.to_kv.", 0),
        "attn2.to_v.": ("attn2.to_kv.", dim), "attn1.to_out.0.": ("attn1.to_out.", 0),
        "attn2.to_out.0.": ("attn2.to_out.", 0), "ffn.net.0.proj.": ("ffn_in.", 0), "ffn.net.2.": ("ffn_out.", 0),
    }

    def mapper(name: str) -> tuple[str, int] | None:
        if _IGNORED.search(name):
            return None
        name = name.replace("condition_embedder.", "")
        for old, (new, offset) in renames.items():
            if f".{old}" in name:
                return name.replace(old, new), offset
        return name, 0

    return mapper


def _one_embedding(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Drop the second of the tied embedding copies, whichever order the files hold them in."""
    seen = False
    for name, tensor in named:
        if name in _EMBEDDINGS:
            if seen:
                continue
            seen = True
        yield name, tensor


def build_text_encoder(config: UMT5Config, dtype: torch.dtype | None = None,
                       device: str | torch.device = "cpu") -> UMT5Encoder:
    """A UMT5 encoder in `dtype` (the config's by default) on `device`, weights UNINITIALISED."""
    dtype = dtype or config.dtype
    model = build_on_meta(lambda: UMT5Encoder(config).to(dtype), dtype, device)
    assert isinstance(model, UMT5Encoder)
    return model


def load_text_encoder(root: str | Path, load_format: str = "auto", dtype: torch.dtype | None = None,
                      device: str | torch.device = "cpu", progress: bool = True) -> UMT5Encoder:
    """The UMT5 encoder of the pipeline folder or Hub repo `root` (its text_encoder/ sub-folder)."""
    folder = _component_folder(root, "text_encoder")
    model = build_text_encoder(UMT5Config.from_hf(read_config(folder / "config.json")), dtype, device)
    _fill(model, folder, load_format, text_encoder_mapper(model.config), progress, _one_embedding)
    return model


def load_transformer(root: str | Path, load_format: str = "auto", dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu", progress: bool = True,
                     quantization: str | None = None) -> WanTransformer:
    """The video DiT of the pipeline folder or Hub repo `root` (its transformer/ sub-folder); with
    `quantization`, its blocks' linears in FP8, quantized as they load (`build_transformer`)."""
    folder = _component_folder(root, "transformer")
    model = build_transformer(WanTransformerConfig.from_hf(read_config(folder / "config.json")), dtype, device,
                              quantization)
    _fill(model, folder, load_format, transformer_mapper(model.config), progress)
    return model


def load_scheduler_config(root: str | Path) -> UniPCConfig:
    """The scheduler config of the pipeline folder or Hub repo `root` (scheduler/scheduler_config.json)."""
    return UniPCConfig.from_hf(read_config(_component_folder(root, "scheduler") / "scheduler_config.json"))


def _component_folder(root: str | Path, name: str) -> Path:
    folder = loading.resolve_checkpoint(root) / name
    if not folder.is_dir():
        raise loading.CheckpointNotFoundError(
            f"no {name}/ folder in {folder.parent}; pass a Diffusers-format Wan2.2 folder "
            "(e.g. Wan-AI/Wan2.2-TI2V-5B-Diffusers) holding text_encoder/, transformer/ and scheduler/"
        )
    return folder


def _fill(model: nn.Module, folder: Path, load_format: str, mapper: loading.NameMapper, progress: bool,
          filter_fn=None) -> None:
    if load_format not in loading.LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {loading.LOAD_FORMATS}")
    if load_format == "dummy":
        loading.fill_dummy_weights(model)
    else:
        named = loading.iter_component_tensors(folder, progress)
        loading.load_named_tensors(model, filter_fn(named) if filter_fn else named, mapper)
    logger.info("loaded %s (%s) from %s", type(model).__name__, load_format, folder)
