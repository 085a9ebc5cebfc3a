"""Checkpoint names of the dense decoder family and the entry point that builds a loaded model.

HF checkpoints store q/k/v and gate/up as separate tensors; the model fuses each group into one
parameter (`qkv_proj`, `gate_up_proj`), so those tensors land at a row offset of the fused one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from mstar.layers.fp8 import method_block, quantize_linears
from mstar.models.common import loading
from mstar.models.common.fp8_checkpoint import Fp8Format, fp8_format, load_fp8_checkpoint
from mstar.models.llama.config import LlamaConfig
from mstar.models.llama.model import LlamaForCausalLM, build_model

logger = logging.getLogger(__name__)

# Buffers some exporters save; the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def name_mapper(config: LlamaConfig) -> loading.NameMapper:
    """Maps an HF tensor name to (parameter name, row offset) in `LlamaForCausalLM`, None to skip."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_size),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", config.intermediate_size),
    }

    def mapper(name: str) -> tuple[str, int] | None:
        if name.endswith(_IGNORED_SUFFIXES):
            return None
        if name == "lm_head.weight" and config.tie_word_embeddings:
            return None  # tied: the embedding is the head; some checkpoints still save a copy
        for part, (target, offset) in fused.items():
            if f".{part}." in name:
                return name.replace(part, target), offset
        return name, 0

    return mapper


def load_weights(model: LlamaForCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into `model`; ValueError on unexpected names or unfilled parameters."""
    loading.load_named_tensors(model, named_tensors, name_mapper(model.config))


def quantize_decoder(model: LlamaForCausalLM, quantization: str) -> None:
    """FP8 weights for every linear of the decoder layers; the embedding, norms and head stay as they are."""
    layers = quantize_linears(model.model.layers, method_block(quantization))
    logger.info("quantized %d linear layers to %s", len(layers), quantization)


def _fp8_format(path: Path) -> Fp8Format | None:
    """The FP8 format a checkpoint folder's config.json declares (None: unquantized, or a GGUF file)."""
    return fp8_format(json.loads((path / "config.json").read_text())) if (path / "config.json").is_file() else None


def load_config(path: Path) -> LlamaConfig:
    """The config of a checkpoint folder (config.json) or of a GGUF file (its metadata)."""
    if (path / "config.json").is_file():
        return LlamaConfig.from_hf(json.loads((path / "config.json").read_text()))
    kind, files = loading.weight_files(path)
    if kind != "gguf":
        raise FileNotFoundError(f"no config.json in {path}; a safetensors checkpoint folder needs one")
    from mstar.models.common.gguf_checkpoint import gguf_hf_config

    return LlamaConfig.from_hf(gguf_hf_config(files[0]))


def load_model(
    path_or_repo_id: str | Path,
    load_format: str = "auto",
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Build a model from a checkpoint folder, GGUF file or Hub repo id, weights loaded.

    `load_format="dummy"` still reads config.json but fills seeded random weights instead of reading
    the weight files. `dtype` defaults to the checkpoint's. An FP8 checkpoint (`fp8_checkpoint`) loads
    as it is; otherwise `quantization` ("fp8", "fp8_block") quantizes the decoder layers' linears on load,
    each as its weight is read (`build_model`): no full-precision copy of them is made on `device`.
    """
    if load_format not in loading.LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {loading.LOAD_FORMATS}")
    path = loading.resolve_checkpoint(path_or_repo_id)
    config = load_config(path)
    fmt = _fp8_format(path) if load_format != "dummy" else None
    model = build_model(config, dtype=dtype, device=device, quantization=quantization if fmt is None else None)
    if load_format == "dummy":
        loading.fill_dummy_weights(model)
    elif fmt is not None:
        layers = load_fp8_checkpoint(model, path, fmt, name_mapper(config), progress=progress)
        logger.info("loaded %d FP8 layers of %s as they are%s", len(layers), path,
                    f" (quantization {quantization!r} not applied)" if quantization else "")
    else:
        load_weights(model, loading.iter_checkpoint_tensors(path, progress=progress))
    logger.info("loaded %s (%s) from %s as %s", config.model_type, load_format, path, model.kv_layout.dtype)
    return model
