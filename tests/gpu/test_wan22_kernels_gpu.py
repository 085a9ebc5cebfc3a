"""The Wan DiT block kernels (mstar/models/wan22/wan_ops.py, the FFN's GELU epilogue, and the VAE's norm + SiLU
of wan_vae_ops.py) on a GPU at full width (B=2, 9 frames x 390 tokens, D=3072, 24 heads): one kernel
each, the float32 formulas rounded once to bf16 (round to nearest even, which the CPU interpreter does
not do), fewer kernels per block than the PyTorch form, and a 2-layer full-width DiT as close to its
float32 forward as the PyTorch form is.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_wan22_kernels_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.layers.fused import fused_kernels
from mstar.models.wan22 import block_math as bm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
B, T, N, D, H = 2, 9, 390, 3072, 24  # 832x480x33 -> 9 latent frames of 30x52 / (2x2) patches


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # the modules' parameters require grad; `out=` kernels refuse autograd
        yield


def _kernels(fn) -> int:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def _torch_form(fn, *args, **kwargs):
    with fused_kernels(False):
        return fn(*args, **kwargs)


def _rounded_once(got: torch.Tensor, want32: torch.Tensor) -> None:
    """got (bf16) is want32 (float32) rounded to nearest: at most half a bf16 step off, except rare
    ties flipped by float32 summation order (at most one step, under 1% of elements). Near zero, where
    float32 cancellation (FMA or not) decides, an absolute 1e-5 is allowed."""
    assert got.dtype == torch.bfloat16 and got.shape == want32.shape
    err = (got.float() - want32).abs()
    step = 2.0 ** -7 * want32.abs() + 1e-5
    assert (err <= step).all(), (err / step).max()
    assert (err > 0.5001 * step).float().mean() < 1e-2
    assert (got != want32.bfloat16()).float().mean() < 1e-2


def _mods(count: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator("cuda").manual_seed(7)
    return (0.5 * torch.randn(B, T, count, 1, D, device="cuda", generator=gen)).unbind(2)


def _x(seed: int) -> torch.Tensor:
    gen = torch.Generator("cuda").manual_seed(seed)
    return (2 * torch.randn(B, T * N, D, device="cuda", generator=gen) + 0.5).bfloat16()


def test_modulated_norm_full_width() -> None:
    x, res = _x(0), _x(1)
    shift, scale = _mods(2)
    for residual in (None, res):
        got, summed = bm.modulated_norm(x, shift, scale, 1e-6, residual=residual)
        s32 = x.float() if residual is None else (x.float() + res.float()).bfloat16().float()
        assert torch.equal(summed.float(), s32)
        normed = F.layer_norm(s32, (D,), eps=1e-6).view(B, T, N, D)
        _rounded_once(got, (normed * (1 + scale) + shift).view(B, T * N, D))
        assert _kernels(lambda r=residual: bm.modulated_norm(x, shift, scale, 1e-6, residual=r)) == 1


def test_gated_residual_full_width() -> None:
    x, y = _x(2), _x(3)
    (gate,) = _mods(1)
    norm = torch.nn.LayerNorm(D, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    norm.weight.normal_(1.0, 0.2)
    norm.bias.normal_(0.0, 0.3)
    got, h = bm.gated_residual(x, y, gate, norm)
    s32 = (x.float().view(B, T, N, D) + y.float().view(B, T, N, D) * gate).view(B, T * N, D)
    _rounded_once(got, s32)
    _rounded_once(h, F.layer_norm(got.float(), (D,), norm.weight.float(), norm.bias.float(), 1e-6))
    assert _kernels(lambda: bm.gated_residual(x, y, gate, norm)) == 1
    assert _kernels(lambda: bm.gated_residual(x, y, gate)) == 1


def test_norm_heads_rope_full_width() -> None:
    from mstar.models.wan22.transformer import rope_angles

    qkv = torch.cat([_x(4), _x(5), _x(6)], dim=-1)
    q = qkv.chunk(3, dim=-1)[0]
    norm = torch.nn.RMSNorm(D, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    norm.weight.normal_(1.0, 0.2)
    cos, sin = bm.rope_tables(rope_angles((T, 30, 13), D // H, 10000.0, torch.device("cuda")))
    got = bm.norm_heads(q, norm, H, (cos, sin))
    q32 = q.float()
    # The norm alone (same kernel, no rope) is its float32 formula rounded once. The rope is then checked
    # on the kernel's own normed values: two float32 forms of the norm (rsqrt or 1 / sqrt, another sum
    # order) round a few normed values in a million to neighbouring bf16 values, and where the rope's
    # two products cancel that one-step difference is many steps of the small result (17 seen on CPU).
    normed = bm.norm_heads(q, norm, H)
    _rounded_once(normed.flatten(-2), q32 * torch.rsqrt(q32.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float())
    heads = normed.float()
    swapped = heads.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    _rounded_once(got, heads * cos[:, None] + swapped * sin[:, None])
    # against the PyTorch form (torch's RMSNorm may round twice): within one bf16 step almost everywhere
    want = _torch_form(bm.norm_heads, q, norm, H, (cos, sin))
    assert (got.float() - want.float()).abs().max() <= 2.0 ** -6 * want.float().abs().max()
    assert (got != want).float().mean() < 0.05
    assert _kernels(lambda: bm.norm_heads(q, norm, H, (cos, sin))) == 1
    assert _kernels(lambda: bm.norm_heads(q, norm, H)) == 1


def test_ffn_up_projection_gelu_in_the_gemm_epilogue() -> None:
    """linear_gelu at full width (7020 x 3072 -> 14336): the GELU (tanh) rides the GEMM, and its result is
    the float32 truth rounded about once, no further from it than the reference's two roundings."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 truth must be a float32 GEMM
    try:
        h = _x(9)
        ffn_in = torch.nn.Linear(D, 14336, device="cuda", dtype=torch.bfloat16)
        ffn_in.weight.normal_(0.0, 0.02)
        ffn_in.bias.normal_(0.0, 0.5)
        got = bm.linear_gelu(h, ffn_in)
        plain = _torch_form(bm.linear_gelu, h, ffn_in)
        assert torch.equal(plain, F.gelu(ffn_in(h), approximate="tanh"))
        truth = F.gelu(F.linear(h.float(), ffn_in.weight.float(), ffn_in.bias.float()), approximate="tanh")
        err, plain_err = (got.float() - truth).abs(), (plain.float() - truth).abs()
        # one rounding: half a bf16 step, plus float32 summation order and the epilogue's tanh (~1e-3 abs)
        assert (err <= 2.0 ** -8 * truth.abs() + 2e-3).float().mean() > 0.999, err.max()
        assert err.mean() <= plain_err.mean(), (err.mean(), plain_err.mean())
        assert _kernels(lambda: bm.linear_gelu(h, ffn_in)) < _torch_form(_kernels, lambda: bm.linear_gelu(h, ffn_in))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_vae_channel_norm_silu_full_width() -> None:
    """The VAE's norm + SiLU at the decoder's widest map of an 832x480 chunk ([1, 256, 4, 240, 416]): one
    kernel, the float32 formula rounded once in bf16, equal to the PyTorch form to float32 precision."""
    from mstar.models.common.wan_vae.vae_layers import ChannelRMSNorm

    gen = torch.Generator("cuda").manual_seed(11)
    x32 = 2 * torch.randn(1, 256, 4, 240, 416, device="cuda", generator=gen) + 0.3
    norm = ChannelRMSNorm(256, spatial_dims=3).cuda()
    norm.gamma.normal_(1.0, 0.2, generator=gen)
    torch.testing.assert_close(norm(x32, silu=True), _torch_form(norm, x32, silu=True), atol=1e-6, rtol=1e-5)
    x = x32.bfloat16()
    norm16 = ChannelRMSNorm(256, spatial_dims=3).cuda().bfloat16()
    norm16.gamma.copy_(norm.gamma)
    got = norm16(x, silu=True)
    xf = x.float()
    truth = F.silu(xf / xf.norm(dim=1, keepdim=True) * norm16.scale * norm16.gamma.float())
    _rounded_once(got, truth)
    assert _kernels(lambda: norm16(x, silu=True)) == 1
    assert _torch_form(_kernels, lambda: norm16(x, silu=True)) > 3


