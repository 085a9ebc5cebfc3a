"""Cosmos3's sound decoder: the AVAE audio tokenizer's Oobleck decoder, sound latents -> stereo waveform.

Latents [sound_dim, T] (T steps at the tokenizer's hop) become audio [channels, T * hop] through a
convolution, upsampling blocks (SnakeBeta, a transposed convolution, three dilated residual units) and
a last SnakeBeta and convolution, clamped to [-1, 1]. The checkpoint (`sound_tokenizer/`, diffusers'
Cosmos3AVAEAudioTokenizer) stores weight-normed convolutions as (g, v) pairs, folded at load; only the
decoder is read (the encoder turns audio into latents, which serving never does).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.engines.base import StatelessBase
from mstar.layers.snake import SnakeBeta
from mstar.models.common import loading

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SoundConfig:
    """The decoder's shape (diffusers Cosmos3AVAEAudioTokenizer config.json names); defaults are Cosmos3's."""

    sampling_rate: int = 48000
    latent_dim: int = 64  # vocoder_input_dim: the generator's sound_dim
    channels: int = 320  # dec_dim
    channel_multiples: tuple[int, ...] = (1, 2, 4, 8, 16)  # dec_c_mults
    strides: tuple[int, ...] = (2, 4, 5, 6, 8)  # dec_strides, applied last to first
    audio_channels: int = 2  # dec_out_channels (stereo)
    hop_size: int | None = None  # waveform samples per latent step; None: the product of the strides

    @property
    def hop(self) -> int:
        """Waveform samples per latent step."""
        return self.hop_size or math.prod(self.strides)

    def steps_for(self, num_frames: int, fps: float) -> int:
        """Latent steps of the sound of a `num_frames`-frame video at `fps` (the reference's rounding)."""
        samples = int(num_frames / fps * self.sampling_rate)
        return (samples + self.hop - 1) // self.hop

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> SoundConfig:
        """Parse the tokenizer's config.json; decoder variants other than the shipped one raise, naming the key."""
        shipped = {"dec_type": "oobleck", "dec_use_snake": True, "dec_final_tanh": False, "dec_anti_aliasing": False,
                   "dec_use_nearest_upsample": False, "dec_use_tanh_at_final": False, "snake_logscale": True}
        for key, value in shipped.items():
            if cfg.get(key, value) != value:
                raise ValueError(f"sound tokenizer {key}={cfg[key]!r} is not supported; Cosmos3 ships {key}={value!r}")
        return cls(sampling_rate=int(cfg.get("sampling_rate", 48000)), latent_dim=int(cfg.get("vocoder_input_dim", 64)),
                   channels=int(cfg.get("dec_dim", 320)), channel_multiples=tuple(cfg.get("dec_c_mults", cls.channel_multiples)),
                   strides=tuple(cfg.get("dec_strides", cls.strides)), audio_channels=int(cfg.get("dec_out_channels", 2)),
                   hop_size=cfg.get("hop_size"))


class ResidualUnit(nn.Module):
    """SnakeBeta, a dilated k=7 convolution, SnakeBeta, a 1x1 convolution, plus the input."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.snake1 = SnakeBeta(dim)
        self.conv1 = nn.Conv1d(dim, dim, kernel_size=7, dilation=dilation, padding=3 * dilation)
        self.snake2 = SnakeBeta(dim)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class DecoderBlock(nn.Module):
    """SnakeBeta, a transposed convolution upsampling by `stride`, three residual units (dilations 1, 3, 9)."""

    def __init__(self, in_dim: int, out_dim: int, stride: int) -> None:
        super().__init__()
        self.snake1 = SnakeBeta(in_dim)
        self.conv_t1 = nn.ConvTranspose1d(in_dim, out_dim, kernel_size=2 * stride, stride=stride,
                                          padding=math.ceil(stride / 2), output_padding=stride % 2)
        self.res_unit1 = ResidualUnit(out_dim, 1)
        self.res_unit2 = ResidualUnit(out_dim, 3)
        self.res_unit3 = ResidualUnit(out_dim, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res_unit3(self.res_unit2(self.res_unit1(self.conv_t1(self.snake1(x)))))


class SoundDecoder(nn.Module):
    """Sound latents [B, latent_dim, T] -> waveform [B, audio_channels, T * hop] in [-1, 1]."""

    def __init__(self, config: SoundConfig) -> None:
        super().__init__()
        self.config = config
        multiples = (1, *config.channel_multiples)
        strides = tuple(reversed(config.strides))
        self.conv1 = nn.Conv1d(config.latent_dim, config.channels * multiples[-1], kernel_size=7, padding=3)
        self.block = nn.ModuleList(
            DecoderBlock(config.channels * multiples[len(strides) - i], config.channels * multiples[len(strides) - i - 1],
                         stride) for i, stride in enumerate(strides))
        self.snake1 = SnakeBeta(config.channels)
        self.conv2 = nn.Conv1d(config.channels, config.audio_channels, kernel_size=7, padding=3, bias=False)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        x = self.conv1(latents.to(self.conv1.weight.dtype))
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x)).clamp(-1.0, 1.0)


class SoundComponent(StatelessBase, nn.Module):
    """Node `sound`: sound_latents [latent_dim, T] -> "audio" float32 [T * hop, channels]; an item without
    sound latents (a request that asked for none) produces nothing."""

    def __init__(self, decoder: SoundDecoder | None) -> None:
        super().__init__()
        self.decoder = decoder

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: list[dict], options: list[dict]) -> list[dict]:
        out: list[dict] = []
        for x in inputs:
            if "sound_latents" not in x:
                out.append({})
                continue
            if self.decoder is None:
                raise ValueError("this checkpoint has no sound tokenizer; leave 'audio' out of the modalities")
            out.append({"audio": self.decoder(x["sound_latents"][None])[0].float().t().contiguous()})
        return out


def _snake_and_folded(named) -> dict[str, torch.Tensor]:
    """The decoder's tensors with weight norm folded and Snake parameters [1, C, 1] flattened to [C]."""
    decoder = ((name.removeprefix("decoder."), t) for name, t in named if name.startswith("decoder."))
    return {name: t.reshape(-1) if name.endswith((".alpha", ".beta")) else t
            for name, t in loading.fold_weight_norm(decoder).items()}


def load_sound_decoder(folder: Path | None, config: SoundConfig, load_format: str, device: torch.device,
                       seed: int = 0) -> SoundDecoder:
    """The decoder from a `sound_tokenizer/` folder (float32), or seeded random weights (folder None, dummy)."""
    from mstar.models.common.meta import build_on_meta

    model = build_on_meta(lambda: SoundDecoder(config), torch.float32, device)
    assert isinstance(model, SoundDecoder)
    if folder is None or load_format == "dummy":
        loading.fill_dummy_weights(model, seed=seed)
        return model
    _, files = loading.weight_files(folder)
    tensors = _snake_and_folded(loading.iter_safetensors(files, progress=False))
    loading.load_named_tensors(model, tensors.items(), lambda name: (name, 0))
    logger.info("loaded the Cosmos3 sound decoder from %s", folder)
    return model
