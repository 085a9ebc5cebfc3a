"""Fused Triton kernels for Snake activations (Code2Wav, Cosmos3's sound decoder, SNAC): one read, one write.

`snake_beta(x, alpha, beta)`: x [B, C, T] contiguous; out = x + sin(x * e^alpha[c])^2 / (e^beta[c] + 1e-9),
computed in float32 and rounded once to x's dtype. `snake(x, alpha)` is SNAC's form with one linear-scale
parameter: out = x + sin(alpha[c] * x)^2 / (alpha[c] + 1e-9). The PyTorch form is five elementwise kernels (a product,
the sine, the square, a product, the sum), each a pass over activations that reach [B, 96, ~96000] per
decoded chunk, and rounds after each in bf16.

Each program owns BLOCK consecutive time steps of one (batch, channel) row: the row's parameters are
loaded once, the time steps are coalesced. Use through `layers.snake.SnakeBeta` and `orpheus.snac.Snake`;
tests run it on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-9  # as the reference adds to e^beta (SNAC's Snake: to alpha)


@triton.jit
def snake_of(x, alpha, inv_beta):
    """x + sin(alpha x)^2 * inv_beta, in float32 (shared with the fused SNAC kernels, `snac_ops.py`)."""
    s = tl.sin(alpha * x)
    return x + inv_beta * s * s


@triton.jit
def _snake_beta_kernel(x_ptr, alpha_ptr, beta_ptr, out_ptr, n_channels, n_steps, eps, BLOCK: tl.constexpr,
                       LOG_SCALE: tl.constexpr):
    row = tl.program_id(0)  # rows on the first grid axis: B * C exceeds the others' 65535 limit
    channel = row % n_channels
    if LOG_SCALE:  # SnakeBeta
        alpha = tl.exp(tl.load(alpha_ptr + channel).to(tl.float32))
        inv_beta = 1.0 / (tl.exp(tl.load(beta_ptr + channel).to(tl.float32)) + eps)
    else:  # SNAC's Snake: beta_ptr is alpha_ptr
        alpha = tl.load(alpha_ptr + channel).to(tl.float32)
        inv_beta = 1.0 / (alpha + eps)
    steps = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = steps < n_steps
    offsets = row.to(tl.int64) * n_steps + steps  # past 2**31 elements at large batches
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, snake_of(x, alpha, inv_beta).to(out_ptr.dtype.element_ty), mask=mask)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """x + sin(x * e^alpha)^2 / (e^beta + 1e-9) per channel (dim 1), in x's dtype, rounded once; x [B, C, T]
    contiguous, alpha and beta C values each (log scale, as the checkpoint stores them)."""
    if x.dim() != 3 or not x.is_contiguous() or alpha.numel() != x.shape[1] or beta.numel() != x.shape[1]:
        raise ValueError(f"x of shape {tuple(x.shape)} (contiguous: {x.is_contiguous()}), alpha of {alpha.numel()} "
                         f"and beta of {beta.numel()} values: need a contiguous [B, C, T] x and C of each")
    return _launch(x, alpha, beta, log_scale=True)


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """x + sin(alpha * x)^2 / (alpha + 1e-9) per channel (dim 1), in x's dtype, rounded once; x [B, C, T]
    contiguous, alpha C values (linear scale, SNAC's parameter)."""
    if x.dim() != 3 or not x.is_contiguous() or alpha.numel() != x.shape[1]:
        raise ValueError(f"x of shape {tuple(x.shape)} (contiguous: {x.is_contiguous()}) and alpha of "
                         f"{alpha.numel()} values: need a contiguous [B, C, T] x and C values of alpha")
    return _launch(x, alpha, alpha, log_scale=False)


def _launch(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, log_scale: bool) -> torch.Tensor:
    batch, channels, steps = x.shape
    out = torch.empty_like(x)
    block = 1024 if steps >= 1024 else triton.next_power_of_2(max(steps, 16))
    grid = (batch * channels, triton.cdiv(steps, block))
    _snake_beta_kernel[grid](x, alpha.reshape(-1), beta.reshape(-1), out, channels, steps, EPS, BLOCK=block,
                             LOG_SCALE=log_scale, num_warps=4)
    return out
