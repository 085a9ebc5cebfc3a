"""Checks of the channels-last VAE kernels (`mstar/models/common/wan_vae/wan_vae_cl_ops.py`) against their PyTorch forms in
`models/common/wan_vae/vae_channels_last.py`; run with TRITON_INTERPRET=1 (by test_wan22_kernels.py, in a fresh process).

float32 checks the math to float32 precision; float16 (which the interpreter rounds to nearest, unlike
bf16) checks indexing and one rounding within a half step. Covered: channel counts that are and are not
powers of two, batch rows with a free batch stride (the norm writing into a causal buffer), every bias
combination, the space-time shortcut's channel repeats (below, at and above its cell count) with and
without dropped leading frames; then a tiny channels-last decode through the kernels equals the NCDHW
decode with the kernels off.
"""

from __future__ import annotations

import torch

from mstar.layers.fused import FUSED
from mstar.models.common.wan_vae import vae_channels_last as vcl
from mstar.models.common.wan_vae import wan_vae_cl_ops
from mstar.models.common.wan_vae.vae_layers import ChannelRMSNorm
from tests.models.wan22_kernels_check import torch_form

CL3D = torch.channels_last_3d


def _cl(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape) * 2 + 0.3).to(dtype).contiguous(memory_format=CL3D)


def _reference(fn, *args, out: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """fn's PyTorch form on float32 copies of the arguments, rounded once to the arguments' dtype: the
    kernels compute in float32 and round once, where the PyTorch form on half inputs rounds at every step."""
    out32 = None if out is None else out.float()
    result = torch_form(fn, *[_to32(a) for a in args], out=out32, **kwargs)
    return result.to(args[1].dtype if isinstance(args[0], ChannelRMSNorm) else args[0].dtype)


def _to32(value):
    if isinstance(value, ChannelRMSNorm):
        norm = ChannelRMSNorm(value.gamma.numel(), spatial_dims=3)
        norm.gamma.copy_(value.gamma.float())
        return norm
    return value.float() if isinstance(value, torch.Tensor) else value


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: to float32 rounding; float16: within one half step (float32 sums may cross a boundary)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    tol = 1e-5 if got.dtype == torch.float32 else 2.0 ** -10
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.float().abs().mean().item(), rtol=tol)


DTYPES = (torch.float32, torch.float16)
NORM_SHAPES = ((1, 24, 3, 4, 5), (2, 40, 2, 3, 7), (1, 7, 1, 1, 1), (2, 64, 1, 5, 3), (1, 200, 2, 2, 3))
ADD_SHAPES = ((1, 24, 3, 4, 5), (2, 7, 2, 3, 3), (1, 200, 2, 3, 3))
# (C_in, C_out, factor_t): repeats 8 = cells, 4 and 2 < cells (the Wan levels), 16 > cells; 200: two tiles
SPACE_TIME = ((16, 16, 2), (16, 8, 2), (16, 8, 1), (8, 16, 2), (6, 6, 1), (200, 200, 2))


def check_norm(dtypes=DTYPES, shapes=NORM_SHAPES) -> None:
    for dtype in dtypes:
        for shape in shapes:
            x = _cl(*shape, dtype=dtype)
            norm = ChannelRMSNorm(shape[1], spatial_dims=3)
            norm.gamma.copy_(1 + 0.3 * torch.randn_like(norm.gamma))
            norm = norm.to(dtype)
            bias = (0.5 * torch.randn(shape[1])).to(dtype)
            for b, silu in ((None, False), (bias, True), (bias, False)):
                got = vcl.norm_ndhwc(norm, x, b, silu)
                assert got.is_contiguous(memory_format=CL3D)
                _close(got, _reference(vcl.norm_ndhwc, norm, x, b, silu))
            # into a causal buffer: two past frames first, rows dense, batch stride larger than x's
            n, c, t, h, w = shape
            buf = torch.full((n, t + 2, h, w, c), 7.0, dtype=dtype).permute(0, 4, 1, 2, 3)
            vcl.norm_ndhwc(norm, x, bias, True, out=buf[:, :, 2:])
            assert (buf[:, :, :2] == 7).all()
            _close(buf[:, :, 2:], _reference(vcl.norm_ndhwc, norm, x, bias, True))
    zeros = torch.zeros(1, 8, 2, 2, 2).contiguous(memory_format=CL3D)  # eps: an all-zero pixel gives zeros
    assert torch.equal(vcl.norm_ndhwc(ChannelRMSNorm(8, 3), zeros, silu=True), zeros)


