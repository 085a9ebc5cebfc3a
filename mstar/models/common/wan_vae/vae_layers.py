"""Building blocks of the Wan2.2 VAE: causal 3D convolutions that stream over time, norms, blocks.

Every temporal layer is causal: frame t sees frames <= t only. A video can therefore be pushed through
in chunks of frames (one latent frame at a time when decoding) with a `CausalStream` carrying, per
layer, the few trailing frames the next chunk needs; the result equals one pass over the whole video.
Parameter names mirror Diffusers' `AutoencoderKLWan`, so its checkpoints load without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from mstar.layers.fused import FUSED


class CausalStream:
    """What each causal layer remembers between chunks of one video; use a fresh one per video.

    The first chunk of a stream also starts the video: layers that treat frame 0 specially (the
    temporal resamplers) ask `starts(layer)`.
    """

    def __init__(self) -> None:
        self._tails: dict[nn.Module, torch.Tensor] = {}
        self._started: set[nn.Module] = set()

    def tail(self, layer: nn.Module) -> torch.Tensor | None:
        """The frames `layer` set aside from the previous chunk, or None on the first chunk."""
        return self._tails.get(layer)

    def set_tail(self, layer: nn.Module, frames: torch.Tensor) -> None:
        """Remember `frames` for `layer`'s next chunk (copied, so the chunk's activations can be freed)."""
        self._tails[layer] = frames.clone()

    def starts(self, layer: nn.Module) -> bool:
        """True the first time `layer` asks (its chunk holds frame 0 of the video), False afterwards."""
        first = layer not in self._started
        self._started.add(layer)
        return first


class CausalConv3d(nn.Conv3d):
    """Conv3d padded in time on the past side only (zeros before frame 0), "same" padded in space."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int, int]) -> None:
        kernel = (kernel_size,) * 3 if isinstance(kernel_size, int) else kernel_size
        super().__init__(in_channels, out_channels, kernel, padding=(0, kernel[1] // 2, kernel[2] // 2))
        self.context = kernel[0] - 1  # past frames each output frame sees

    def forward(self, x: torch.Tensor, stream: CausalStream | None = None) -> torch.Tensor:
        """x [B, C, T, H, W] -> [B, C', T, H, W]; with `stream`, continues the previous chunk."""
        if self.context == 0:
            return super().forward(x)
        tail = stream.tail(self) if stream is not None else None
        if tail is None:
            x = F.pad(x, (0, 0, 0, 0, self.context, 0))
        else:
            x = torch.cat([tail.to(x.dtype), x], dim=2)
        if stream is not None:
            stream.set_tail(self, x[:, :, -self.context :])
        return super().forward(x)


class ChannelRMSNorm(nn.Module):
    """RMS norm across channels (dim 1) with a learned per-channel gain; float32 math for half inputs.

    `forward(x, silu=True)` also applies the SiLU that follows every norm but the attention block's. On
    CUDA (fused kernels on, x contiguous) both run as one kernel (`models/common/wan_vae/wan_vae_ops.py`) that
    rounds once; the PyTorch form (CPU, kernels off) rounds after the norm, each product and the SiLU.
    """

    def __init__(self, dim: int, spatial_dims: int) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *(1,) * spatial_dims))

    def forward(self, x: torch.Tensor, silu: bool = False) -> torch.Tensor:
        """Same shape as x."""
        if x.is_contiguous() and not torch.compiler.is_compiling() and FUSED.ops_for(x) is not None:
            from mstar.models.common.wan_vae.wan_vae_ops import channel_rms_norm

            return channel_rms_norm(x, self.gamma, self.scale, silu)
        normed = F.normalize(x.float() if x.dtype in (torch.float16, torch.bfloat16) else x, dim=1)
        normed = normed.to(x.dtype) * self.scale * self.gamma
        return F.silu(normed) if silu else normed


class ResidualBlock(nn.Module):
    """norm -> SiLU -> causal conv, twice, plus a (1x1x1-projected when widths differ) shortcut."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm1 = ChannelRMSNorm(in_dim, spatial_dims=3)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3)
        self.norm2 = ChannelRMSNorm(out_dim, spatial_dims=3)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def forward(self, x: torch.Tensor, stream: CausalStream | None = None) -> torch.Tensor:
        """[B, in_dim, T, H, W] -> [B, out_dim, T, H, W]."""
        shortcut = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        x = self.conv1(self.norm1(x, silu=True), stream)
        x = self.conv2(self.norm2(x, silu=True), stream)
        return x + shortcut


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame (frames do not see each other)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = ChannelRMSNorm(dim, spatial_dims=2)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same shape as x [B, C, T, H, W]."""
        b, _, t, h, w = x.shape
        frames = rearrange(x, "b c t h w -> (b t) c h w")
        qkv = rearrange(self.to_qkv(self.norm(frames)), "n c h w -> n 1 (h w) c")
        q, k, v = qkv.chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v)
        out = self.proj(rearrange(out, "n 1 (h w) c -> n c h w", h=h, w=w))
        return x + rearrange(out, "(b t) c h w -> b c t h w", b=b, t=t)


class MidBlock(nn.Module):
    """Residual block, attention, residual block: the bottleneck of the encoder and the decoder."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor, stream: CausalStream | None = None) -> torch.Tensor:
        """Same shape as x."""
        x = self.resnets[0](x, stream)
        return self.resnets[1](self.attentions[0](x), stream)


def patchify(video: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, C * p * p, T, H / p, W / p], channel order (c, pw, ph) as in Wan."""
    _, _, _, h, w = video.shape
    if h % patch_size or w % patch_size:
        raise ValueError(f"height {h} and width {w} must be multiples of the patch size {patch_size}")
    return rearrange(video, "b c t (h ph) (w pw) -> b (c pw ph) t h w", ph=patch_size, pw=patch_size)


def unpatchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """The inverse of `patchify`."""
    return rearrange(x, "b (c pw ph) t h w -> b c t (h ph) (w pw)", ph=patch_size, pw=patch_size)
