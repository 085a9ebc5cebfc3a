"""Qwen3-Omni's Code2Wav: codec frames [B, 16, T] -> 24 kHz audio [B, T * 1920 - 555].

The frame's 16 code embeddings are averaged, a pre-transformer with sliding-window attention mixes
frames, two upsampling stages (transposed conv + ConvNeXt) and four decoder blocks (SnakeBeta,
transposed conv, dilated causal residual units) make the waveform, clamped to [-1, 1]. Each
decoder transposed conv drops the samples that would need the next frame, so T frames give
`lookahead_samples` (555) fewer samples than T * 1920.

Chunked mode cuts frames as the reference's `chunked_decode` does: each chunk of new frames is
decoded with up to `left_context` earlier frames (positions restart at 0 per chunk). The reference
then keeps the samples from the first new frame on, which loses the 555 samples before every
chunk boundary. Our default `trim="seamless"` keeps them: a chunk with left context starts its
output `lookahead_samples` earlier, so the chunks join into exactly one-shot's length, and into
one-shot's values once the context reaches `exact_context_frames` (578 frames for the real model;
with the usual 25 frames the attention window (72 frames per layer) is cut and samples differ).
`trim="reference"` reproduces the reference's samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines.base import CapturePlan, StatelessBase
from mstar.engines.cuda_graphs import to_device_async
from mstar.layers.mlp import GatedMLP
from mstar.layers.norm import RMSNorm
from mstar.layers.rope import RopeSpec, RotaryEmbedding, apply_rotary
from mstar.layers.snake import SnakeBeta
from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig
from mstar.models.qwen3_omni.code2wav_layers import CausalConv1d, DecoderBlock, UpsampleStage

TRIMS = ("seamless", "reference")


class _LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class _Attention(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_size, self.kv_size = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape[0], x.shape[1], self.cfg.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(b, t, -1, d), cos, sin).transpose(1, 2)
        k = apply_rotary(k.view(b, t, -1, d), cos, sin).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v.view(b, t, -1, d).transpose(1, 2), attn_mask=mask,
            enable_gqa=self.cfg.num_heads != self.cfg.num_kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.q_size))


class _TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.self_attn_layer_scale = _LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.mlp_layer_scale = _LayerScale(cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """Causal sliding-window transformer over frames: [B, T, hidden] -> [B, T, hidden]."""

    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.window = cfg.sliding_window
        self.layers = nn.ModuleList(_TransformerLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(RopeSpec(head_dim=cfg.head_dim, theta=cfg.rope_theta))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        cos, sin = self.rotary(pos)
        # Frame q sees frames q - window + 1 .. q.
        delta = pos[:, None] - pos[None, :]
        mask = (delta >= 0) & (delta < self.window)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class Code2Wav(StatelessBase, nn.Module):
    """The stateless `code2wav` component.

    Input per request: `codes` [T, Q] int64 (T frames of Q codes, as the talker's stream delivers
    them; on the device, or on the host when they came from another process) and, in chunked mode,
    `codes_new` [] (how many of the last frames are new; the others are left context), read on the
    host. Output: `audio` float32 at 24 kHz, seamless trim: new * samples_per_frame samples, less
    `lookahead_samples` for a chunk without context (the first one).

    With `pad_frames` set, a shorter chunk (the first one, a request's last one) is padded with code
    0 frames on the right to that many frames and its audio cut back: every stage is causal, so the
    samples it emits do not depend on the padding, and calls share one shape (chunks of several lengths
    batch together; no cuDNN plan or kernel choice per new length). Its engine then captures
    the decode of that one width (`capture_plans`) at a few batch sizes: a call replays one graph instead of launching
    a few hundred kernels, and no batch size meets cuDNN for the first time while serving.

    On CUDA it runs beside the LMs on a stream of its own (`side_stream`), reads its chunk sizes on
    the host (`host_inputs`: no host sync per chunk) and hands its audio out through asynchronous
    pinned copies (`host_outputs`: no blocking `.cpu()` when the audio goes to the client).
    """

    host_inputs = True
    host_outputs = True
    side_stream = True
    pad_frames: int = 0  # chunks shorter than this are padded to it (one shape: no per-length costs)

    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, cfg.hidden_size)
        self.register_buffer("code_offset", torch.arange(cfg.num_quantizers)[None, :, None] * cfg.codebook_size,
                             persistent=False)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList(UpsampleStage(cfg.hidden_size, f) for f in cfg.upsampling_ratios)
        decoder: list[nn.Module] = [CausalConv1d(cfg.hidden_size, cfg.decoder_dim, 7)]
        decoder += [DecoderBlock(cfg.decoder_dim // 2**i, rate) for i, rate in enumerate(cfg.upsample_rates)]
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        decoder += [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(decoder)

    @property
    def lookahead_samples(self) -> int:
        """Samples short of T * samples_per_frame: those that would need the frame after the last.

        Each decoder block's transposed conv drops one of its input steps: 480 + 60 + 12 + 3 = 555
        samples for the real model.
        """
        total, step = 0, math.prod(self.cfg.upsample_rates)  # one decoder-block input step, in samples
        for rate in self.cfg.upsample_rates:
            total += step
            step //= rate
        return total

    @property
    def exact_context_frames(self) -> int:
        """Left-context frames after which a chunk's new samples no longer depend on older frames.

        The sum of every stage's reach back: the transformer (layers * (window - 1) frames) and
        each causal conv's (kernel - 1) * dilation steps at its rate. 578 for the real model, far above
        the reference's 25: its chunked audio is an approximation of one-shot decoding.
        """
        cfg = self.cfg
        reach = float(cfg.num_layers * (cfg.sliding_window - 1))
        rate = 1
        for factor in cfg.upsampling_ratios:
            rate *= factor
            reach += 6 / rate  # ConvNeXt depthwise conv, kernel 7
        reach += 6 / rate  # first decoder conv, kernel 7
        for up in cfg.upsample_rates:
            rate *= up
            reach += 6 * (1 + 3 + 9) / rate  # residual units: kernel 7, dilations 1, 3, 9
        reach += 6 / rate  # last conv, kernel 7
        return math.ceil(reach)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] -> audio [B, T * samples_per_frame - lookahead_samples] in [-1, 1]."""
        if codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"Code2Wav expects {self.cfg.num_quantizers} codebooks per frame, got codes "
                             f"of shape {tuple(codes.shape)} (want [batch, {self.cfg.num_quantizers}, frames])")
        hidden = self.code_embedding(codes + self.code_offset).mean(dim=1)
        x = self.pre_transformer(hidden).transpose(1, 2)
        for stage in self.upsample:
            x = stage(x)
        for layer in self.decoder:
            x = layer(x)
        return x[:, 0].clamp(-1.0, 1.0)

    def decode_chunk(self, codes: torch.Tensor, num_new: int, trim: str = "seamless") -> torch.Tensor:
        """codes [B, Q, context + new] -> the new frames' audio (see the module doc for `trim`)."""
        if trim not in TRIMS:
            raise ValueError(f"unknown trim {trim!r}; choose one of {TRIMS}")
        audio = self.forward(codes)
        return audio[:, self._new_start(codes.shape[-1] - num_new, trim):]

    def _new_start(self, context: int, trim: str = "seamless") -> int:
        """Index of a chunk's first new sample in its one-shot audio, after `context` frames."""
        start = context * self.cfg.samples_per_frame
        if trim == "seamless" and context:
            start = max(0, start - self.lookahead_samples)
        return start

    def chunked_decode(self, codes: torch.Tensor, chunk: int = 300, left_context: int = 25,
                       trim: str = "seamless") -> torch.Tensor:
        """codes [B, Q, T] decoded chunk by chunk, the chunks' audio concatenated."""
        pieces, start, total = [], 0, codes.shape[-1]
        while start < total:
            end = min(start + chunk, total)
            lo = max(0, start - left_context)
            pieces.append(self.decode_chunk(codes[..., lo:end], end - start, trim))
            start = end
        return torch.cat(pieces, dim=-1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] -> float32 audio [B, T * samples_per_frame - lookahead_samples]: what a call
        computes, and what its graphs record (`capture_plans`)."""
        return self.forward(codes).float()

    def capture_plans(self) -> list[CapturePlan]:
        """`decode` of `pad_frames`-frame chunks (none unpadded: chunk widths then vary). Warm-up and capture
        build every cuDNN plan of these shapes before the server is ready; a call of more chunks than the
        largest captured size runs eagerly."""
        if self.pad_frames < 1:
            return []
        return [CapturePlan("decode", self.decode, (((self.cfg.num_quantizers, self.pad_frames), torch.long),))]

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: Sequence[Mapping[str, torch.Tensor]],
                  options: Sequence[Mapping[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """Chunks of equal length (after padding to `pad_frames`, when set) run as one batch."""
        groups: dict[int, list[tuple[int, int, int]]] = {}  # width -> (input index, frames, new)
        for i, x in enumerate(inputs):
            frames = self._check_codes(x["codes"])
            new = int(x["codes_new"]) if "codes_new" in x else frames  # a host scalar from the worker
            if not 0 < new <= frames:
                raise ValueError(f"codes_new={new} must be in [1, {frames}] (the chunk has {frames} frames)")
            groups.setdefault(max(frames, self.pad_frames), []).append((i, frames, new))
        outputs: list[dict[str, torch.Tensor]] = [{} for _ in inputs]
        for width, rows in groups.items():
            audio = self._decode_rows(self._stack([inputs[i]["codes"] for i, _, _ in rows], width))
            for row, (i, frames, new) in enumerate(rows):
                # causal: the first (frames * samples_per_frame - lookahead) samples ignore the padding
                end = frames * self.cfg.samples_per_frame - self.lookahead_samples
                # a copy: a graph's output buffer is overwritten by its next replay
                outputs[i] = {"audio": audio[row, self._new_start(frames - new):end].clone()}
        return outputs

    def _decode_rows(self, codes: torch.Tensor) -> torch.Tensor:
        replayed = self.graphs.replay("decode", codes) if codes.shape[-1] == self.pad_frames else None
        return replayed[0] if replayed is not None else self.decode(codes)

    def _stack(self, chunks: Sequence[torch.Tensor], width: int) -> torch.Tensor:
        """Chunks [T_i, Q] -> codes [B, Q, width] (right-padded with code 0) on the module's device; host
        chunks reach a CUDA device in one pinned, non-blocking copy (a pageable one waits for the GPU)."""
        device = self.code_offset.device
        on_host = device.type == "cuda" and all(c.device.type == "cpu" for c in chunks)
        if not on_host:
            chunks = [c if c.device == device else to_device_async(c, device) for c in chunks]
        codes = torch.stack([F.pad(c.long().transpose(0, 1), (0, width - c.shape[0])) for c in chunks])
        return to_device_async(codes, device) if on_host else codes

    @torch.no_grad()
    def warm_up(self, widths: Sequence[int]) -> None:
        """Decode one chunk of each width (frames) once, so the first request does not pay one-off
        costs (kernel loading, cuDNN plans for these shapes); called before the server is ready."""
        for width in sorted(set(widths)):
            codes = torch.zeros(1, self.cfg.num_quantizers, width, dtype=torch.long, device=self.code_offset.device)
            self.forward(codes)

    def _check_codes(self, codes: torch.Tensor) -> int:
        if codes.ndim != 2 or codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"code2wav expects codes [frames, {self.cfg.num_quantizers}], got "
                             f"{tuple(codes.shape)}")
        return codes.shape[0]
