"""Checks of Code2Wav's fused SnakeBeta (`mstar/kernels/snake.py`) against the PyTorch form of
`layers.snake.SnakeBeta`, and of SNAC's Snake (Orpheus) against its own PyTorch form; run with TRITON_INTERPRET=1 (by test_qwen3_omni_code2wav_kernels.py, in a
fresh process).

float32 checks the math (rows of one and of several time blocks, a single step); bfloat16 checks that the
kernel rounds the float32 formula once (the interpreter rounds float32 -> bf16 toward zero, which the check
mirrors); the tiny Code2Wav decodes the same audio with the kernel as without.
"""

from __future__ import annotations

import torch

from mstar.kernels import snake
from mstar.layers.fused import fused_kernels
from mstar.layers.snake import SnakeBeta
from mstar.models.qwen3_omni.code2wav import Code2Wav
from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig


def torch_form(fn, *args):
    with fused_kernels(False):
        return fn(*args)


def _snake(channels: int) -> SnakeBeta:
    module = SnakeBeta(channels)
    with torch.no_grad():
        module.alpha.normal_(0, 0.5)
        module.beta.normal_(0, 0.5)
    return module


def check_float32() -> None:
    for shape in ((2, 24, 37), (1, 7, 1), (3, 5, 2100)):
        x = torch.randn(*shape) * 3
        module = _snake(shape[1])
        got, want = module(x), torch_form(module, x)
        assert got.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    strided = torch.randn(2, 9, 4).transpose(1, 2)  # not contiguous: the PyTorch form serves
    module = _snake(4)
    assert torch.equal(module(strided), torch_form(module, strided))
    try:
        snake.snake_beta(strided, module.alpha, module.beta)
    except ValueError:
        pass
    else:
        raise AssertionError("a strided x should be refused")


def _toward_zero(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 rounded toward zero (the low 16 bits dropped), as the interpreter rounds."""
    return (x.view(torch.int32) & -65536).view(torch.float32).bfloat16()


def check_bfloat16() -> None:
    """The kernel's bf16 output is the float32 formula on the bf16 inputs, rounded once."""
    x = (torch.randn(2, 16, 300) * 3).bfloat16()
    module = _snake(16).bfloat16()
    got = module(x)
    xf = x.float()
    alpha, beta = module.alpha.float().exp()[None, :, None], module.beta.float().exp()[None, :, None]
    truth = xf + torch.sin(xf * alpha) ** 2 / (beta + 1e-9)
    assert got.dtype == torch.bfloat16
    once = _toward_zero(truth)
    assert (got == once).float().mean() > 0.99  # a float32 sine may differ in its last bit, rarely
    assert (torch_form(module, x) == once).float().mean() < 0.9, "the PyTorch form rounds after each step"


def check_code2wav() -> None:
    torch.manual_seed(0)
    model = Code2Wav(Code2WavConfig.tiny()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    codes = torch.randint(0, model.cfg.codebook_size, (2, model.cfg.num_quantizers, 9))
    with torch.no_grad():
        got, want = model(codes), torch_form(model, codes)
    # 29 Snakes deep, a last-bit difference of one sine grows: numpy 2.4's float32 sine (the interpreter's)
    # left one of 198 samples 1.5e-4 from torch's; check_float32 holds the kernel itself to 1e-5
    torch.testing.assert_close(got, want, atol=5e-4, rtol=0)


def check_snac_snake() -> None:
    """Orpheus's SNAC Snake (one linear-scale alpha per channel) through the same kernel."""
    from mstar.models.orpheus.snac import Snake

    for shape in ((2, 24, 37), (1, 7, 1), (3, 5, 2100)):
        module = Snake(shape[1])
        with torch.no_grad():
            module.alpha.uniform_(0.2, 3.0)
        x = torch.randn(*shape) * 3
        got, want = module(x), torch_form(module, x)
        assert got.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    try:
        snake.snake(torch.randn(2, 4, 9).transpose(1, 2), torch.ones(9))
    except ValueError:
        pass
    else:
        raise AssertionError("a strided x should be refused")


if __name__ == "__main__":
    check_snac_snake()
    check_float32()
    check_bfloat16()
    check_code2wav()
    print("snake ok")
