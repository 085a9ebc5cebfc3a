"""The SNAC decoder (hubertsiuzdak/snac_24khz) as plain PyTorch, weight norm folded at load.

Codes of three levels (strides 4, 2, 1 latent steps) are looked up in small codebooks, projected,
repeated to the latent rate and summed; a convolutional decoder (depthwise convs, Snake
activations, transposed-conv upsampling, noise blocks) turns latents into samples. Module paths
follow the `snac` package so its checkpoints load by name; the encoder is not built.

On CUDA (fused kernels on) the layers take the fused forms of `mstar/models/orpheus/snac_ops.py`: a residual
unit is one depthwise kernel (with the Snake after it), its 1x1 conv and one bias + residual kernel that
also writes the next layer's first Snake of its output, so within the decoder no Snake runs alone and no
sine is taken per conv tap; a transposed conv is a 1x1 conv to every tap and one fold kernel; noise is
read from the vocoder's table inside the noise block's kernel; the output conv and tanh are one kernel;
the quantizer is one lookup of codebooks projected once. The PyTorch form (CPU, or
`fused_kernels(False)`) is the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from mstar.layers.fused import FUSED
from mstar.models.common.derived import derived


@dataclass(frozen=True)
class SnacConfig:
    """The `config.json` of a SNAC checkpoint (only 24 kHz style models: no local attention)."""

    sampling_rate: int = 24000
    encoder_dim: int = 48
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: int | None = None  # default: encoder_dim * 2 ** len(encoder_rates)
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    attn_window_size: int | None = None
    codebook_size: int = 4096
    codebook_dim: int = 8
    vq_strides: tuple[int, ...] = (4, 2, 1)
    noise: bool = True
    depthwise: bool = True

    def __post_init__(self) -> None:
        if self.attn_window_size is not None:
            raise ValueError(f"SNAC attn_window_size={self.attn_window_size}: local attention (the 32/44 kHz "
                             "models) is not supported; Orpheus uses hubertsiuzdak/snac_24khz")
        if tuple(self.vq_strides) != (4, 2, 1):
            raise ValueError(f"SNAC vq_strides={self.vq_strides}: Orpheus frames need (4, 2, 1) (1 + 2 + 4 codes)")
        if math.prod(self.encoder_rates) != math.prod(self.decoder_rates):
            raise ValueError(f"SNAC encoder_rates {self.encoder_rates} and decoder_rates {self.decoder_rates} "
                             "must have the same product (the hop length)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SnacConfig:
        """Parse a config.json dict; unknown keys raise ValueError naming them."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown SNAC config key(s) {unknown}; known: {sorted(names)}")
        data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**data)

    @property
    def latent(self) -> int:
        return self.latent_dim or self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def hop_length(self) -> int:
        return math.prod(self.decoder_rates)

    @property
    def samples_per_frame(self) -> int:
        """Samples one Orpheus frame (one level-0 code) decodes to: 2048 at 24 kHz."""
        return self.hop_length * self.vq_strides[0]

    def noise_lengths_per_frame(self) -> list[int]:
        """Time steps per frame at the output of each decoder block (where its noise is added)."""
        steps, out = self.vq_strides[0], []
        for rate in self.decoder_rates:
            steps *= rate
            out.append(steps)
        return out


def _fused(x: torch.Tensor) -> bool:
    """Whether x takes the fused kernels (a contiguous [B, C, T] tensor where fused kernels are on)."""
    return x.dim() == 3 and x.is_contiguous() and FUSED.ops_for(x) is not None


@dataclass(frozen=True)
class TableNoise:
    """The noise of every decoder block read from fixed tables: block i's noise at time step t of a window
    that starts at frame f is table[i][(f * steps[i] + t) % table.shape[1]] (vocoder.py draws the table)."""

    table: torch.Tensor  # [blocks, N]
    first_frame: torch.Tensor  # [B] long
    steps: tuple[int, ...]  # time steps per frame at each block's output

    def block(self, i: int, offset: int = 0) -> BlockNoise:
        """Block i's noise; `offset`: the window step its output's first step is (a decode of a span)."""
        return BlockNoise(self.table[i], self.first_frame, self.steps[i], offset)


