"""Checks of the fused SNAC kernels (`mstar/models/orpheus/snac_ops.py`) against the PyTorch form of the layers in
`mstar/models/orpheus/snac.py`; run with TRITON_INTERPRET=1 (by test_orpheus_snac_kernels.py, in a fresh
process). float32 throughout, as the vocoder runs.

Each kernel alone (edge cases: a dilated tap reaching past both ends of a short row, rows of several
blocks, transposed convs of every SNAC stride against nn.ConvTranspose1d), then the tiny vocoder's window
decode (batch of three windows, table noise) fused against unfused.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from mstar.layers.fused import fused_kernels
from mstar.models.orpheus import snac_ops
from mstar.models.orpheus.snac import BlockNoise, Quantizer, ResidualUnit, SnacConfig, Snake
from mstar.models.orpheus.tiny import TINY_SNAC
from mstar.models.orpheus.tokens import FRAME, OrpheusTokens
from mstar.models.orpheus.vocoder import OrpheusVocoder
from mstar.models.orpheus.weights import load_snac

TOL = dict(atol=2e-5, rtol=2e-5)


def torch_form(fn, *args):
    with fused_kernels(False):
        return fn(*args)


def _randomize(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():  # Snake alphas in [0.5, 1.5]: 1 / alpha stays tame
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if name.endswith("alpha")
                    else torch.randn(p.shape, generator=gen) * 0.5)
    return module


def check_residual_unit() -> None:
    for channels, dilation, steps in ((4, 9, 5), (3, 1, 2100), (2, 3, 1)):
        unit = _randomize(ResidualUnit(channels, dilation, groups=channels), channels + dilation)
        x = torch.randn(2, channels, steps)
        torch.testing.assert_close(unit(x), torch_form(unit, x), **TOL)


def check_depthwise_without_snakes() -> None:
    conv = _randomize(nn.Conv1d(5, 5, 7, padding=3, groups=5), 3)
    x = torch.randn(3, 5, 40)
    torch.testing.assert_close(snac_ops.depthwise(x, conv.weight, conv.bias), conv(x), **TOL)


def check_transposed_conv() -> None:
    import math

    for stride, steps in ((8, 3), (4, 17), (2, 1), (8, 16)):
        conv = _randomize(nn.ConvTranspose1d(6, 4, 2 * stride, stride=stride, padding=math.ceil(stride / 2),
                                             output_padding=stride % 2), stride)
        x = torch.randn(2, 6, steps)
        want = conv(x)
        got = snac_ops.transposed_conv(x, snac_ops.transposed_gemm_weight(conv.weight), conv.bias, stride,
                                       conv.padding[0], want.shape[-1])
        torch.testing.assert_close(got, want, **TOL)


def check_table_noise() -> None:
    table = torch.randn(50)
    noise = BlockNoise(table, torch.tensor([0, 3, 7]), steps=16)  # wraps past the table's end
    x, lin = torch.randn(3, 4, 48), torch.randn(3, 4, 48)
    want = x + noise.tensor(48) * lin
    got, none = snac_ops.table_noise(x, lin, table, noise.first_frame, noise.steps)
    assert none is None
    torch.testing.assert_close(got, want, **TOL)
    snake = _randomize(Snake(4), 8)
    got, snaked = snac_ops.table_noise(x, lin, table, noise.first_frame, noise.steps, snake.alpha)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(snaked, torch_form(snake, want), **TOL)
    # a span of a window: noise from window step 21 on
    shifted = BlockNoise(table, noise.first_frame, noise.steps, offset=21)
    got, _ = snac_ops.table_noise(x, lin, table, noise.first_frame, noise.steps, offset=21)
    torch.testing.assert_close(got, x + shifted.tensor(48) * lin, **TOL)
    torch.testing.assert_close(shifted.tensor(48)[..., :27], noise.tensor(48)[..., 21:], rtol=0, atol=0)


def check_bias_residual_with_snake() -> None:
    x, y, bias = torch.randn(2, 5, 1500), torch.randn(2, 5, 1500), torch.randn(5)
    snake = _randomize(Snake(5), 9)
    out, snaked = snac_ops.bias_residual(x, y, bias, snake.alpha)
    want = x + y + bias[:, None]
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(snaked, torch_form(snake, want), **TOL)


def check_conv_out() -> None:
    for channels in (6, 64, 100):  # one channel tile, a full one, two with a partial one
        snake, conv = _randomize(Snake(channels), 1), _randomize(nn.Conv1d(channels, 1, 7, padding=3), 2)
        x = torch.randn(2, channels, 300) * 0.3
        snaked = torch_form(snake, x)
        want = torch.tanh(conv(snaked))
        torch.testing.assert_close(snac_ops.conv_out(snaked, conv.weight, conv.bias), want, **TOL)


def check_decoder_with_tensor_noise() -> None:
    """Noise given as tensors (the reference's form): the noise blocks write no Snake, the units apply it."""
    decoder = load_snac(TINY_SNAC, None, torch.device("cpu"), seed=4).decoder
    x = torch.randn(2, TINY_SNAC.latent, 8)
    gen = torch.Generator().manual_seed(3)
    steps, noises = 8, []
    for rate in TINY_SNAC.decoder_rates:
        steps *= rate
        noises.append(torch.randn(2, 1, steps, generator=gen))
    with torch.no_grad():
        torch.testing.assert_close(decoder(x, noises), torch_form(decoder, x, noises), **TOL)


def check_quantizer() -> None:
    cfg = SnacConfig(encoder_dim=4, decoder_dim=32, codebook_size=64, codebook_dim=4)
    quantizer = _randomize(Quantizer(cfg), 5)
    gen = torch.Generator().manual_seed(6)
    codes = [torch.randint(0, 64, (3, n), generator=gen) for n in (2, 4, 8)]
    codes[0] = torch.randint(0, 64, (3, 2, 2), generator=gen)[:, :, 0]  # not contiguous, as split_levels gives
    torch.testing.assert_close(quantizer(codes), torch_form(quantizer, codes), **TOL)


def check_vocoder_windows() -> None:
    tokens = OrpheusTokens(base=320, codebook_size=TINY_SNAC.codebook_size, end_of_text=2, bos=None)
    vocoder = OrpheusVocoder(load_snac(TINY_SNAC, None, torch.device("cpu"), seed=3), tokens)
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, TINY_SNAC.codebook_size, (3, 4, FRAME), generator=gen)
    ids = (codes + tokens.audio_offset + torch.arange(FRAME) * TINY_SNAC.codebook_size).reshape(3, -1)
    first = torch.tensor([0, 5, 300000])
    got = vocoder.decode_windows(ids, first)
    want = torch_form(vocoder.decode_windows, ids, first)
    assert got.shape == (3, 4 * TINY_SNAC.samples_per_frame)
    torch.testing.assert_close(got, want, **TOL)
    spf = TINY_SNAC.samples_per_frame
    for emit in ((1, 2), (0, 1), (2, 4)):  # the kept frames alone, decoded on their spans
        kept = vocoder.decode_windows(ids, first, emit)
        assert kept.shape == (3, (emit[1] - emit[0]) * spf)
        torch.testing.assert_close(kept, got[:, emit[0] * spf: emit[1] * spf], **TOL)
        torch.testing.assert_close(kept, torch_form(vocoder.decode_windows, ids, first, emit), **TOL)


if __name__ == "__main__":
    if "--quick" in sys.argv:  # one representative kernel pair (the default test run)
        check_residual_unit()
        check_bias_residual_with_snake()
        print("snac kernels ok")
        sys.exit(0)
    check_residual_unit()
    check_depthwise_without_snakes()
    check_transposed_conv()
    check_table_noise()
    check_bias_residual_with_snake()
    check_conv_out()
    check_decoder_with_tensor_noise()
    check_quantizer()
    check_vocoder_windows()
    print("snac kernels ok")
