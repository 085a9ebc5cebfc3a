"""Checks of V-JEPA 2's fused kernels against their PyTorch forms; run with TRITON_INTERPRET=1 (by
test_vjepa2_kernels.py, in a fresh process so the interpreter setting holds for every kernel).

float32 checks the math to float32 rounding; float16 and bfloat16 check indexing and strides within one
step of their rounding (the interpreter rounds float32 -> bf16 toward zero where the GPU rounds to
nearest even).
"""

from __future__ import annotations

import sys

import torch

from mstar.kernels import fused_ops
from mstar.layers.fused import FUSED, fused_kernels
from mstar.models.vjepa2 import rope
from mstar.models.vjepa2.ac_predictor import ACPredictor
from mstar.models.vjepa2.rope import apply_rope, grid_positions, rope_tables
from mstar.models.vjepa2.tiny import tiny_ac_config


def torch_form(fn, *args, **kwargs):
    """fn(*args, **kwargs) with the kernels off: the PyTorch reference."""
    with fused_kernels(False):
        return fn(*args, **kwargs)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding, or within one step of a half-precision dtype's rounding."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    tol = {torch.float32: 1e-6, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.float().abs().max().item(), rtol=tol)


def qk_views(batch: int, tokens: int, heads: int, head_dim: int, dtype: torch.dtype):
    """q and k [B, heads, N, head_dim] as the attention layer makes them: strided views of one qkv output."""
    qkv = torch.randn(batch, tokens, 3 * heads * head_dim).to(dtype)
    q, k, _ = qkv.view(batch, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    return q, k


def check_rope(dtype: torch.dtype, head_dim: int) -> None:
    """Patch and conditioning-token tables (axes left unrotated, a remainder of unrotated channels), shared
    [N, D] and per-batch-row [B, 1, N, D]; a new q laid out as the PyTorch result is, and k written into
    its slot of a larger cache."""
    batch, heads, rows, cols = 3, 5, 2, 3
    positions = grid_positions(2, rows, cols, col_scale=rows / cols)
    rotate = torch.ones_like(positions, dtype=torch.bool)
    rotate[::4, 1:] = False  # some tokens turn by frame only, as the AC predictor's action tokens do
    cos, sin = rope_tables(positions, head_dim, rotate)
    tokens = positions.shape[0]
    q, k = qk_views(batch, tokens, heads, head_dim, dtype)
    got, want = apply_rope(q, cos, sin), torch_form(apply_rope, q, cos, sin)
    close(got, want)
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    cache, ref_cache = (torch.zeros(batch, heads, tokens + 4, head_dim, dtype=dtype) for _ in range(2))
    slot = apply_rope(k, cos, sin, out=cache[:, :, 2:2 + tokens])
    torch_form(apply_rope, k, cos, sin, out=ref_cache[:, :, 2:2 + tokens])
    assert slot.data_ptr() == cache[:, :, 2:].data_ptr()
    close(cache, ref_cache)
    assert not cache[:, :, :2].any() and not cache[:, :, 2 + tokens:].any(), "wrote outside the slot"
    per_row = [t.unsqueeze(0).expand(batch, -1, -1).clone() for t in (cos, sin)]
    per_row = [t.roll(1, 0).unsqueeze(1) for t in per_row]  # a different table for each row, [B, 1, N, D]
    close(apply_rope(q, *per_row), torch_form(apply_rope, q, *per_row))


def check_predictor(dtype: torch.dtype) -> None:
    """The tiny AC predictor through the kernels: two frames at once, then one more onto the cache."""
    torch.manual_seed(0)
    model = ACPredictor(tiny_ac_config()).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    gen = torch.Generator().manual_seed(1)
    latents = torch.nn.functional.layer_norm(torch.randn(2, 3, 16, 64, generator=gen), (64,))
    actions, states = 0.1 * torch.randn(2, 3, 7, generator=gen), torch.rand(2, 3, 7, generator=gen)

    def run():
        cache = model.new_cache(2, 3)
        first = model(latents[:, :2], actions[:, :2], states[:, :2], cache=cache)
        return torch.cat([first, model(latents[:, 2:], actions[:, 2:], states[:, 2:], cache=cache)], dim=1)

    launches = []

    def counted(*args, **kwargs):
        launches.append(args[0].shape)
        return rotary_pairs(*args, **kwargs)

    rotary_pairs, fused_ops.rotary_pairs = fused_ops.rotary_pairs, counted
    try:
        with torch.no_grad():
            got, want = run(), torch_form(run)
    finally:
        fused_ops.rotary_pairs = rotary_pairs
    assert len(launches) == 2 * 2 * len(model.blocks), launches  # q and k of each layer, two forwards
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 3e-2, rtol=0)


if __name__ == "__main__":
    assert FUSED.ops_for(torch.zeros(1)) is not None, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    quick = "--quick" in sys.argv  # float32 alone (the default test run)
    for dt in (torch.float32,) if quick else (torch.float32, torch.float16, torch.bfloat16):
        check_rope(dt, 16)  # three 4-channel axes and 4 left as they are (the tiny heads)
        check_rope(dt, 20)  # 10 pairs: not a power of two (ViT-H's heads are 80 wide)
        check_predictor(dt)
    assert rope._ROTARY.usable, "the rotary kernel failed and its PyTorch form served"
    print("vjepa2 kernels ok")
