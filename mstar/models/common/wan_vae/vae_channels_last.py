"""The Wan2.2 VAE decoder in channels-last (NDHWC) memory, with the convolutions' biases folded away.

cuDNN runs the VAE's convolutions as NDHWC implicit GEMMs: fed NCDHW tensors it converts the layout
around every one, and PyTorch adds each convolution's bias as a pass of its own. `decode_chunk` walks the
same modules as `Decoder.forward` (their parameters as they are, so Diffusers state dicts still load) with
every activation in torch.channels_last_3d: per-frame 2D layers then see a chunk's frames as a
channels-last view, never a copy. The convolutions run without their biases, which the next kernel
reading the output adds anyway (`models/common/wan_vae/wan_vae_cl_ops.py` on CUDA):

- conv_in's and each conv1's by the channel norm after it, which also writes its output after the causal
  conv's past frames (no concatenation copies the chunk);
- conv2's and the 1x1 shortcut's (or conv_in's, carried through the identity) by the residual add;
- the upsampler's time conv's by the copy interleaving its two frame halves, which also places frame 0;
- the upsampler's spatial conv's by the level's channels-to-pixels shortcut add, read in place.

Only `to_qkv` (one small map a chunk) keeps its bias, and `conv_out`'s (12 channels) is added after it;
on CUDA conv_out runs with its filters zero-padded to 32 (`_conv_weight`: cuDNN's kernel for 12 outputs
is much slower).

`conv_dtype` (e.g. float16 for a float32 VAE) runs the convolutions alone in that dtype: their inputs are
written in it (the norms round once, from float32), their weights are cast copies made on first use, and
the residual stream, the biases and every sum stay in the VAE's dtype. float16 keeps TF32's 10-bit
mantissa and runs cuDNN's tensor cores at twice TF32's rate; its range (65,504) is the cost.

Elsewhere (CPU, kernels off) PyTorch forms stand in for the kernels, and conv outputs are made
channels-last (CPU conv3d returns NCDHW). Results equal `Decoder.forward`'s up to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.layers.fused import FUSED
from mstar.models.common.derived import derived
from mstar.models.common.wan_vae.vae_blocks import ResidualUpBlock, Upsample, channels_to_space_time
from mstar.models.common.wan_vae.vae_layers import (
    AttentionBlock,
    CausalConv3d,
    CausalStream,
    ChannelRMSNorm,
    MidBlock,
    ResidualBlock,
)

CL3D = torch.channels_last_3d


def to_channels_last(module: nn.Module) -> None:
    """Make every conv weight under `module` channels-last in place (once: a no-op when they already are).

    The parameters stay the same objects; an NCDHW decode with such weights is still correct (cuDNN then
    converts its inputs instead)."""
    for conv in module.modules():
        if isinstance(conv, (nn.Conv2d, nn.Conv3d)):
            fmt = CL3D if conv.weight.dim() == 5 else torch.channels_last
            if not conv.weight.is_contiguous(memory_format=fmt):
                conv.weight.data = conv.weight.data.contiguous(memory_format=fmt)


def decode_chunk(decoder: nn.Module, z: torch.Tensor, stream: CausalStream,
                 conv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`Decoder.forward(z, stream)` in channels-last: patchified frames [B, out_channels, T, H, W] in z's dtype,
    the convolutions in `conv_dtype` (None: z's)."""
    z = z.contiguous(memory_format=CL3D)
    cd = conv_dtype or z.dtype
    x = _causal_conv(decoder.conv_in, z, stream, cd)
    x = _mid_block(decoder.mid_block, x.to(z.dtype), decoder.conv_in.bias, stream, cd)
    for block in decoder.up_blocks:
        x = _up_block(block, x, stream, cd)
    conv_out = decoder.conv_out
    out = _norm_conv(decoder.norm_out, conv_out, x, stream, cd, wide=x.is_cuda)
    return out[:, : conv_out.out_channels].to(z.dtype).add_(conv_out.bias.view(1, -1, 1, 1, 1))


NARROW_CONV_CHANNELS = 32  # conv_out's 12 output channels are zero-padded to this many on CUDA