def check_add_biased(dtypes=DTYPES, shapes=ADD_SHAPES) -> None:
    for dtype in dtypes:
        for shape in shapes:
            a, b = _cl(*shape, dtype=dtype), _cl(*shape, dtype=dtype)
            a_bias, b_bias = torch.randn(shape[1]).to(dtype), torch.randn(shape[1]).to(dtype)
            for biases in ((a_bias, b_bias), (a_bias, None), (None, b_bias), (None, None)):
                want = _reference(vcl.add_biased, a, biases[0], b, biases[1], out=torch.empty_like(a))
                _close(vcl.add_biased(a, biases[0], b, biases[1], out=torch.empty_like(a)), want)
            got = a.clone()
            vcl.add_biased(got, a_bias, b, None, out=got)  # in place, as the residual blocks use it
            _close(got, (a.float() + a_bias.float().view(1, -1, 1, 1, 1) + b.float()).to(dtype))


def check_add_space_time(dtypes=DTYPES, cases=SPACE_TIME) -> None:
    for c_in, c_out, factor_t in cases:
        for dtype in dtypes:
            x = _cl(2, c_in, 3, 2, 3, dtype=dtype)
            bias = torch.randn(c_out).to(dtype)
            for drop in sorted({0, factor_t - 1}):
                y = _cl(2, c_out, 3 * factor_t - drop, 4, 6, dtype=dtype)
                want = _reference(vcl.add_space_time, y, bias, x, factor_t, drop, out=torch.empty_like(y))
                got = vcl.add_space_time(y, bias, x, factor_t, drop, out=y.clone())
                _close(got, want)
    try:
        vcl.add_space_time(_cl(1, 8, 5, 4, 6), torch.zeros(8), _cl(1, 8, 3, 2, 3), 2, 0, out=_cl(1, 8, 5, 4, 6))
    except ValueError as err:
        assert "unfolded" in str(err)
    else:
        raise AssertionError("5 frames from 3 accepted with factor 2 and nothing dropped")


def check_tiny_decode() -> None:
    """A tiny VAE (non-zero biases) decodes channels-last through all three kernels as the NCDHW decoder does
    with the kernels off, streaming one latent frame at a time and (batch 2) all at once; with float16
    convolutions, as its channels-last PyTorch form does."""
    from mstar.models.common.wan_vae.vae_config import tiny_vae_config
    from mstar.models.common.wan_vae.vae_weights import load_vae

    config = tiny_vae_config()
    vae = load_vae(load_format="dummy", config=config, seed=5)
    for name, param in vae.named_parameters():
        if name.endswith(".bias"):
            param.normal_(0.0, 0.3)
    calls: dict[str, int] = {}
    names = ("channel_rms_norm_ndhwc", "add_biased", "add_space_time")
    originals = {name: getattr(wan_vae_cl_ops, name) for name in names}

    def counted(name):
        return lambda *a, **k: calls.__setitem__(name, calls.get(name, 0) + 1) or originals[name](*a, **k)

    for name in names:
        setattr(wan_vae_cl_ops, name, counted(name))
    try:
        for batch, chunk in ((1, 1), (2, None)):
            latents = torch.randn(batch, config.z_dim, 2, 2, 3)
            want = torch_form(vae.decode, latents, chunk, channels_last=False)
            _close(vae.decode(latents, chunk, channels_last=True), want)
        # convolutions alone in float16 (`WanVAE.conv_dtype`): the kernels read half conv outputs beside
        # float32 sums and write half conv inputs; their float32 math rounds where the PyTorch forms do
        vae.conv_dtype = torch.float16
        latents = torch.randn(1, config.z_dim, 2, 2, 3)
        want = torch_form(vae.decode, latents, 1, channels_last=True)
        got = vae.decode(latents, 1, channels_last=True)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    finally:
        vae.conv_dtype = None
        for name in names:
            setattr(wan_vae_cl_ops, name, originals[name])
    assert set(calls) == set(names), calls


@torch.no_grad()
def quick() -> None:
    """One float32 shape of each kernel (the default test run, through wan22_quick_check.py)."""
    one = (torch.float32,)
    check_norm(one, NORM_SHAPES[1:2])
    check_add_biased(one, ADD_SHAPES[:1])
    check_add_space_time(one, SPACE_TIME[1:2])


@torch.no_grad()
def main() -> None:
    assert FUSED.ops_for(torch.zeros(1)) is not None, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    check_norm()
    check_add_biased()
    check_add_space_time()
    check_tiny_decode()
    print("wan vae channels-last ops ok")


if __name__ == "__main__":
    main()
