"""Fused Triton kernel for the Wan2.2 VAE's channel RMS norm (and the SiLU after it): one read, one write.

`channel_rms_norm(x, gamma, scale, silu)`: x [B, C, *spatial] contiguous; at every (batch, position)
out = x / max(||x over the C channels||, eps) * scale * gamma[c], then SiLU when asked, computed in
float32 and rounded once to x's dtype. It replaces F.normalize (a norm pass and a divide), two
multiplies and the SiLU, and for half inputs a float32 copy of x and a cast: six to nine passes over
activations that reach [1, 256, 4, 240, 416] per decoded chunk at 832x480.

Channels are strided by the position count, so each program owns BLOCK_S consecutive positions of
one batch row (coalesced along positions) and walks the channels twice in BLOCK_C tiles: the sums of
squares, then the scaled output (the second read of a tile mostly hits L2). Use through
`mstar/models/common/wan_vae/vae_layers.py`'s ChannelRMSNorm; tests run it on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-12  # F.normalize's default, which the reference uses


@triton.jit
def _channel_rms_norm_kernel(x_ptr, gamma_ptr, out_ptr, n_channels, n_positions, scale, eps,
                             SILU: tl.constexpr, C_TILES: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    pos = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    pos_mask = pos < n_positions
    base = tl.program_id(1).to(tl.int64) * n_channels * n_positions  # past 2**31 for long videos
    chans = tl.arange(0, BLOCK_C)
    sumsq = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for t in range(C_TILES):  # a constexpr bound: Triton 3.6's interpreter cannot loop over runtime ints
        c = t * BLOCK_C + chans
        mask = (c < n_channels)[:, None] & pos_mask[None, :]
        offsets = base + c.to(tl.int64)[:, None] * n_positions + pos[None, :]
        xf = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=0)
    factor = scale / tl.maximum(tl.sqrt(sumsq), eps)
    for t in range(C_TILES):
        c = t * BLOCK_C + chans
        channel_mask = c < n_channels
        mask = channel_mask[:, None] & pos_mask[None, :]
        offsets = base + c.to(tl.int64)[:, None] * n_positions + pos[None, :]
        xf = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        gamma = tl.load(gamma_ptr + c, mask=channel_mask, other=0.0).to(tl.float32)
        y = xf * factor[None, :] * gamma[:, None]
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def channel_rms_norm(x: torch.Tensor, gamma: torch.Tensor, scale: float, silu: bool = False) -> torch.Tensor:
    """x / max(||x||_2 over dim 1, 1e-12) * scale * gamma (then SiLU if `silu`), in x's dtype, rounded
    once; x [B, C, ...] contiguous, gamma C values (any shape of C elements, e.g. [C, 1, 1, 1])."""
    if x.dim() < 3 or not x.is_contiguous() or gamma.numel() != x.shape[1]:
        raise ValueError(f"x of shape {tuple(x.shape)} (contiguous: {x.is_contiguous()}) and gamma of "
                         f"{gamma.numel()} values: need a contiguous [B, C, ...] x and C gains")
    batch, channels = x.shape[:2]
    positions = x[0, 0].numel()
    out = torch.empty_like(x)
    block_s = 128 if batch * positions >= 128 * 1024 else 32  # small maps: more programs over the GPU
    grid = (triton.cdiv(positions, block_s), batch)
    _channel_rms_norm_kernel[grid](x, gamma.reshape(-1), out, channels, positions, float(scale), EPS,
                                   SILU=silu, C_TILES=triton.cdiv(channels, 32), BLOCK_C=32, BLOCK_S=block_s,
                                   num_warps=4)
    return out
