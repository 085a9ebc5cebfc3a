"""Qwen3-Omni's audio encoder: log-mel frames of several audios -> thinker-width audio embeddings.

Each audio's mel frames are cut into 1 s chunks (2 * n_window frames; the last may be shorter); three
stride-2 convs turn a chunk into 13 tokens, which get sinusoidal positions restarting in each chunk.
The transformer attends within windows of n_window_infer frames (8 s) of one audio; a projection
maps to the thinker's width. Several audios run as one packed batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.segment_attention import SegmentPlan, segment_attention
from mstar.models.qwen3_omni.encoder_config import AudioEncoderConfig


def conv_output_length(frames: int) -> int:
    """Tokens the three stride-2 convs make from `frames` mel frames of one chunk."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def chunk_lengths(num_frames: int, chunk_frames: int) -> list[int]:
    """Mel frames of each conv chunk of an audio of `num_frames` frames."""
    full, rest = divmod(num_frames, chunk_frames)
    return [chunk_frames] * full + ([rest] if rest else [])


def audio_output_lengths(lengths: list[int], config: AudioEncoderConfig) -> list[int]:
    """Embeddings the encoder emits for audios of `lengths` mel frames (thinker placeholder counts)."""
    return [sum(conv_output_length(n) for n in chunk_lengths(f, config.chunk_frames)) for f in lengths]


def _zero_beyond(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Zero the time steps of each chunk [n, C, F, T] past its padded length: there the reference,
    which padded that chunk less, has the convs' own zero padding."""
    if all(n >= x.shape[-1] for n in sizes):
        return x
    valid = (
        torch.arange(x.shape[-1], device=x.device)[None, :] < torch.tensor(sizes, device=x.device)[:, None]
    )
    return x * valid[:, None, None, :].to(x.dtype)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels] float32 Whisper positions: sin on the first half of channels, cos on the rest."""
    log_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class AudioEncoderLayer(nn.Module):
    """Pre-norm transformer layer with biased projections and windowed bidirectional attention."""

    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.qkv_proj = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, d)

    def forward(self, x: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(self.self_attn_layer_norm(x)).view(t, 3, self.num_heads, -1).unbind(1)
        x = x + self.out_proj(segment_attention(q, k, v, plan).reshape(t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """Audio tower: `forward(features, lengths)` embeds every audio of a packed batch."""

    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv_out = nn.Linear(config.conv_out_features, config.d_model, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(config) for _ in range(config.num_layers))
        self.ln_post = nn.LayerNorm(config.d_model)
        self.proj1 = nn.Linear(config.d_model, config.d_model)
        self.proj2 = nn.Linear(config.d_model, config.output_dim)
        self._positions: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def forward(
        self, features: torch.Tensor, lengths: torch.Tensor | list[int], group_sizes: list[int] | None = None
    ) -> torch.Tensor:
        """features [num_mel_bins, sum(lengths)] (audios one after another), lengths [num_audios] mel
        frames -> [sum(audio_output_lengths(lengths)), output_dim] embeddings, audio after audio.

        The reference pads every chunk to the longest chunk of the audios it encodes together (one
        request's), which changes the last conv outputs of a short chunk. `group_sizes` (audios per
        request, in order; default: all one request) keeps that per request, so batching requests
        together gives each the result it would get alone.
        """
        lengths = [int(n) for n in lengths]
        if features.shape != (self.config.num_mel_bins, sum(lengths)):
            raise ValueError(
                f"audio features shaped {tuple(features.shape)} do not match "
                f"{self.config.num_mel_bins} mel bins "
                f"x {sum(lengths)} frames (the sum of lengths {lengths})"
            )
        chunks, pad_to = self._chunks(lengths, group_sizes or [len(lengths)])
        x = self._embed_chunks(features, chunks, pad_to)
        plan = SegmentPlan(self._window_lengths(lengths), x.device)
        for layer in self.layers:
            x = layer(x, plan)
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))

    def _chunks(self, lengths: list[int], group_sizes: list[int]) -> tuple[list[int], list[int]]:
        """Frames of every conv chunk, and the length each is padded to (the longest of its group)."""
        if sum(group_sizes) != len(lengths) or min(group_sizes) <= 0:
            raise ValueError(
                f"group_sizes {group_sizes} must be positive and sum to the {len(lengths)} audios"
            )
        chunks, pad_to, start = [], [], 0
        for size in group_sizes:
            group = [
                c for n in lengths[start : start + size] for c in chunk_lengths(n, self.config.chunk_frames)
            ]
            chunks += group
            pad_to += [max(group)] * len(group)
            start += size
        return chunks, pad_to

    def _embed_chunks(self, features: torch.Tensor, chunks: list[int], pad_to: list[int]) -> torch.Tensor:
        """Conv-downsample every chunk, add positions, keep the tokens of real (unpadded) frames."""
        dtype = self.conv2d1.weight.dtype
        pieces = features.to(dtype).T.split(chunks, dim=0)
        padded = nn.utils.rnn.pad_sequence(pieces, batch_first=True).transpose(1, 2).unsqueeze(1)
        convolved = []
        for start in range(0, len(chunks), self.config.conv_chunksize):  # bounds conv activation memory
            batch = padded[start : start + self.config.conv_chunksize]
            sizes = pad_to[start : start + self.config.conv_chunksize]
            for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
                batch = F.gelu(conv(batch))
                sizes = [(n - 1) // 2 + 1 for n in sizes]
                batch = _zero_beyond(batch, sizes)
            convolved.append(batch)
        y = torch.cat(convolved)
        n, c, f, t = y.shape
        y = self.conv_out(y.permute(0, 3, 1, 2).reshape(n, t, c * f)) + self._position_table(
            t, y.device, y.dtype
        )
        keep = torch.cat([i * t + torch.arange(conv_output_length(m)) for i, m in enumerate(chunks)])
        return y.reshape(n * t, -1)[keep.to(y.device)]

    def _window_lengths(self, lengths: list[int]) -> list[int]:
        """Token counts of the attention windows: n_window_infer frames each, never across audios."""
        window = conv_output_length(self.config.chunk_frames) * (
            self.config.n_window_infer // self.config.chunk_frames
        )
        out = []
        for tokens in audio_output_lengths(lengths, self.config):
            full, rest = divmod(tokens, window)
            out += [window] * full + ([rest] if rest else [])
        return out

    def _position_table(self, length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if length > self.config.max_source_positions:
            raise ValueError(
                f"{length} positions per chunk exceed max_source_positions {self.config.max_source_positions}"
            )
        key = (length, device, dtype)
        if key not in self._positions:  # computed in float32 on CPU like the checkpoint's buffer
            self._positions[key] = sinusoids(self.config.max_source_positions, self.config.d_model)[
                :length
            ].to(device=device, dtype=dtype)
        return self._positions[key]
