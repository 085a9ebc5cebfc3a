"""Config of Qwen3-Omni's Code2Wav: codec frames (16 codebooks, 12.5 Hz) -> 24 kHz audio.

Read from the HF `code2wav_config` dict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar.models.common.hf_config import from_hf_fields, rope_theta

SAMPLE_RATE = 24000  # of Code2Wav's output audio


@dataclass(frozen=True)
class Code2WavConfig:
    """Shapes of Code2Wav; `full()` is Qwen3-Omni-30B-A3B's, `tiny()` is for tests."""

    codebook_size: int = 2048
    num_quantizers: int = 16  # codebooks per frame
    hidden_size: int = 1024  # of the pre-transformer
    intermediate_size: int = 3072
    num_layers: int = 8
    num_heads: int = 16
    num_kv_heads: int = 16
    sliding_window: int = 72  # each frame attends to itself and the 71 frames before it
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    upsampling_ratios: tuple[int, ...] = (2, 2)  # transposed conv + ConvNeXt stages after the transformer
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)  # decoder blocks (SnakeBeta, transposed conv, residuals)
    decoder_dim: int = 1536  # channels entering the first decoder block; halved by each block

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads}) and "
                f"num_heads of num_kv_heads ({self.num_kv_heads})"
            )
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError(
                f"decoder_dim ({self.decoder_dim}) must be divisible by 2**len(upsample_rates) "
                f"({2 ** len(self.upsample_rates)}): each decoder block halves the channels"
            )
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def head_dim(self) -> int:
        """Per attention head (64 for the real model)."""
        return self.hidden_size // self.num_heads

    @property
    def samples_per_frame(self) -> int:
        """Output samples per codec frame (1920 = 80 ms at 24 kHz for the real model)."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @classmethod
    def full(cls) -> Code2WavConfig:
        """Qwen3-Omni-30B-A3B's Code2Wav."""
        return cls()

    @classmethod
    def tiny(cls, **overrides: Any) -> Code2WavConfig:
        """A small config with the real structure: 16 codebooks, sliding window, every stage kind."""
        base = dict(codebook_size=32, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=4, sliding_window=4, upsampling_ratios=(2,), upsample_rates=(2, 3),
                    decoder_dim=16)
        return cls(**{**base, **overrides})

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> Code2WavConfig:
        """From the HF `code2wav_config` dict (missing keys take the defaults: Qwen3-Omni-30B-A3B's)."""
        heads = int(d.get("num_attention_heads", cls.num_heads))
        return from_hf_fields(cls, d, {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"},
                              num_kv_heads=int(d.get("num_key_value_heads") or heads),
                              rope_theta=rope_theta(d, "code2wav"))
