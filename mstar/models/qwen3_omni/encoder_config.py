"""Configs of Qwen3-Omni's audio and vision encoders, read from the thinker's HF config sections.

`AudioEncoderConfig.from_hf(d)` takes `thinker_config.audio_config` and `VisionEncoderConfig.from_hf(d)`
takes `thinker_config.vision_config` of Qwen/Qwen3-Omni-30B-A3B-Instruct's config.json. `FULL_AUDIO` /
`FULL_VISION` are those sections of the 30B-A3B checkpoint; `TINY_AUDIO` / `TINY_VISION` are tiny random
configs for CPU tests, in the same keys so transformers can build the reference from the same dicts; the
config classes take their values from these dicts only (`from_hf`), so they declare no defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar.models.common.hf_config import from_hf_fields, rope_theta

FULL_AUDIO: dict[str, Any] = {
    "num_mel_bins": 128,
    "encoder_layers": 32,
    "encoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "d_model": 1280,
    "activation_function": "gelu",
    "max_source_positions": 1500,
    "n_window": 50,
    "output_dim": 2048,
    "n_window_infer": 800,
    "conv_chunksize": 500,
    "downsample_hidden_size": 480,
}
FULL_VISION: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 2048,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
# n_window stays 50: the reference's output-length formula assumes it (13 tokens per full chunk).
# n_window_infer 200 (2 s windows) makes a 3 s test clip cross a window boundary.
TINY_AUDIO: dict[str, Any] = {
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "d_model": 32,
    "activation_function": "gelu",
    "max_source_positions": 64,
    "n_window": 50,
    "output_dim": 48,
    "n_window_infer": 200,
    "conv_chunksize": 3,
    "downsample_hidden_size": 8,
}
TINY_VISION: dict[str, Any] = {
    "depth": 3,
    "hidden_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 64,
    "num_heads": 4,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 48,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0, 2],
}

_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class AudioEncoderConfig:
    """The Whisper-style audio tower: conv downsampling of mel chunks, windowed transformer, projection."""

    num_mel_bins: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    d_model: int
    output_dim: int  # the thinker's hidden size
    max_source_positions: int  # rows of the sinusoidal table; a chunk uses the first few
    n_window: int  # a conv chunk is 2 * n_window mel frames (1 s)
    n_window_infer: int  # mel frames per attention window (8 s); a multiple of 2 * n_window
    conv_chunksize: int  # chunks per conv call, to bound conv activation memory
    downsample_hidden_size: int
    activation: str

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"audio d_model {self.d_model} is not a multiple of num_heads {self.num_heads}")
        if self.n_window_infer % (2 * self.n_window):
            raise ValueError(
                f"audio n_window_infer {self.n_window_infer} must be a multiple of "
                f"2 * n_window ({2 * self.n_window})"
            )
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported audio activation {self.activation!r}; supported: {_ACTIVATIONS}")

    @property
    def chunk_frames(self) -> int:
        """Mel frames per conv chunk."""
        return 2 * self.n_window

    @property
    def conv_out_features(self) -> int:
        """Input width of `conv_out`: channels times the mel bins left after three stride-2 convs."""
        bins = self.num_mel_bins
        for _ in range(3):
            bins = (bins + 1) // 2
        return self.downsample_hidden_size * bins

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> AudioEncoderConfig:
        """From `thinker_config.audio_config` of an HF config.json (missing keys take HF defaults)."""
        full = {**FULL_AUDIO, "output_dim": 3584, **d}  # HF's own default output_dim is 3584
        return from_hf_fields(cls, full, {"num_layers": "encoder_layers", "num_heads": "encoder_attention_heads",
                                          "ffn_dim": "encoder_ffn_dim", "activation": "activation_function"})


@dataclass(frozen=True)
class VisionEncoderConfig:
    """The ViT: 3D patch embed, 2D rotary, blocks attending within each frame, 2x2 patch mergers."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int  # the thinker's hidden size
    num_position_embeddings: int  # a square table (48 x 48) resampled to each grid
    deepstack_visual_indexes: tuple[int, ...]  # blocks whose outputs feed the thinker's first layers
    activation: str
    rope_theta: float

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} / num_heads {self.num_heads} must give a head_dim "
                "divisible by 4 (2D rotary)"
            )
        side = int(round(self.num_position_embeddings**0.5))
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings {self.num_position_embeddings} is not a square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} are outside the {self.depth} vision blocks")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {self.activation!r}; supported: {_ACTIVATIONS}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened input patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> VisionEncoderConfig:
        """From `thinker_config.vision_config` of an HF config.json (missing keys take HF defaults)."""
        full = {**FULL_VISION, "out_hidden_size": 3584, **d}  # HF's own default out_hidden_size is 3584
        return from_hf_fields(cls, full, {"activation": "hidden_act"}, rope_theta=rope_theta(full, "vision"),
                              deepstack_visual_indexes=tuple(full["deepstack_visual_indexes"]))


def full_audio_config() -> AudioEncoderConfig:
    """The audio encoder of Qwen3-Omni-30B-A3B."""
    return AudioEncoderConfig.from_hf(FULL_AUDIO)


def full_vision_config() -> VisionEncoderConfig:
    """The vision encoder of Qwen3-Omni-30B-A3B."""
    return VisionEncoderConfig.from_hf(FULL_VISION)


def tiny_audio_config() -> AudioEncoderConfig:
    """A 2-layer, 32-wide audio encoder for CPU tests."""
    return AudioEncoderConfig.from_hf(TINY_AUDIO)


def tiny_vision_config() -> VisionEncoderConfig:
    """A 3-block, 32-wide vision encoder with two deepstack taps for CPU tests."""
    return VisionEncoderConfig.from_hf(TINY_VISION)