def _model(layers: int, dtype: torch.dtype):
    from mstar.models.wan22.config import WanTransformerConfig
    from mstar.models.wan22.transformer import build_transformer

    model = build_transformer(WanTransformerConfig(num_layers=layers), dtype, "cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    for name, param in model.named_parameters():  # non-trivial vectors too (norm scales, biases, tables)
        base = 1.0 if param.ndim == 1 and "norm" in name else 0.0
        std = 0.02 if param.ndim >= 2 and "scale_shift" not in name else 0.1
        param.copy_(base + std * torch.randn(param.shape, device="cuda", generator=gen))
    return model


def test_block_uses_fewer_kernels() -> None:
    model = _model(1, torch.bfloat16)
    block, x = model.blocks[0], _x(8)
    t_mod = 0.1 * torch.randn(B, T, 6, D, device="cuda")
    text = torch.randn(B, 512, D, device="cuda", dtype=torch.bfloat16)
    rope = model._rope((T, 30, 13), torch.device("cuda"))
    kv = block.attn2.text_kv(text)
    fused = _kernels(lambda: block(x, kv, t_mod, rope))
    plain = _torch_form(_kernels, lambda: block(x, kv, t_mod, rope))
    torch.testing.assert_close(block(x, kv, t_mod, rope).float(), _torch_form(block, x, kv, t_mod, rope).float(),
                               atol=0.05, rtol=0.02)
    # 6 fused steps replace ~20 PyTorch kernels (float32 copies, norms, 1 + scale, addcmuls, rope passes)
    assert fused <= plain - 10, (fused, plain)


def test_two_layer_dit_bf16_error_like_the_torch_form() -> None:
    from mstar.models.wan22 import denoise

    model16 = _model(2, torch.bfloat16)
    model32 = _model(2, torch.float32)
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()})
    gen = torch.Generator("cuda").manual_seed(1)
    latents = torch.randn(B, 48, T, 30, 26, device="cuda", generator=gen)
    text = torch.randn(B, 512, 4096, device="cuda", generator=gen)
    ts = torch.stack([denoise.frame_timesteps(t, T, True, torch.device("cuda")) for t in (999.0, 500.0)])
    truth = _torch_form(model32, latents, ts, text)
    fused = model16(latents.bfloat16(), ts, text.bfloat16()).float()
    plain = _torch_form(model16, latents.bfloat16(), ts, text.bfloat16()).float()
    fused_err, plain_err = (fused - truth).abs().mean().item(), (plain - truth).abs().mean().item()
    assert 0 < fused_err <= 1.1 * plain_err, (fused_err, plain_err)