@dataclass(frozen=True)
class BlockNoise:
    """One decoder block's share of a TableNoise, from window step `offset` on."""

    table: torch.Tensor  # [N]
    first_frame: torch.Tensor  # [B] long
    steps: int
    offset: int = 0

    def tensor(self, length: int) -> torch.Tensor:
        """The noise as a [B, 1, length] tensor (the PyTorch form)."""
        pos = self.first_frame[:, None] * self.steps + self.offset + torch.arange(length, device=self.first_frame.device)
        return self.table[pos % self.table.shape[0]][:, None, :]


Noise = torch.Tensor | BlockNoise | None


class Snake(nn.Module):
    """x + sin(alpha x)^2 / alpha, per channel. On CUDA (fused kernels on, x contiguous) one Triton kernel
    (`kernels/snake.py`) in float32 instead of five elementwise passes."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.is_contiguous() and FUSED.ops_for(x) is not None:
            from mstar.kernels.snake import snake

            return snake(x, self.alpha)
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    """Snake, dilated conv (kernel 7), Snake, 1x1 conv, plus the input."""

    def __init__(self, dim: int, dilation: int, groups: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake(dim), nn.Conv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation, groups=groups),
            Snake(dim), nn.Conv1d(dim, dim, 1))

    def fusable(self) -> bool:
        conv = self.block[1]
        return conv.groups == conv.in_channels and conv.padding[0] == conv.dilation[0] * 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x) and self.fusable():
            return self.fused(x)[0]
        y = self.block(x)
        trim = (x.shape[-1] - y.shape[-1]) // 2
        return (x[..., trim:-trim] if trim > 0 else x) + y

    def fused(self, x: torch.Tensor, x_snaked: torch.Tensor | None = None,
              next_alpha: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused kernels' form: (the unit's output, its Snake by `next_alpha` when given). `x_snaked`:
        x through this unit's first Snake, when the layer before wrote it (else the depthwise kernel
        applies the Snake at every tap)."""
        from mstar.models.orpheus import snac_ops

        snake_in, conv, snake_out, project = self.block
        source, alpha_in = (x, snake_in.alpha) if x_snaked is None else (x_snaked, None)
        z = snac_ops.depthwise(source, conv.weight, conv.bias, conv.dilation[0], alpha_in, snake_out.alpha)
        return snac_ops.bias_residual(x, F.conv1d(z, project.weight), project.bias, next_alpha)


class NoiseBlock(nn.Module):
    """Adds noise scaled per step by a 1x1 conv of the input; fresh randn when no noise is given."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(dim, dim, 1, bias=False)

    def forward(self, x: torch.Tensor, noise: Noise = None) -> torch.Tensor:
        if isinstance(noise, BlockNoise):
            if _fused(x):
                return self.fused(x, noise)[0]
            noise = noise.tensor(x.shape[2])
        if noise is None:  # the reference draws (B, 1, T) from the global generator here
            noise = torch.randn((x.shape[0], 1, x.shape[2]), device=x.device, dtype=x.dtype)
        return x + noise * self.linear(x)

    def fused(self, x: torch.Tensor, noise: Noise,
              next_alpha: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the block's output, its Snake by `next_alpha` when given and the noise is a table's: the fused
        kernel writes both; other noise takes the PyTorch form and gives None)."""
        if not isinstance(noise, BlockNoise):
            return self.forward(x, noise), None
        from mstar.models.orpheus import snac_ops

        return snac_ops.table_noise(x, self.linear(x), noise.table, noise.first_frame, noise.steps, next_alpha,
                                    noise.offset)


