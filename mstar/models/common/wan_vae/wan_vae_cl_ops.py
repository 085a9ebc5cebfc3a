"""Triton kernels of the Wan2.2 VAE's channels-last (NDHWC) decode: each adds a convolution's bias while
doing work the decode needs anyway, so the convolutions run without theirs (PyTorch adds a conv bias as a
separate pass over the output).

- `channel_rms_norm_ndhwc(x, gamma, scale, bias, silu, out)`: (x + bias) / max(||x + bias|| over C, eps)
  * scale * gamma, then SiLU; `out` may be a view into a larger buffer (the causal conv's input after its
  past frames), so no concatenation copies the chunk.
- `add_biased(a, a_bias, b, b_bias, out)`: (a + a_bias) + (b + b_bias), the residual sum.
- `add_space_time(y, bias, x, factor_t, drop, out)`: y + bias + x's channels unfolded into factor_t x 2 x 2
  cells (`vae_blocks.channels_to_space_time`), read in place of repeat_interleave + rearrange copies.

Each program takes a tile of pixels x channels (the norm: all C channels of its pixels), so no element
needs an index division by C. All compute in float32 and round once to the output dtype. Tensors are
[B, C, T, H, W] in torch.channels_last_3d (C innermost); the PyTorch forms are in
`models/common/wan_vae/vae_channels_last.py`, which also checks the layouts before calling these. Tests run them
on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.models.common.wan_vae.wan_vae_ops import EPS

CL3D = torch.channels_last_3d


@triton.jit
def _norm_ndhwc_kernel(x_ptr, gamma_ptr, bias_ptr, out_ptr, n_pixels, n_channels, x_batch_stride,
                       out_batch_stride, scale, eps, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    pix = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    chans = tl.arange(0, BLOCK_C)
    channel_mask = chans < n_channels
    mask = (pix < n_pixels)[:, None] & channel_mask[None, :]
    batch = tl.program_id(1).to(tl.int64)
    offsets = pix.to(tl.int64)[:, None] * n_channels + chans[None, :]
    xf = tl.load(x_ptr + batch * x_batch_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        xf += tl.load(bias_ptr + chans, mask=channel_mask, other=0.0).to(tl.float32)[None, :]
    factor = scale / tl.maximum(tl.sqrt(tl.sum(xf * xf, axis=1)), eps)
    gamma = tl.load(gamma_ptr + chans, mask=channel_mask, other=0.0).to(tl.float32)
    y = xf * factor[:, None] * gamma[None, :]
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(out_ptr + batch * out_batch_stride + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_biased_kernel(a_ptr, a_bias_ptr, b_ptr, b_bias_ptr, out_ptr, n_pixels, n_channels,
                       A_BIAS: tl.constexpr, B_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    pix = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = chans < n_channels
    mask = (pix < n_pixels)[:, None] & channel_mask[None, :]
    offs = pix.to(tl.int64)[:, None] * n_channels + chans[None, :]
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if A_BIAS:
        a += tl.load(a_bias_ptr + chans, mask=channel_mask, other=0.0).to(tl.float32)[None, :]
    if B_BIAS:
        b += tl.load(b_bias_ptr + chans, mask=channel_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs, (a + b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_space_time_kernel(y_ptr, bias_ptr, x_ptr, out_ptr, n_pixels, n_channels, width, height, frames,
                           x_channels, x_width, x_height, x_frames, drop, FACTOR_T: tl.constexpr,
                           REPEATS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    pix = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # output pixels (b, t, h, w), int32
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = chans < n_channels
    mask = (pix < n_pixels)[:, None] & channel_mask[None, :]
    w2 = pix % width
    rest = pix // width
    h2 = rest % height
    rest = rest // height
    t2 = rest % frames + drop  # the frame before the video's first chunk dropped its leading ones
    batch = rest // frames
    cell = ((t2 % FACTOR_T) * 2 + h2 % 2) * 2 + w2 % 2
    x_pix = ((batch * x_frames + t2 // FACTOR_T) * x_height + h2 // 2) * x_width + w2 // 2
    src = (chans[None, :] * (FACTOR_T * 4) + cell[:, None]) // REPEATS  # the channel repeat_interleave puts there
    offs = pix.to(tl.int64)[:, None] * n_channels + chans[None, :]
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y += tl.load(bias_ptr + chans, mask=channel_mask, other=0.0).to(tl.float32)[None, :]
    y += tl.load(x_ptr + x_pix.to(tl.int64)[:, None] * x_channels + src, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _tiles(pixels: int, channels: int) -> tuple[tuple[int, int], int, int]:
    """Grid and (pixel, channel) tile of the elementwise kernels: up to 128 channels x 4k values a program."""
    block_c = min(triton.next_power_of_2(channels), 128)
    block_p = 4096 // block_c
    return (triton.cdiv(pixels, block_p), triton.cdiv(channels, block_c)), block_p, block_c


def channel_rms_norm_ndhwc(x: torch.Tensor, gamma: torch.Tensor, scale: float, bias: torch.Tensor | None = None,
                           silu: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """The channel RMS norm of `models/common/wan_vae/wan_vae_ops.py` on x [B, C, T, H, W] whose batch rows are dense
    [pixels, C] blocks (channels-last), with `bias` (C values) added first; writes `out` (same shape and
    row layout, any batch stride; new when None) and returns it."""
    out = torch.empty_like(x, memory_format=CL3D) if out is None else out
    batch, channels = x.shape[:2]
    pixels = x[0, 0].numel()
    block_c = triton.next_power_of_2(channels)
    block_p = max(1, 4096 // block_c)  # ~4k values a program: 4 pixels at 1024 channels, 16 at 256
    grid = (triton.cdiv(pixels, block_p), batch)
    _norm_ndhwc_kernel[grid](x, gamma.reshape(-1), bias if bias is not None else gamma, out, pixels, channels,
                             x.stride(0), out.stride(0), float(scale), EPS, HAS_BIAS=bias is not None, SILU=silu,
                             BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4)
    return out


def add_biased(a: torch.Tensor, a_bias: torch.Tensor | None, b: torch.Tensor, b_bias: torch.Tensor | None,
               out: torch.Tensor) -> torch.Tensor:
    """out = (a + a_bias) + (b + b_bias), biases over dim 1 (None: none); all dense channels-last, one shape
    (out may be a)."""
    channels = out.shape[1]
    grid, block_p, block_c = _tiles(out.numel() // channels, channels)
    _add_biased_kernel[grid](a, a_bias if a_bias is not None else a, b, b_bias if b_bias is not None else b, out,
                             out.numel() // channels, channels, A_BIAS=a_bias is not None,
                             B_BIAS=b_bias is not None, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4)
    return out


def add_space_time(y: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, factor_t: int, drop: int,
                   out: torch.Tensor) -> torch.Tensor:
    """out = y + bias + channels_to_space_time(x, C, factor_t, 2)[:, :, drop:]; y, out [B, C, T', 2H, 2W],
    x [B, C_in, T, H, W] (T' = factor_t T - drop), all dense channels-last (out may be y)."""
    channels, frames, height, width = y.shape[1:]
    x_channels, x_frames, x_height, x_width = x.shape[1:]
    repeats = channels * factor_t * 4 // x_channels
    pixels = out.numel() // channels
    grid, block_p, block_c = _tiles(pixels, channels)
    _add_space_time_kernel[grid](y, bias, x, out, pixels, channels, width, height, frames, x_channels, x_width,
                                 x_height, x_frames, drop, FACTOR_T=factor_t, REPEATS=repeats, BLOCK_P=block_p,
                                 BLOCK_C=block_c, num_warps=4)
    return out
