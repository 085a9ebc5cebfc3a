"""Checks of the Wan VAE's fused channel RMS norm (+ SiLU) (`mstar/models/common/wan_vae/wan_vae_ops.py`) against the
PyTorch form of `ChannelRMSNorm`; run with TRITON_INTERPRET=1 (by test_wan22_kernels.py, in a fresh process).

float32 checks the math to float32 precision (channel counts over and under one channel tile, position
counts not a multiple of the position tile, 2D and 3D maps); bfloat16 checks that the kernel rounds the
float32 formula once (the interpreter rounds float32 -> bf16 toward zero, which the check mirrors).
"""

from __future__ import annotations

import torch

from mstar.layers.fused import FUSED
from mstar.models.common.wan_vae import wan_vae_ops
from mstar.models.common.wan_vae.vae_layers import ChannelRMSNorm
from tests.models.wan22_kernels_check import torch_form


def _norm(channels: int, spatial_dims: int) -> ChannelRMSNorm:
    norm = ChannelRMSNorm(channels, spatial_dims)
    with torch.no_grad():
        norm.gamma.copy_(1 + 0.3 * torch.randn_like(norm.gamma))
    return norm


# channel counts over and under one channel tile, 3D and 2D maps
SHAPES = ((2, 24, 3, 4, 5), (1, 40, 2, 3, 7), (3, 64, 5, 6), (1, 7, 1, 1, 1))


def check_float32(shapes=SHAPES) -> None:
    for shape in shapes:
        x = torch.randn(*shape) * 3 + 0.5
        norm = _norm(shape[1], len(shape) - 2)
        for silu in (False, True):
            got = norm(x, silu=silu)
            want = torch_form(norm, x, silu=silu)
            assert got.shape == x.shape and got.dtype == x.dtype
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(norm(x, silu=True), norm(x))  # the SiLU is applied
    zeros = torch.zeros(1, 8, 2, 2, 2)  # eps keeps an all-zero column finite (zero out)
    assert torch.equal(_norm(8, 3)(zeros, silu=True), zeros)


def _toward_zero(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 rounded toward zero (the low 16 bits dropped), as the interpreter rounds."""
    return (x.view(torch.int32) & -65536).view(torch.float32).bfloat16()


def check_bfloat16() -> None:
    """The kernel's bf16 output is the float32 formula rounded once (toward zero here; to nearest on a GPU,
    tests/gpu/test_wan22_kernels_gpu.py), not the PyTorch form's chain of roundings."""
    x = (torch.randn(2, 40, 3, 4, 5) * 3 + 0.5).bfloat16()
    norm = _norm(40, 3).bfloat16()
    for silu in (False, True):
        got = norm(x, silu=silu)
        xf, gamma = x.float(), norm.gamma.float()
        truth = xf / xf.norm(dim=1, keepdim=True) * norm.scale * gamma
        truth = torch.nn.functional.silu(truth) if silu else truth
        once = _toward_zero(truth)
        step = 2.0 ** -7 * truth.abs() + 1e-6
        assert ((got.float() - once.float()).abs() <= step).all()  # float32 order may cross one boundary
        assert (got != once).float().mean() < 0.02, (got != once).float().mean()
        assert (torch_form(norm, x, silu=silu) != once).float().mean() > 0.1  # the chain rounds elsewhere


def check_fallbacks_and_errors() -> None:
    norm = _norm(6, 3)
    x = torch.randn(2, 4, 6, 3, 5).transpose(1, 2)  # channels not outermost: the PyTorch form serves
    assert torch.equal(norm(x, silu=True), torch_form(norm, x, silu=True))
    try:
        wan_vae_ops.channel_rms_norm(torch.randn(2, 6, 3), torch.ones(5), 1.0)
    except ValueError as err:
        assert "C gains" in str(err)
    else:
        raise AssertionError("5 gains for 6 channels accepted")


def check_tiny_decode() -> None:
    """A tiny VAE decodes the same with the kernel as with the PyTorch form (float32), through it."""
    from mstar.models.common.wan_vae.vae import WanVAE
    from mstar.models.common.wan_vae.vae_config import tiny_vae_config

    config = tiny_vae_config()
    vae = WanVAE(config).eval()
    calls = []
    original = wan_vae_ops.channel_rms_norm
    wan_vae_ops.channel_rms_norm = lambda *a, **k: calls.append(a[0].shape) or original(*a, **k)
    try:
        latents = torch.randn(1, config.z_dim, 2, 2, 3)
        got = vae.decode(latents)
    finally:
        wan_vae_ops.channel_rms_norm = original
    assert calls, "the decoder never used the kernel"
    torch.testing.assert_close(got, torch_form(vae.decode, latents), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def quick() -> None:
    """One float32 shape (the default test run, through wan22_quick_check.py)."""
    check_float32(SHAPES[1:2])


@torch.no_grad()
def main() -> None:
    assert FUSED.ops_for(torch.zeros(1)) is not None, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    check_float32()
    check_bfloat16()
    check_fallbacks_and_errors()
    check_tiny_decode()
    print("wan vae ops ok")


if __name__ == "__main__":
    main()