class DecoderBlock(nn.Module):
    """Snake, transposed conv upsampling by `stride`, optional noise, three residual units."""

    def __init__(self, dim_in: int, dim_out: int, stride: int, noise: bool, groups: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            Snake(dim_in),
            nn.ConvTranspose1d(dim_in, dim_out, 2 * stride, stride=stride, padding=math.ceil(stride / 2),
                               output_padding=stride % 2)]
        if noise:
            layers.append(NoiseBlock(dim_out))
        layers += [ResidualUnit(dim_out, d, groups) for d in (1, 3, 9)]
        self.block = nn.Sequential(*layers)

    def fusable(self) -> bool:
        snake, conv, *rest = self.block
        return (isinstance(snake, Snake) and isinstance(conv, nn.ConvTranspose1d)
                and conv.kernel_size[0] == 2 * conv.stride[0] and bool(rest)
                and all(isinstance(r, NoiseBlock) or isinstance(r, ResidualUnit) and r.fusable() for r in rest))

    def out_len(self, in_len: int) -> int:
        """Output steps of an input of `in_len` steps (the transposed conv's length rule)."""
        conv = self.block[1]
        return (in_len - 1) * conv.stride[0] - 2 * conv.padding[0] + conv.kernel_size[0] + conv.output_padding[0]

    def input_span(self, lo: int, hi: int, in_len: int) -> tuple[int, int]:
        """The input steps [a, b) of an input of `in_len` steps that decide output steps [lo, hi) exactly:
        what the residual units' dilated convs reach on each side, then the transposed conv's taps. The
        block run on just those inputs (zero padded at their ends) gives output steps [a * stride, ...)
        of which [lo, hi) equal the whole input's."""
        conv = self.block[1]
        stride, padding, taps = conv.stride[0], conv.padding[0], conv.kernel_size[0]
        reach = sum(unit.block[1].dilation[0] * (unit.block[1].kernel_size[0] // 2)
                    for unit in self.block if isinstance(unit, ResidualUnit))
        lo, hi = max(lo - reach, 0), min(hi + reach, self.out_len(in_len))
        # output step o reads input steps i with o = i * stride - padding + k, 0 <= k < taps
        return max(-((taps - 1 - lo - padding) // stride), 0), min((hi - 1 + padding) // stride + 1, in_len)

    def forward(self, x: torch.Tensor, noise: Noise = None) -> torch.Tensor:
        if _fused(x) and self.fusable():
            return self.fused(x, noise)[0]
        for layer in self.block:
            x = layer(x, noise) if isinstance(layer, NoiseBlock) else layer(x)
        return x

    def fused(self, x: torch.Tensor | None, noise: Noise, x_snaked: torch.Tensor | None = None,
              next_alpha: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused kernels' form: (the block's output, its Snake by `next_alpha` when given and written).
        Each layer writes the next one's first Snake beside its output, so no Snake runs on its own:
        `x_snaked` is x through this block's first Snake when the layer before wrote it (x itself is then
        not read, and may be None)."""
        from mstar.models.orpheus import snac_ops

        snake, conv, *rest = self.block
        stride, padding = conv.stride[0], conv.padding[0]
        source = snake(x) if x_snaked is None else x_snaked
        weight = derived(conv, "gemm_weight", (conv.weight,), lambda: snac_ops.transposed_gemm_weight(conv.weight))
        x = snac_ops.transposed_conv(source, weight, conv.bias, stride, padding, self.out_len(source.shape[-1]))
        # the Snake each layer writes beside its output: the next unit's first, or the caller's after the last
        afters = [r.block[0].alpha if isinstance(r, ResidualUnit) else None for r in rest[1:]] + [next_alpha]
        snaked = None
        for layer, after in zip(rest, afters):
            if isinstance(layer, NoiseBlock):
                x, snaked = layer.fused(x, noise, after)
            else:
                x, snaked = layer.fused(x, snaked, after)
        return x, snaked


class Decoder(nn.Module):
    """Latents [B, latent, T] -> samples [B, 1, T * hop]."""

    def __init__(self, cfg: SnacConfig) -> None:
        super().__init__()
        dim, channels = cfg.latent, cfg.decoder_dim
        if cfg.depthwise:
            layers: list[nn.Module] = [nn.Conv1d(dim, dim, 7, padding=3, groups=dim), nn.Conv1d(dim, channels, 1)]
        else:
            layers = [nn.Conv1d(dim, channels, 7, padding=3)]
        for i, stride in enumerate(cfg.decoder_rates):
            out = channels // 2 ** (i + 1)
            layers.append(DecoderBlock(channels // 2**i, out, stride, cfg.noise, out if cfg.depthwise else 1))
        layers += [Snake(out), nn.Conv1d(out, 1, 7, padding=3), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, noises: list[torch.Tensor] | TableNoise | None = None,
                emit: tuple[int, int] | None = None) -> torch.Tensor:
        """Samples [B, 1, T * hop] of latents x [B, latent, T]; with `emit` = (lo, hi) only samples [lo, hi),
        [B, 1, hi - lo]: each decoder block then runs on just the span of its input those samples depend
        on (`emit_spans`), the same numbers as the whole decode's, for a fraction of its work. `emit` needs
        table noise (or none): drawn noise would not line up with the whole decode's."""
        layers = list(self.model)
        spans = None
        if emit is not None:
            if isinstance(noises, list):
                raise ValueError("decoding emitted samples alone needs TableNoise (or no noise), not drawn noise")
            spans = self.emit_spans(x.shape[-1], emit)
        if _fused(x) and self._fusable(layers):
            return self._fused(x, noises, layers, spans, emit)
        blocks, start = 0, 0  # start: the window step x's first step is, at the current layer's rate
        for layer in layers:
            if isinstance(layer, DecoderBlock):
                offset = 0
                if spans is not None:
                    (x,), start = _span((x,), start, spans[blocks]), spans[blocks][0]
                    offset = start * layer.block[1].stride[0]
                x = layer(x, _block_noise(noises, blocks, offset))
                blocks += 1
                start = offset
            else:
                if spans is not None and layer is layers[-3]:  # the Snake before the output conv
                    (x,), start = _span((x,), start, spans[-1]), spans[-1][0]
                x = layer(x)
        return x if emit is None else x[..., emit[0] - start: emit[1] - start]

    def emit_spans(self, steps: int, emit: tuple[int, int]) -> list[tuple[int, int]]:
        """For output samples [lo, hi) of latents of `steps` steps: the input span [a, b) of each decoder
        block and, last, the span of the last block's output that the output conv needs."""
        blocks = [layer for layer in self.model if isinstance(layer, DecoderBlock)]
        lengths = [steps]
        for block in blocks:
            lengths.append(block.out_len(lengths[-1]))
        lo, hi = emit
        if not 0 <= lo < hi <= lengths[-1]:
            raise ValueError(f"emit {emit}: need 0 <= lo < hi <= {lengths[-1]} (the decode's samples)")
        conv = self.model[-2]
        reach = conv.dilation[0] * (conv.kernel_size[0] // 2)
        spans = [(max(lo - reach, 0), min(hi + reach, lengths[-1]))]
        for block, in_len in zip(reversed(blocks), reversed(lengths[:-1])):
            spans.append(block.input_span(*spans[-1], in_len))
        return spans[::-1]

    @staticmethod
    def _fusable(layers: list[nn.Module]) -> bool:
        """Head convs, then decoder blocks, then Snake, a 1-channel conv and tanh (SNAC's layout)."""
        blocks = [i for i, layer in enumerate(layers) if isinstance(layer, DecoderBlock)]
        snake, conv, tanh = layers[-3:]
        return (bool(blocks) and blocks == list(range(blocks[0], len(layers) - 3))
                and all(layers[i].fusable() for i in blocks) and isinstance(snake, Snake)
                and isinstance(conv, nn.Conv1d) and conv.out_channels == 1 and conv.padding[0] == conv.kernel_size[0] // 2
                and isinstance(tanh, nn.Tanh))

    def _fused(self, x: torch.Tensor, noises: list[torch.Tensor] | TableNoise | None, layers: list[nn.Module],
               spans: list[tuple[int, int]] | None, emit: tuple[int, int] | None) -> torch.Tensor:
        from mstar.models.orpheus import snac_ops

        blocks = [layer for layer in layers if isinstance(layer, DecoderBlock)]
        snake, conv = layers[-3], layers[-2]
        for layer in layers[:layers.index(blocks[0])]:
            if isinstance(layer, nn.Conv1d) and layer.groups == layer.in_channels > 1 \
                    and layer.padding[0] == layer.kernel_size[0] // 2 and layer.dilation[0] == 1:
                x = snac_ops.depthwise(x, layer.weight, layer.bias)
            else:
                x = layer(x)
        snaked, start = None, 0
        for i, block in enumerate(blocks):
            offset = 0
            if spans is not None:  # only what the block reads: x through its first Snake when written
                x, snaked = _span((x, None) if snaked is None else (None, snaked), start, spans[i])
                start = spans[i][0]
                offset = start * block.block[1].stride[0]
            after = blocks[i + 1].block[0].alpha if i + 1 < len(blocks) else snake.alpha
            x, snaked = block.fused(x, _block_noise(noises, i, offset), snaked, after)
            start = offset
        if spans is not None:
            x, snaked = _span((x, None) if snaked is None else (None, snaked), start, spans[-1])
            start = spans[-1][0]
        out = snac_ops.conv_out(snake(x) if snaked is None else snaked, conv.weight, conv.bias)
        return out if emit is None else out[..., emit[0] - start: emit[1] - start]


def _span(tensors: tuple[torch.Tensor | None, ...], start: int, span: tuple[int, int]) -> tuple[torch.Tensor | None, ...]:
    """Steps [a, b) (window steps) of tensors whose first step is window step `start`, contiguous (no copy
    when that is all of them)."""
    a, b = span[0] - start, span[1] - start
    return tuple(t if t is None or (a == 0 and b == t.shape[-1]) else t[..., a:b].contiguous() for t in tensors)


def _block_noise(noises: list[torch.Tensor] | TableNoise | None, i: int, offset: int = 0) -> Noise:
    if isinstance(noises, TableNoise):
        return noises.block(i, offset)
    return noises[i] if noises else None


class CodeProjection(nn.Module):
    """One quantizer level: codebook lookup and projection to the latent width."""

    def __init__(self, cfg: SnacConfig) -> None:
        super().__init__()
        self.codebook = nn.Embedding(cfg.codebook_size, cfg.codebook_dim)
        self.out_proj = nn.Conv1d(cfg.codebook_dim, cfg.latent, 1)


class Quantizer(nn.Module):
    """Codes of every level -> the summed latents [B, latent, T]."""

    def __init__(self, cfg: SnacConfig) -> None:
        super().__init__()
        self.strides = tuple(cfg.vq_strides)
        self.quantizers = nn.ModuleList(CodeProjection(cfg) for _ in self.strides)

    def forward(self, codes: list[torch.Tensor]) -> torch.Tensor:
        if len(codes) == 3 and self.strides[2] == 1 and codes[0].dim() == 2 and FUSED.ops_for(codes[0]) is not None:
            from mstar.models.orpheus import snac_ops

            return snac_ops.sum_codes([c.contiguous() for c in codes], self.tables(), self.strides)
        z = None
        for level, stride, c in zip(self.quantizers, self.strides, codes):
            part = level.out_proj(level.codebook(c).transpose(1, 2)).repeat_interleave(stride, dim=-1)
            z = part if z is None else z + part
        return z

    def tables(self) -> list[torch.Tensor]:
        """Each level's codebook through its projection, bias included: [codebook_size, latent] (derived
        once from the weights, for `snac_ops.sum_codes`)."""
        out = []
        for level in self.quantizers:
            def project(level=level) -> torch.Tensor:
                book = level.codebook.weight.t()[None]  # [1, codebook_dim, codebook_size]
                return level.out_proj(book)[0].t().contiguous()
            sources = (level.codebook.weight, level.out_proj.weight, level.out_proj.bias)
            out.append(derived(level, "projected_codebook", sources, project))
        return out


class SnacDecoder(nn.Module):
    """codes (list of [B, T_level] long) -> samples [B, 1, T_0 * stride_0 * hop] in [-1, 1].

    `noises` (one [B, 1, T] tensor per decoder block) replaces the random draws of the noise
    blocks; without it they draw from the global generator in the reference's order, so seeding
    torch gives the reference's samples.
    """

    def __init__(self, cfg: SnacConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.quantizer = Quantizer(cfg)
        self.decoder = Decoder(cfg)

    def forward(self, codes: list[torch.Tensor], noises: list[torch.Tensor] | TableNoise | None = None,
                emit: tuple[int, int] | None = None) -> torch.Tensor:
        """`emit` = (lo, hi): only samples [lo, hi) of the decode, computed on the spans they depend on
        (`Decoder.forward`)."""
        return self.decoder(self.quantizer(codes), noises, emit)
