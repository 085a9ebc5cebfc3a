"""Code2Wav's fused SnakeBeta (mstar/kernels/snake.py) on a GPU: at the decoder's last width in bf16 it is
the float32 formula rounded once (to nearest), and more (batch x channel) rows than a CUDA grid's second
axis holds still run."""

from __future__ import annotations

import torch

from mstar.kernels.snake import snake_beta


def _truth(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf + torch.sin(xf * alpha.float().exp()[None, :, None]) ** 2 / (beta.float().exp()[None, :, None] + 1e-9)


def test_bf16_last_block_width_rounds_once():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(4, 96, 95445, device="cuda", generator=gen) * 3).bfloat16()
    alpha = (torch.randn(96, device="cuda", generator=gen) * 0.5).bfloat16()
    beta = (torch.randn(96, device="cuda", generator=gen) * 0.5).bfloat16()
    got, truth = snake_beta(x, alpha, beta), _truth(x, alpha, beta)
    assert got.dtype == torch.bfloat16
    exact = (got == truth.bfloat16()).float().mean().item()
    assert exact > 0.99, exact  # a float32 sine may differ from torch's in its last bit, rarely
    torch.testing.assert_close(got.float(), truth, rtol=2 ** -7, atol=1e-6)


def test_rows_beyond_the_second_grid_axis():
    x = torch.randn(64, 1536, 7, device="cuda")  # 98304 rows
    alpha, beta = torch.randn(1536, device="cuda") * 0.3, torch.randn(1536, device="cuda") * 0.3
    torch.testing.assert_close(snake_beta(x, alpha, beta), _truth(x, alpha, beta), rtol=1e-5, atol=1e-5)
