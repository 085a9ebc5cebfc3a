"""Config of the Qwen3-Omni code predictor: the small dense transformer that fills codebooks 1..G-1.

Read from the HF `talker_config` dict (its `code_predictor_config`, plus the talker's codec
vocabulary, whose embedding of the frame's first code the predictor needs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar.models.common.hf_config import from_hf_fields, rope_theta


@dataclass(frozen=True)
class CodePredictorConfig:
    """Shapes of the code predictor; `full()` is Qwen3-Omni-30B-A3B's, `tiny()` is for tests."""

    vocab_size: int = 2048  # entries per residual codebook
    hidden_size: int = 1024  # equals the talker's hidden size (the talker state is its first input)
    intermediate_size: int = 3072
    num_layers: int = 5
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    num_code_groups: int = 16  # codebooks per frame, the first one from the talker
    attention_bias: bool = False
    talker_vocab_size: int = 3072  # the talker's codec vocabulary (first code of a frame)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_code_groups < 2:
            raise ValueError(f"num_code_groups must be >= 2, got {self.num_code_groups}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_residual(self) -> int:
        """Codebooks the predictor generates per frame (all but the talker's first)."""
        return self.num_code_groups - 1

    @classmethod
    def full(cls) -> CodePredictorConfig:
        """Qwen3-Omni-30B-A3B's code predictor."""
        return cls()

    @classmethod
    def tiny(cls, **overrides: Any) -> CodePredictorConfig:
        """A few-kilobyte config with the real structure (GQA, 16 code groups)."""
        base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, rope_theta=10000.0, num_code_groups=16, talker_vocab_size=96)
        return cls(**{**base, **overrides})

    @classmethod
    def from_hf(cls, talker_config: Mapping[str, Any]) -> CodePredictorConfig:
        """From the HF `talker_config` dict (config.json of Qwen3OmniMoeForConditionalGeneration)."""
        cp = talker_config.get("code_predictor_config") or {}
        text = talker_config.get("text_config") or {}
        heads = int(cp.get("num_attention_heads", cls.num_heads))
        config = from_hf_fields(
            cls, cp, {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"},
            num_kv_heads=int(cp.get("num_key_value_heads") or heads),
            head_dim=int(cp.get("head_dim") or int(cp.get("hidden_size", cls.hidden_size)) // heads),
            rope_theta=rope_theta(cp, "code predictor"),
            num_code_groups=int(cp.get("num_code_groups", talker_config.get("num_code_groups", 32))),
            talker_vocab_size=int(text.get("vocab_size", cls.talker_vocab_size)),
        )
        _check_talker_agrees(config, talker_config, text)
        return config


def _check_talker_agrees(config: CodePredictorConfig, talker: Mapping[str, Any], text: Mapping[str, Any]) -> None:
    groups = talker.get("num_code_groups")
    if groups is not None and int(groups) != config.num_code_groups:
        raise ValueError(
            f"talker num_code_groups={groups} but code_predictor_config num_code_groups={config.num_code_groups}: "
            "config.json is inconsistent; make them equal"
        )
    hidden = text.get("hidden_size")
    if hidden is not None and int(hidden) != config.hidden_size:
        raise ValueError(
            f"talker hidden_size={hidden} but code predictor hidden_size={config.hidden_size}: the predictor "
            "reads the talker's hidden state, so they must be equal"
        )
