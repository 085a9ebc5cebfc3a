"""The row-wise fused kernels on inputs whose row offsets pass 2**31 elements (a BAGEL understanding batch
packs 16 images of 4,900 tokens into one forward: 78,400 rows of an 18,944-wide MLP), against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_silu_and_mul_past_int32_offsets():
    from mstar.kernels import fused_ops

    rows, half = 60_000, 18_944  # rows * 2 * half > 2**31
    x = torch.randn(rows, 2 * half, device="cuda", dtype=torch.bfloat16)
    got = fused_ops.silu_and_mul(x)
    tail = slice(rows - 64, rows)  # the rows whose offsets overflowed int32
    want = F.silu(x[tail, :half]) * x[tail, half:]
    torch.testing.assert_close(got[tail], want, atol=2e-2, rtol=2e-2)


def test_rms_norm_past_int32_offsets():
    from mstar.kernels import fused_ops

    rows, width = 2**31 // 4096 + 64, 4096
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(width, device="cuda", dtype=torch.bfloat16) + 0.5
    got, _ = fused_ops.rms_norm(x, weight, 1e-6)
    tail = slice(rows - 64, rows)
    want = F.rms_norm(x[tail].float(), (width,), weight.float(), 1e-6).to(torch.bfloat16)
    torch.testing.assert_close(got[tail], want, atol=2e-2, rtol=2e-2)


def test_qk_norm_rotary_in_place_in_bagel_qkv_rows():
    """BAGEL's projection rows (28 q, 4 k and 4 v heads of 128) over a generation's 8,192 latent rows: q and k
    normed and rotated in place give the bits of the new-tensor form, and v stays as it was."""
    from mstar.kernels import fused_ops

    rows, heads, dim = 8192, 28 + 4 + 4, 128
    qkv = torch.randn(rows, heads * dim, device="cuda", dtype=torch.bfloat16)
    qk = qkv[:, : 32 * dim].view(rows, 32, dim)
    q_weight, k_weight = (torch.rand(dim, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    angles = torch.rand(rows, dim // 2, device="cuda") * 6.28
    cos, sin = (torch.cat([f(angles)] * 2, dim=1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    want, v = fused_ops.qk_norm_rotary(qk, q_weight, k_weight, 28, cos, sin, 1e-6), qkv[:, 32 * dim :].clone()
    fused_ops.qk_norm_rotary(qk, q_weight, k_weight, 28, cos, sin, 1e-6, out=qk)
    assert torch.equal(qk, want) and torch.equal(qkv[:, 32 * dim :], v)
