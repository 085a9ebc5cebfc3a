"""The Wan DiT's fused "float32 math, one rounding" helpers equal the reference formulas they replace,
and the whole tiny DiT in bfloat16 stays as close to a float32 forward as diffusers' own bf16 forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.models.wan22.transformer import (
    addcmul_as,
    apply_rope,
    build_transformer,
    layer_norm32,
    layer_norm_as_input,
    rope_angles,
    rope_tables,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """The textbook form (diffusers' apply_rotary_emb): pairs (x1, x2) -> (x1 c - x2 s, x1 s + x2 c)."""
    cos, sin = angles.cos().float()[:, None], angles.sin().float()[:, None]
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_rotate_like_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    angles = rope_angles((3, 2, 4), 12, 10000.0, torch.device("cpu"))  # [24, 6]
    x = (torch.randn(2, 24, 3, 12, generator=gen) * 3).to(dtype)
    got = apply_rope(x, *rope_tables(angles))
    expected = _reference_rope(x, angles)
    assert got.dtype == dtype and got.shape == x.shape
    # float32: equal up to float32 rounding; bf16: both round the same float32 value once
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5 if dtype == torch.float32 else 0.02,
                               rtol=1e-5 if dtype == torch.float32 else 0.008)
    assert not torch.equal(got, x)  # the rotation did something (angles are non-zero past token 0)


def test_addcmul_as_rounds_once_from_float32() -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 3, 5, 8, generator=gen).bfloat16()
    a = torch.randn(2, 3, 5, 8, generator=gen).bfloat16()
    gate = torch.randn(2, 3, 1, 8, generator=gen)  # float32, broadcast over tokens
    got = addcmul_as(torch.bfloat16, base, a, gate)
    expected = (base.float() + a.float() * gate).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == base.shape
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    # not the all-bf16 product (which rounds a * gate first): the float32 path is really taken
    assert (addcmul_as(torch.float32, base, a, gate) - (base.float() + a.float() * gate)).abs().max() < 1e-6


def test_layer_norm_as_input_equals_float32_norm_then_cast() -> None:
    gen = torch.Generator().manual_seed(2)
    norm = torch.nn.LayerNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(16, generator=gen))
        norm.bias.copy_(0.3 * torch.randn(16, generator=gen))
    x = (torch.randn(2, 7, 16, generator=gen) * 4 + 1).bfloat16()
    bf16_norm = torch.nn.LayerNorm(16, eps=1e-6).bfloat16()
    bf16_norm.load_state_dict(norm.state_dict())
    expected = F.layer_norm(x.float(), (16,), bf16_norm.weight.float(), bf16_norm.bias.float(), 1e-6).bfloat16()
    torch.testing.assert_close(layer_norm_as_input(x, bf16_norm), expected, atol=0.02, rtol=0.008)
    torch.testing.assert_close(layer_norm_as_input(x, norm), layer_norm32(x, norm).bfloat16(), atol=0, rtol=0)


def test_tiny_dit_in_bf16_is_as_accurate_as_diffusers_in_bf16() -> None:
    """Error of each bf16 forward against our float32 forward (itself within 1e-4 of diffusers'): ours
    must not be worse than the reference's bf16 by more than a little (rounding order differs)."""
    from diffusers import WanTransformer3DModel

    from mstar.models.common.loading import load_named_tensors
    from mstar.models.wan22.config import WanTransformerConfig
    from mstar.models.wan22.tiny import TINY_TEXT_LENGTH, TINY_TRANSFORMER
    from mstar.models.wan22.weights import transformer_mapper

    cfg = {k: v for k, v in TINY_TRANSFORMER.items() if not k.startswith("_")}
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**cfg).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name and param.ndim == 1
                        else 0.3 * torch.randn_like(param))
    config = WanTransformerConfig.from_hf(cfg)
    ours = {}
    for dtype in (torch.float32, torch.bfloat16):
        ours[dtype] = build_transformer(config, dtype)
        load_named_tensors(ours[dtype], reference.state_dict().items(), transformer_mapper(config))
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn(2, cfg["in_channels"], 3, 4, 6, generator=gen)
    text = torch.randn(2, TINY_TEXT_LENGTH, cfg["text_dim"], generator=gen)
    timestep = torch.tensor([999.0, 412.0])
    with torch.no_grad():
        truth = ours[torch.float32](latents, timestep, text)
        got = ours[torch.bfloat16](latents.bfloat16(), timestep, text.bfloat16()).float()
        ref_bf16 = reference.to(torch.bfloat16)(latents.bfloat16(), timestep, text.bfloat16(),
                                                 return_dict=False)[0].float()
    ours_err = (got - truth).abs().mean().item()
    ref_err = (ref_bf16 - truth).abs().mean().item()
    assert 0 < ours_err <= 1.25 * ref_err, (ours_err, ref_err)


@pytest.mark.parametrize("shape", [(2, 7, 24), (9, 24)])
def test_gemm_gelu_is_bias_add_and_gelu_of_the_projection(shape: tuple[int, ...]) -> None:
    from mstar.models.wan22.block_math import gemm_gelu

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=gen)
    weight, bias = torch.randn(40, 24, generator=gen) * 0.3, torch.randn(40, generator=gen)
    got = gemm_gelu(x, weight, bias)
    assert got.shape == (*shape[:-1], 40)
    # on CPU the op applies the exact (erf) GELU; on CUDA the tanh form (tests/gpu/test_wan22_kernels_gpu.py):
    # here the layout is checked (bias per output column, weight transposed, leading dims restored)
    torch.testing.assert_close(got, F.gelu(F.linear(x, weight, bias)), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(got, F.gelu(F.linear(x, weight, torch.zeros(40))), atol=1e-3)


def test_linear_gelu_keeps_the_tanh_reference_off_cuda() -> None:
    from mstar.models.wan22.block_math import linear_gelu

    gen = torch.Generator().manual_seed(6)
    linear = torch.nn.Linear(24, 40).bfloat16()
    x = torch.randn(2, 7, 24, generator=gen).bfloat16()
    with torch.no_grad():
        got = linear_gelu(x, linear)
        # CPU tensors never take the epilogue (its CPU form is the erf GELU): bit for bit the reference
        assert torch.equal(got, F.gelu(linear(x), approximate="tanh"))