def _conv_weight(conv: nn.Conv2d | nn.Conv3d, dtype: torch.dtype, wide: bool = False) -> torch.Tensor:
    """conv's weight in `dtype`, with `wide` zero filters appended up to NARROW_CONV_CHANNELS outputs; a copy
    made once per weight version (`models/common/derived.py`; conv's own weight when neither applies).

    For conv_out (256 -> 12 channels) cuDNN picks a kernel with a 16-wide tile that is several times
    slower than the one it picks for 32 outputs (the 20 extra are zeros, sliced off). The 12 channels
    differ only by TF32 rounding."""
    weight = conv.weight
    wide = wide and weight.shape[0] < NARROW_CONV_CHANNELS
    if weight.dtype == dtype and not wide:
        return weight

    def make() -> torch.Tensor:
        rows = NARROW_CONV_CHANNELS if wide else weight.shape[0]
        fmt = CL3D if weight.dim() == 5 else torch.channels_last
        out = weight.new_zeros(rows, *weight.shape[1:], dtype=dtype).contiguous(memory_format=fmt)
        out[: weight.shape[0]] = weight
        return out

    return derived(conv, f"weight_{str(dtype).removeprefix('torch.')}{'_wide' if wide else ''}", (weight,), make)


def _mid_block(block: MidBlock, x: torch.Tensor, x_bias: torch.Tensor, stream: CausalStream,
               cd: torch.dtype) -> torch.Tensor:
    """`MidBlock.forward` of x + x_bias (conv_in's bias, carried into the first block); convolutions in cd."""
    x = _residual(block.resnets[0], x, stream, cd, x_bias)
    return _residual(block.resnets[1], _attention(block.attentions[0], x, cd), stream, cd)


