"""Checkpoint names of the code predictor and Code2Wav, and builders that load them.

In the HF layout of Qwen3-Omni the code predictor lives under `talker.code_predictor.` (its
transformer under `.model.`, heads under `.lm_head.`), with the talker's codec embedding at
`talker.model.codec_embedding.weight`; Code2Wav lives under `code2wav.`. Our modules fuse q/k/v
and gate/up, so those tensors land at a row offset of the fused parameter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch

from mstar.models.common import loading
from mstar.models.qwen3_omni.code2wav import Code2Wav
from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig
from mstar.models.qwen3_omni.code_predictor import CodePredictor
from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=torch.nn.Module)
CODE_PREDICTOR_PREFIX = "talker.code_predictor."
TALKER_CODEC_EMBEDDING = "talker.model.codec_embedding.weight"
CODE2WAV_PREFIX = "code2wav."
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq", "code_offset")


def _fused_parts(q_size: int, kv_size: int, intermediate: int) -> dict[str, tuple[str, int]]:
    return {
        "self_attn.q_proj.": ("self_attn.qkv_proj.", 0),
        "self_attn.k_proj.": ("self_attn.qkv_proj.", q_size),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", q_size + kv_size),
        "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
        "mlp.up_proj.": ("mlp.gate_up_proj.", intermediate),
    }


def _fuse(name: str, fused: dict[str, tuple[str, int]]) -> tuple[str, int]:
    for part, (target, offset) in fused.items():
        if part in name:
            return name.replace(part, target), offset
    return name, 0


def code_predictor_name_mapper(cfg: CodePredictorConfig) -> loading.NameMapper:
    """HF name -> (CodePredictor parameter, row offset); None for tensors of other components."""
    fused = _fused_parts(cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)

    def mapper(name: str) -> tuple[str, int] | None:
        if name == TALKER_CODEC_EMBEDDING:
            return "talker_codec_embedding.weight", 0
        if not name.startswith(CODE_PREDICTOR_PREFIX) or name.endswith(_IGNORED_SUFFIXES):
            return None
        local = name[len(CODE_PREDICTOR_PREFIX):]
        local = local[len("model."):] if local.startswith("model.") else local
        return _fuse(local, fused)

    return mapper


def code2wav_name_mapper(cfg: Code2WavConfig) -> loading.NameMapper:
    """HF name -> (Code2Wav parameter, row offset); None for tensors of other components."""
    fused = _fused_parts(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)

    def mapper(name: str) -> tuple[str, int] | None:
        if not name.startswith(CODE2WAV_PREFIX) or name.endswith(_IGNORED_SUFFIXES):
            return None
        return _fuse(name[len(CODE2WAV_PREFIX):], fused)

    return mapper


def load_code_predictor(model: CodePredictor, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors (a whole Qwen3-Omni checkpoint is fine) into `model`; ValueError on gaps."""
    loading.load_named_tensors(model, named_tensors, code_predictor_name_mapper(model.cfg))


def load_code2wav(model: Code2Wav, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors (a whole Qwen3-Omni checkpoint is fine) into `model`; ValueError on gaps."""
    loading.load_named_tensors(model, named_tensors, code2wav_name_mapper(model.cfg))


def build_code_predictor(cfg: CodePredictorConfig, checkpoint: Path | None, load_format: str = "auto",
                         dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                         progress: bool = True) -> CodePredictor:
    """A CodePredictor on `device` in `dtype`, weights from `checkpoint` or seeded dummies."""
    return _fill(CodePredictor(cfg).to(device=device, dtype=dtype).eval(), checkpoint, load_format, progress,
                 load_code_predictor)


def build_code2wav(cfg: Code2WavConfig, checkpoint: Path | None, load_format: str = "auto",
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   progress: bool = True) -> Code2Wav:
    """A Code2Wav on `device` in `dtype`, weights from `checkpoint` or seeded dummies."""
    return _fill(Code2Wav(cfg).to(device=device, dtype=dtype).eval(), checkpoint, load_format, progress,
                 load_code2wav)


def _fill(model: M, checkpoint: Path | None, load_format: str, progress: bool, load: Callable[[M, Any], None]) -> M:
    """`model` with seeded dummy weights, or with those of `checkpoint` copied in by `load`."""
    if load_format not in loading.LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {loading.LOAD_FORMATS}")
    if load_format == "dummy":
        loading.fill_dummy_weights(model)
        return model
    if checkpoint is None:
        raise ValueError(f"{type(model).__name__} needs a checkpoint folder with load_format='auto'; "
                         "pass --model-path or use --load-format dummy")
    load(model, loading.iter_checkpoint_tensors(Path(checkpoint), progress=progress))
    logger.info("loaded %s from %s", type(model).__name__, checkpoint)
    return model
