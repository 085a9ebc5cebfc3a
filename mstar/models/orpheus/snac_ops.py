"""Fused Triton kernels of the SNAC decoder (Orpheus's vocoder), float32 math, one launch where PyTorch takes several.

A 4-frame window decode is ~160 small kernels in PyTorch's form; on a GPU that also runs the LM's decode
they compete with it for the SMs, so fewer and shorter launches are what counts here. Each function
below replaces a run of PyTorch ops of `mstar/models/orpheus/snac.py`:

- `depthwise(x, weight, bias, dilation, alpha_in, alpha_out)`: [Snake] -> depthwise conv (odd taps,
  "same" zero padding) -> [Snake], the front of a residual unit (Snake, dilated conv 7, Snake) and the
  decoder's first depthwise conv (no Snakes). PyTorch's generic depthwise kernel was the vocoder's
  costliest. Snake(0) = 0, so padding before or after the first Snake is the same. A Snake inside the
  taps costs a sine per tap (seven per output, the kernel's main cost), so the decoder hands it inputs
  already through their Snake where the layer before can write them (`snake_alpha` below).
- `bias_residual(x, y, bias, snake_alpha)`: x + y + bias[c], a residual unit's end (its 1x1 conv runs
  without bias); with `snake_alpha` it also writes the next layer's Snake of the sum (the next residual
  unit's first Snake, the next block's or the output's), one sine per element.
- `transposed_conv(x, gemm_weight, bias, stride, padding, out_len)`: a transposed convolution of kernel
  2 * stride as a 1x1 convolution to every (output channel, tap) pair (cuDNN, tensor cores) and this
  fold: out[n] = bias + g[tap r of step j] + g[tap r + stride of step j - 1], (j, r) = divmod(n + padding,
  stride). cuDNN's own kernel for the first upsampling (1024 -> 512 channels, 16 steps) was a slow
  generic one.
- `table_noise(x, lin, table, first_frame, steps, snake_alpha, offset)`: x + table[(first_frame * steps +
  offset + t) % N] * lin, a noise block reading its noise from the fixed table (vocoder.py) instead of a
  gathered copy (and, with `snake_alpha`, the first residual unit's Snake of it).
- `conv_out(x_snaked, weight, bias)`: tanh(conv(x_snaked)) to one channel, the decoder's last conv and tanh
  (its Snake written by the last residual unit), all channels of a block of steps in one program.
- `sum_codes(codes, tables, strides)`: the quantizer: each level's code looked up in its projected
  codebook (`tables[l]` [codebook, latent]: the codebook through out_proj, bias included), repeated to
  the latent rate and summed, written [B, latent, T].

Tests run them on CPU with TRITON_INTERPRET=1 (tests/models/orpheus_snac_kernels_check.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels.snake import EPS, snake_of


@triton.jit
def _depthwise_kernel(x_ptr, w_ptr, b_ptr, a_in_ptr, a_out_ptr, out_ptr, n_channels, n_steps, dilation, eps,
                      TAPS: tl.constexpr, SNAKE_IN: tl.constexpr, SNAKE_OUT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # (batch, channel) rows on the first axis: B * C can pass 65535
    channel = row % n_channels
    steps = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = steps < n_steps
    base = row.to(tl.int64) * n_steps
    acc = tl.zeros((BLOCK,), dtype=tl.float32) + tl.load(b_ptr + channel).to(tl.float32)
    a_in = tl.load(a_in_ptr + channel).to(tl.float32)  # read but unused without SNAKE_IN
    inv_in = 1.0 / (a_in + eps)
    for k in tl.static_range(TAPS):
        src = steps + (k - TAPS // 2) * dilation
        v = tl.load(x_ptr + base + src, mask=mask & (src >= 0) & (src < n_steps), other=0.0).to(tl.float32)
        if SNAKE_IN:
            v = snake_of(v, a_in, inv_in)
        acc += v * tl.load(w_ptr + channel * TAPS + k).to(tl.float32)
    if SNAKE_OUT:
        a_out = tl.load(a_out_ptr + channel).to(tl.float32)
        acc = snake_of(acc, a_out, 1.0 / (a_out + eps))
    tl.store(out_ptr + base + steps, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_residual_kernel(x_ptr, y_ptr, b_ptr, a_ptr, out_ptr, snaked_ptr, n_channels, n_steps, eps,
                          SNAKE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    channel = row % n_channels
    steps = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = steps < n_steps
    offsets = row.to(tl.int64) * n_steps + steps
    bias = tl.load(b_ptr + channel).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = x + y + bias
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
    if SNAKE:  # the next layer's Snake of this output, written beside it
        alpha = tl.load(a_ptr + channel).to(tl.float32)
        tl.store(snaked_ptr + offsets, snake_of(out, alpha, 1.0 / (alpha + eps)).to(snaked_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _fold_kernel(g_ptr, b_ptr, out_ptr, n_channels, in_steps, out_steps, stride, padding, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # (batch, output channel)
    channel = row % n_channels
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < out_steps
    m = n + padding
    j = m // stride
    r = m - j * stride
    # g rows of this output channel: 2 * stride taps, each in_steps long
    g_row = g_ptr + row.to(tl.int64) * 2 * stride * in_steps
    early = tl.load(g_row + r * in_steps + j, mask=mask & (j < in_steps), other=0.0).to(tl.float32)
    late = tl.load(g_row + (r + stride) * in_steps + j - 1, mask=mask & (j >= 1) & (j - 1 < in_steps),
                   other=0.0).to(tl.float32)
    out = early + late + tl.load(b_ptr + channel).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * out_steps + n, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _table_noise_kernel(x_ptr, lin_ptr, table_ptr, first_ptr, a_ptr, out_ptr, snaked_ptr, n_channels, n_steps,
                        steps_per_frame, offset, table_len, eps, SNAKE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    batch = row // n_channels
    steps = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = steps < n_steps
    offsets = row.to(tl.int64) * n_steps + steps
    start = tl.load(first_ptr + batch).to(tl.int64) * steps_per_frame + offset
    noise = tl.load(table_ptr + (start + steps) % table_len, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    lin = tl.load(lin_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = x + noise * lin
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
    if SNAKE:
        alpha = tl.load(a_ptr + row % n_channels).to(tl.float32)
        tl.store(snaked_ptr + offsets, snake_of(out, alpha, 1.0 / (alpha + eps)).to(snaked_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _conv_out_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n_channels, n_steps, TAPS: tl.constexpr, C_TILES: tl.constexpr,
                     BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
    # x is already through the Snake; a program owns BLOCK steps of one batch row, all channels as tiles
    batch = tl.program_id(0)
    steps = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = steps < n_steps
    acc = tl.zeros((BLOCK_C, BLOCK), dtype=tl.float32)
    for tile in range(C_TILES):  # a constexpr bound: the interpreter cannot loop over runtime ints
        c = tile * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < n_channels
        rows = x_ptr + (batch.to(tl.int64) * n_channels + c.to(tl.int64))[:, None] * n_steps
        for k in tl.static_range(TAPS):
            src = steps + (k - TAPS // 2)
            inside = mask & (src >= 0) & (src < n_steps)
            v = tl.load(rows + src[None, :], mask=c_mask[:, None] & inside[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c * TAPS + k, mask=c_mask, other=0.0).to(tl.float32)
            acc += v * w[:, None]
    total = tl.sum(acc, axis=0) + tl.load(b_ptr).to(tl.float32)
    out = 1.0 - 2.0 / (tl.exp(2.0 * total) + 1.0)  # tanh
    tl.store(out_ptr + batch.to(tl.int64) * n_steps + steps, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_codes_kernel(c0_ptr, c1_ptr, c2_ptr, t0_ptr, t1_ptr, t2_ptr, out_ptr, n_steps, latent,
                      S0: tl.constexpr, S1: tl.constexpr, BLOCK_D: tl.constexpr):
    position = tl.program_id(0)  # batch * n_steps + step
    batch = position // n_steps
    step = position - batch * n_steps
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < latent
    code0 = tl.load(c0_ptr + batch * (n_steps // S0) + step // S0).to(tl.int64)
    code1 = tl.load(c1_ptr + batch * (n_steps // S1) + step // S1).to(tl.int64)
    code2 = tl.load(c2_ptr + batch * n_steps + step).to(tl.int64)
    z = tl.load(t0_ptr + code0 * latent + d, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(t1_ptr + code1 * latent + d, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(t2_ptr + code2 * latent + d, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + (batch.to(tl.int64) * latent + d) * n_steps + step
    tl.store(out, z.to(out_ptr.dtype.element_ty), mask=mask)


def _block(steps: int) -> int:
    return 1024 if steps >= 1024 else triton.next_power_of_2(max(steps, 16))


def _check(x: torch.Tensor, channels_of: torch.Tensor | None = None) -> tuple[int, int, int]:
    if x.dim() != 3 or not x.is_contiguous():
        raise ValueError(f"x of shape {tuple(x.shape)} (contiguous: {x.is_contiguous()}): need a contiguous [B, C, T]")
    if channels_of is not None and channels_of.numel() != x.shape[1]:
        raise ValueError(f"{channels_of.numel()} per-channel values for x of {x.shape[1]} channels")
    return x.shape


def depthwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dilation: int = 1,
              alpha_in: torch.Tensor | None = None, alpha_out: torch.Tensor | None = None) -> torch.Tensor:
    """[Snake(alpha_in)] -> depthwise conv (weight [C, 1, taps], odd taps, zero padding keeping the length)
    -> [Snake(alpha_out)]; x [B, C, T] contiguous, out in x's dtype."""
    batch, channels, steps = _check(x, bias)
    taps = weight.shape[-1]
    if weight.numel() != channels * taps or taps % 2 == 0:
        raise ValueError(f"depthwise weight {tuple(weight.shape)}: need [C, 1, odd taps] for C = {channels}")
    out = torch.empty_like(x)
    block = _block(steps)
    _depthwise_kernel[(batch * channels, triton.cdiv(steps, block))](
        x, weight, bias, alpha_in if alpha_in is not None else bias, alpha_out if alpha_out is not None else bias,
        out, channels, steps, dilation, EPS, TAPS=taps, SNAKE_IN=alpha_in is not None,
        SNAKE_OUT=alpha_out is not None, BLOCK=block, num_warps=4)
    return out


