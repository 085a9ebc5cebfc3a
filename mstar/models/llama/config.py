"""Config of the dense decoder family (Llama, Qwen2, Qwen3), parsed from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mstar.layers.rope import RopeSpec
from mstar.models.common.loading import read_config_json
from mstar.models.common.serve_config import checkpoint_dtype

# model_type -> the HF architecture name it must be loaded as.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class LlamaConfig:
    """Everything the dense decoder needs; build it with `LlamaConfig.from_hf(config_dict)`."""

    model_type: str  # "llama", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeSpec = field(default_factory=lambda: RopeSpec(head_dim=64))
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (always on for Qwen2)
    o_bias: bool = False  # bias on the output projection (`attention_bias` of Llama/Qwen3)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3 q_norm/k_norm
    dtype: torch.dtype = torch.bfloat16  # the checkpoint's dtype; the default serving dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported_message(self.model_type))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a positive multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rope.head_dim != self.head_dim:
            raise ValueError(f"rope head_dim {self.rope.head_dim} != head_dim {self.head_dim}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Parse a HF config.json dict; raises ValueError naming the field for unsupported options."""
        model_type = _model_type(cfg)
        if cfg.get("use_sliding_window"):
            raise ValueError(
                f"{model_type}: use_sliding_window=True is not supported; use a full-attention model"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; only 'silu'")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope_spec(cfg, head_dim),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            dtype=checkpoint_dtype(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """Read `path` (a config.json, or a folder holding one)."""
        return cls.from_hf(read_config_json(path, "pass a Hugging Face checkpoint folder"))


def _unsupported_message(model_type: object) -> str:
    supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
    return f"unsupported model_type {model_type!r}; supported: {supported}"


def _model_type(cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type is None:  # some exported configs only name the architecture
        by_arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        model_type = next((by_arch[a] for a in cfg.get("architectures") or [] if a in by_arch), None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(_unsupported_message(model_type or cfg.get("architectures")))
    return model_type


def _rope_spec(cfg: dict[str, Any], head_dim: int) -> RopeSpec:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return RopeSpec(
        head_dim=head_dim,
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


