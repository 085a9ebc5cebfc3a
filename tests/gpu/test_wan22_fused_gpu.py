"""The Wan DiT's fused eager math on a GPU: one kernel per fused op, same values as the float32 formulas,
and cached cross-attention K/V equal to recomputed ones at full width.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_wan22_fused_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from mstar.models.common.loading import fill_dummy_weights
from mstar.models.wan22.config import WanTransformerConfig
from mstar.models.wan22.transformer import addcmul_as, apply_rope, build_transformer, rope_angles, rope_tables

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _kernels(fn) -> int:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def test_addcmul_as_is_one_kernel_with_float32_math() -> None:
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(2, 9, 390, 3072, device="cuda", generator=gen).bfloat16()
    out = torch.randn(2, 9, 390, 3072, device="cuda", generator=gen).bfloat16()
    gate = torch.randn(2, 9, 1, 3072, device="cuda", generator=gen)
    got = addcmul_as(torch.bfloat16, x, out, gate)
    expected = (x.float() + out.float() * gate).bfloat16()
    assert got.dtype == torch.bfloat16
    # float32 FMA vs separate multiply-add: at most one bf16 rounding step apart, almost always equal
    assert (got.float() - expected.float()).abs().max() <= 0.01 * expected.float().abs().max()
    assert (got != expected).float().mean() < 1e-2
    assert _kernels(lambda: addcmul_as(torch.bfloat16, x, out, gate)) == 1


def test_rope_matches_the_reference_formula_in_three_kernels() -> None:
    angles = rope_angles((9, 30, 52), 128, 10000.0, torch.device("cuda"))
    cos, sin = rope_tables(angles)
    x = torch.randn(2, 9 * 30 * 52, 24, 128, device="cuda").bfloat16()
    got = apply_rope(x, cos, sin)
    c, s = angles.cos().float()[:, None], angles.sin().float()[:, None]
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    expected = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).bfloat16()
    assert (got.float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()
    assert (got != expected).float().mean() < 1e-2
    assert _kernels(lambda: apply_rope(x, cos, sin)) <= 3


def test_cached_text_kv_equals_recomputed_at_full_width() -> None:
    config = WanTransformerConfig(num_layers=2)
    model = build_transformer(config, torch.bfloat16, "cuda")
    fill_dummy_weights(model)
    latents = torch.randn(2, 48, 3, 30, 52, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(2, 512, 4096, device="cuda", dtype=torch.bfloat16)
    ts = torch.tensor([[0.0, 999.0, 999.0], [0.0, 500.0, 500.0]], device="cuda")
    with torch.no_grad():
        kv = model.text_states(text)
        assert all(k.shape == v.shape == (2, 24, 512, 128) for k, v in kv)
        torch.testing.assert_close(model(latents, ts, None, text_kv=kv), model(latents, ts, text), atol=0, rtol=0)