def _snaked_like(x: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
    if alpha is not None and alpha.numel() != x.shape[1]:
        raise ValueError(f"snake alpha of {alpha.numel()} values for x of {x.shape[1]} channels")
    return torch.empty_like(x) if alpha is not None else x  # x: a placeholder pointer, never written


def bias_residual(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor,
                  snake_alpha: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x + y + bias[c], and with `snake_alpha` also Snake(alpha) of that sum (what the next layer reads);
    x and y [B, C, T] contiguous, of one shape. (sum, its Snake or None)."""
    batch, channels, steps = _check(x, bias)
    if y.shape != x.shape or not y.is_contiguous():
        raise ValueError(f"y {tuple(y.shape)} must be contiguous and shaped like x {tuple(x.shape)}")
    out, snaked = torch.empty_like(x), _snaked_like(x, snake_alpha)
    block = _block(steps)
    _bias_residual_kernel[(batch * channels, triton.cdiv(steps, block))](
        x, y, bias, snake_alpha if snake_alpha is not None else bias, out, snaked, channels, steps, EPS,
        SNAKE=snake_alpha is not None, BLOCK=block, num_warps=4)
    return out, (snaked if snake_alpha is not None else None)


def transposed_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """A ConvTranspose1d weight [C_in, C_out, K] as the 1x1 conv weight [C_out * K, C_in, 1] whose
    output row co * K + k is tap k of output channel co (what `transposed_conv` folds)."""
    c_in, c_out, taps = weight.shape
    return weight.permute(1, 2, 0).reshape(c_out * taps, c_in, 1).contiguous()


def transposed_conv(x: torch.Tensor, gemm_weight: torch.Tensor, bias: torch.Tensor, stride: int, padding: int,
                    out_len: int) -> torch.Tensor:
    """ConvTranspose1d of kernel 2 * stride: `gemm_weight` from `transposed_gemm_weight`, out [B, C_out,
    out_len]."""
    batch, _, steps = _check(x)
    c_out = bias.numel()
    if gemm_weight.shape[0] != 2 * stride * c_out:
        raise ValueError(f"gemm weight of {gemm_weight.shape[0]} rows: need 2 * stride * C_out = {2 * stride * c_out}")
    g = torch.nn.functional.conv1d(x, gemm_weight)
    out = torch.empty((batch, c_out, out_len), dtype=x.dtype, device=x.device)
    block = _block(out_len)
    _fold_kernel[(batch * c_out, triton.cdiv(out_len, block))](g, bias, out, c_out, steps, out_len, stride, padding,
                                                              BLOCK=block, num_warps=4)
    return out


def table_noise(x: torch.Tensor, lin: torch.Tensor, table: torch.Tensor, first_frame: torch.Tensor,
                steps_per_frame: int, snake_alpha: torch.Tensor | None = None,
                offset: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x + noise * lin, noise[b, t] = table[(first_frame[b] * steps_per_frame + offset + t) % len(table)]; with
    `snake_alpha` also Snake(alpha) of the result; `offset`: the window step x's first step is (x a span of a
    longer window). (result, its Snake or None)."""
    batch, channels, steps = _check(x)
    if lin.shape != x.shape or not lin.is_contiguous() or table.dim() != 1 or first_frame.numel() != batch:
        raise ValueError(f"lin {tuple(lin.shape)}, table {tuple(table.shape)}, first_frame of {first_frame.numel()} "
                         f"for x {tuple(x.shape)}: need lin like x, a 1-D table and one first frame per row")
    out, snaked = torch.empty_like(x), _snaked_like(x, snake_alpha)
    block = _block(steps)
    _table_noise_kernel[(batch * channels, triton.cdiv(steps, block))](
        x, lin, table, first_frame, snake_alpha if snake_alpha is not None else table, out, snaked, channels, steps,
        steps_per_frame, offset, table.numel(), EPS, SNAKE=snake_alpha is not None, BLOCK=block, num_warps=4)
    return out, (snaked if snake_alpha is not None else None)


def conv_out(x_snaked: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """tanh(conv(x_snaked)) to one channel (x already through the Snake before it): weight [1, C, odd taps],
    zero padding keeping the length; out [B, 1, T]."""
    batch, channels, steps = _check(x_snaked)
    taps = weight.shape[-1]
    if weight.numel() != channels * taps or taps % 2 == 0 or bias.numel() != 1:
        raise ValueError(f"weight {tuple(weight.shape)} and bias of {bias.numel()}: need [1, {channels}, odd taps] "
                         "and one bias")
    out = torch.empty((batch, 1, steps), dtype=x_snaked.dtype, device=x_snaked.device)
    block_c = min(64, triton.next_power_of_2(channels))
    block = 64
    _conv_out_kernel[(batch, triton.cdiv(steps, block))](
        x_snaked, weight, bias, out, channels, steps, TAPS=taps, C_TILES=triton.cdiv(channels, block_c),
        BLOCK_C=block_c, BLOCK=block, num_warps=4)
    return out


def sum_codes(codes: list[torch.Tensor], tables: list[torch.Tensor], strides: tuple[int, ...]) -> torch.Tensor:
    """sum over levels l of tables[l][codes[l]] repeated `strides[l]` times along time: [B, latent, T].
    Three levels, the last of stride 1; codes[l] [B, T // strides[l]] contiguous, tables[l] [codebook,
    latent] contiguous."""
    if len(codes) != 3 or len(tables) != 3 or strides[2] != 1:
        raise ValueError(f"{len(codes)} code levels, strides {strides}: need three levels, the last of stride 1")
    batch, steps = codes[2].shape
    latent = tables[0].shape[1]
    for c, s in zip(codes, strides):
        if c.shape != (batch, steps // s) or not c.is_contiguous():
            raise ValueError(f"codes {tuple(c.shape)} at stride {s}: need contiguous [{batch}, {steps // s}]")
    out = torch.empty((batch, latent, steps), dtype=tables[0].dtype, device=codes[0].device)
    block_d = 256
    _sum_codes_kernel[(batch * steps, triton.cdiv(latent, block_d))](
        codes[0], codes[1], codes[2], tables[0], tables[1], tables[2], out, steps, latent, S0=strides[0],
        S1=strides[1], BLOCK_D=block_d, num_warps=4)
    return out