def _residual(block: ResidualBlock, x: torch.Tensor, stream: CausalStream, cd: torch.dtype,
              x_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`ResidualBlock.forward` of x + x_bias (the bias of x's conv, not yet added)."""
    h = _norm_conv(block.norm1, block.conv1, x, stream, cd, bias=x_bias)
    h = _norm_conv(block.norm2, block.conv2, h, stream, cd, bias=block.conv1.bias)
    if block.conv_shortcut is None:
        return add_biased(h, block.conv2.bias, x, x_bias, out=_out(h, x.dtype))
    assert x_bias is None, "a pending input bias does not pass through a 1x1 shortcut here"
    shortcut = _conv(block.conv_shortcut, x.to(cd))
    return add_biased(h, block.conv2.bias, shortcut, block.conv_shortcut.bias, out=_out(h, x.dtype))


def _attention(block: AttentionBlock, x: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """`AttentionBlock.forward`: each frame's pixels are rows of C channels already, so q, k, v are views."""
    b, c, t, h, w = x.shape
    normed = norm_ndhwc(block.norm, x, out=_empty(b, c, t, h, w, x, cd))
    qkv = _conv(block.to_qkv, _frames(normed), bias=True)  # [B T, 3C, H, W]
    q, k, v = qkv.permute(0, 2, 3, 1).reshape(b * t, 1, h * w, 3 * c).chunk(3, dim=-1)
    out = F.scaled_dot_product_attention(q, k, v).reshape(b * t, h, w, c).permute(0, 3, 1, 2)
    y = _video(_conv(block.proj, out), b)
    return add_biased(y, block.proj.bias, x, None, out=_out(y, x.dtype))


def _up_block(block: ResidualUpBlock, x: torch.Tensor, stream: CausalStream, cd: torch.dtype) -> torch.Tensor:
    """`ResidualUpBlock.forward`, with `Upsample.forward` inlined so its conv's bias joins the shortcut add."""
    starts_video = stream.starts(block)
    x_in = x
    for resnet in block.resnets:
        x = _residual(resnet, x, stream, cd)
    up = block.upsampler
    if up is None:
        return x
    if up.time_conv is not None:
        x = _upsample_time(up, x, stream, cd)
    conv = up.resample[1]
    y = _video(_conv(conv, up.resample[0](_frames(x.to(cd)))), x.shape[0])  # cast before the 2x2 upsampling
    drop = block.factor_t - 1 if starts_video else 0
    return add_space_time(y, conv.bias, x_in, block.factor_t, drop, out=_out(y, x.dtype))


def _upsample_time(up: Upsample, x: torch.Tensor, stream: CausalStream, cd: torch.dtype) -> torch.Tensor:
    """`Upsample._upsample_time`: frame t's time conv yields frames 2t, 2t + 1 (frame 0 of the video one)."""
    b, c, t, h, w = x.shape
    head = 1 if stream.starts(up) else 0
    out = _empty(b, c, head + 2 * (t - head), h, w, x)
    out_rows = out.permute(0, 2, 3, 4, 1)  # [B, T', H, W, C], contiguous
    if head:
        out_rows[:, :1].copy_(x[:, :, :1].permute(0, 2, 3, 4, 1))
    if t > head:
        y = _causal_conv(up.time_conv, x[:, :, head:], stream, cd)  # [B, (2 C), T, H, W]
        halves = y.permute(0, 2, 3, 4, 1).view(b, t - head, h, w, 2, c).permute(0, 1, 4, 2, 3, 5)
        bias = up.time_conv.bias.view(2, 1, 1, c)
        torch.add(halves, bias, out=out_rows[:, head:].view(b, t - head, 2, h, w, c))
    return out


def _norm_conv(norm: ChannelRMSNorm, conv: CausalConv3d, x: torch.Tensor, stream: CausalStream, cd: torch.dtype,
               bias: torch.Tensor | None = None, wide: bool = False) -> torch.Tensor:
    """conv(SiLU(norm(x + bias)), stream) in cd without conv's bias (`wide`: its filters zero-padded, see
    `_conv_weight`): the norm writes into the conv's input buffer after the past frames (the stream's, or
    zeros before frame 0)."""
    b, c, t, h, w = x.shape
    past = conv.context
    buf = _empty(b, c, past + t, h, w, x, cd)
    if past:
        tail = stream.tail(conv)
        if tail is None:
            buf[:, :, :past].zero_()
        else:
            buf[:, :, :past].copy_(tail)
    norm_ndhwc(norm, x, bias, silu=True, out=buf[:, :, past:])
    if past:
        stream.set_tail(conv, buf[:, :, -past:])
    return _conv(conv, buf, wide=wide)


def _causal_conv(conv: CausalConv3d, x: torch.Tensor, stream: CausalStream, cd: torch.dtype) -> torch.Tensor:
    """`conv(x, stream)` in cd without its bias, the past frames concatenated (its input is no norm's output)."""
    tail = stream.tail(conv)
    if tail is None:
        tail = _empty(x.shape[0], x.shape[1], conv.context, *x.shape[3:], like=x, dtype=cd).zero_()
    x = torch.cat([tail, x.to(cd)], dim=2)  # stays channels-last: both parts are
    stream.set_tail(conv, x[:, :, -conv.context :])
    return _conv(conv, x)


def _conv(conv: nn.Conv2d | nn.Conv3d, x: torch.Tensor, bias: bool = False, wide: bool = False) -> torch.Tensor:
    """conv's convolution of a channels-last x in x's dtype (its bias only when `bias`; `wide`: see
    `_conv_weight`), channels-last out."""
    fn = F.conv3d if x.dim() == 5 else F.conv2d
    weight = _conv_weight(conv, x.dtype, wide)
    b = conv.bias.to(x.dtype) if bias else None
    y = fn(x, weight, b, conv.stride, conv.padding, conv.dilation, conv.groups)
    return _cl(y)  # a no-op on CUDA (cuDNN answers in the input's layout); CPU conv3d returns NCDHW


def _cl(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=CL3D if x.dim() == 5 else torch.channels_last)


def _empty(b: int, c: int, t: int, h: int, w: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return like.new_empty(b, t, h, w, c, dtype=dtype or like.dtype).permute(0, 4, 1, 2, 3)


def _out(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where a sum that reads y is written: over y itself when y is in the stream's dtype, else a new tensor."""
    return y if y.dtype == dtype else torch.empty_like(y, dtype=dtype, memory_format=CL3D)


def _frames(x: torch.Tensor) -> torch.Tensor:
    """[B, C, T, H, W] channels-last -> [B T, C, H, W] channels-last, a view."""
    b, c, t, h, w = x.shape
    if x.is_contiguous(memory_format=CL3D):  # the canonical strides: a view's size-1 dims may get odd
        return x.as_strided((b * t, c, h, w), (h * w * c, 1, w * c, c))  # ones, which make cuDNN copy
    return x.transpose(1, 2).reshape(b * t, c, h, w)


def _video(frames: torch.Tensor, b: int) -> torch.Tensor:
    """The inverse of `_frames`, a view."""
    n, c, h, w = frames.shape
    return frames.view(b, n // b, c, h, w).transpose(1, 2)


# The kernels, or their PyTorch forms. ----------------------------------------------------------------


def _use_kernels(*tensors: torch.Tensor) -> bool:
    return not torch.compiler.is_compiling() and FUSED.ops_for(tensors[0]) is not None


def _dense_rows(x: torch.Tensor) -> bool:
    """Every batch row of x [B, C, T, H, W] is one dense [T H W, C] block (the batch stride is free)."""
    _, c, t, h, w = x.shape
    want = (1, h * w * c, w * c, c)
    return all(size == 1 or stride == need for size, stride, need in zip(x.shape[1:], x.stride()[1:], want))


def norm_ndhwc(norm: ChannelRMSNorm, x: torch.Tensor, bias: torch.Tensor | None = None, silu: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """`norm(x + bias, silu)` of a channels-last x [B, C, T, H, W], written to `out` (a channels-last view,
    e.g. into a larger buffer; new when None)."""
    if _use_kernels(x) and _dense_rows(x) and (out is None or _dense_rows(out)):
        from mstar.models.common.wan_vae.wan_vae_cl_ops import channel_rms_norm_ndhwc

        return channel_rms_norm_ndhwc(x, norm.gamma, norm.scale, bias, silu, out)
    view = (1, -1, 1, 1, 1)
    x = x if bias is None else x + bias.view(view)
    normed = F.normalize(x.float() if x.dtype in (torch.float16, torch.bfloat16) else x, dim=1)
    normed = normed.to(x.dtype) * norm.scale * norm.gamma.view(view)  # ChannelRMSNorm's PyTorch form
    normed = F.silu(normed) if silu else normed
    return _cl(normed) if out is None else out.copy_(normed)


def add_biased(a: torch.Tensor, a_bias: torch.Tensor | None, b: torch.Tensor, b_bias: torch.Tensor | None,
               out: torch.Tensor) -> torch.Tensor:
    """out = (a + a_bias) + (b + b_bias) over channels-last [B, C, T, H, W] (biases per channel, None: none)."""
    if _use_kernels(a) and all(t.is_contiguous(memory_format=CL3D) for t in (a, b, out)):
        from mstar.models.common.wan_vae import wan_vae_cl_ops

        return wan_vae_cl_ops.add_biased(a, a_bias, b, b_bias, out)
    view = (1, -1, 1, 1, 1)
    b = b if b_bias is None else b + b_bias.view(view)
    if a_bias is not None:
        a = torch.add(a, a_bias.view(view), out=out)
    return torch.add(a, b, out=out)


def add_space_time(y: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, factor_t: int, drop: int,
                   out: torch.Tensor) -> torch.Tensor:
    """out = y + bias + `channels_to_space_time(x, ...)` without its first `drop` frames (2x2 in space)."""
    channels, frames = y.shape[1:3]
    if frames != factor_t * x.shape[2] - drop or y.shape[3:] != tuple(2 * s for s in x.shape[3:]):
        raise ValueError(f"y {tuple(y.shape)} is not x {tuple(x.shape)} unfolded by ({factor_t}, 2, 2) less {drop}")
    if _use_kernels(y) and all(t.is_contiguous(memory_format=CL3D) for t in (y, x, out)):
        from mstar.models.common.wan_vae import wan_vae_cl_ops

        return wan_vae_cl_ops.add_space_time(y, bias, x, factor_t, drop, out)
    shortcut = channels_to_space_time(x, channels, factor_t, 2, starts_video=False)[:, :, drop:]
    return torch.add(torch.add(y, bias.view(1, -1, 1, 1, 1), out=out), shortcut, out=out)
