"""Rotary position embedding (RoPE) with the scalings Llama-family checkpoints use.

Supported `rope_type`s: "default", "linear" and "llama3" (Llama-3.1+ frequency-dependent scaling).
Cos/sin are computed from the positions of the step, so any position works without a cache (on CUDA in
one launch, `kernels/fused_ops.py` `rope_cos_sin`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mstar.layers.fused import FUSED

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """How to build the rotary frequencies of one model."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0  # linear and llama3 scaling factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only: context length before scaling

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")


def rope_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """The float32 inverse frequencies [head_dim // 2] for `spec`."""
    exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim
    inv_freq = 1.0 / (spec.theta**exponents)
    if spec.rope_type == "linear":
        return inv_freq / spec.factor
    if spec.rope_type == "llama3":
        return _llama3_scale(inv_freq, spec)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = spec.original_max_position / spec.low_freq_factor
    high_freq_wavelen = spec.original_max_position / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Maps positions [T] to (cos, sin) [T, head_dim] in float32; `apply_rotary` rotates q or k."""

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # `model.to(bfloat16)` would round the frequencies; keep them float32 on whatever device.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.spec).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # CUDA only: under the interpreter (CPU tests) the kernel's cos is numpy's, not torch's, and a
        # last-bit difference grows through deep stacks (Code2Wav's 29 Snakes)
        ops = FUSED.ops_for(positions) if positions.is_cuda else None
        if ops is not None and positions.dim() == 1 and not positions.is_floating_point():
            return ops.rope_cos_sin(positions, self.inv_freq)  # one launch instead of five
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, D] (rotate-half convention of HF checkpoints); one fused
    kernel on CUDA."""
    ops = FUSED.ops_for(x)
    if ops is not None and x.dim() == 3 and x.stride(2) == 1 and cos.dim() == 2 and cos.stride(1) == 1:
        return ops.rotary(x, cos, sin)
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
