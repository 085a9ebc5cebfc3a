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
from mstar.layers import norm as norms
from mstar.layers.fused import FUSED, fused_kernels
from mstar.layers.norm import add_layer_norm
from mstar.models.vjepa2 import rope
from mstar.models.vjepa2.ac_predictor import ACPredictor
from mstar.models.vjepa2.encoder import VJEPA2Encoder
from mstar.models.vjepa2.planning import CEMSearch, CEMSettings
from mstar.models.vjepa2.rope import apply_rope, grid_positions, rope_tables
from mstar.models.vjepa2.tiny import tiny_ac_config, tiny_config


def torch_form(fn, *args, **kwargs):
    """fn(*args, **kwargs) with the kernels off: the PyTorch reference."""
    with fused_kernels(False):
        return fn(*args, **kwargs)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding, or within one step of a half-precision dtype's rounding."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    tol = {torch.float32: 1e-6, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.float().abs().max().item(), rtol=tol)


def qkv_views(batch: int, tokens: int, heads: int, head_dim: int, dtype: torch.dtype):
    """q, k, v [B, heads, N, head_dim] as the attention layer makes them: strided views of one qkv output."""
    qkv = torch.randn(batch, tokens, 3 * heads * head_dim).to(dtype)
    return qkv.view(batch, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)


def check_rope(dtype: torch.dtype, head_dim: int) -> None:
    """Patch and conditioning-token tables (axes left unrotated, a remainder of unrotated channels), shared
    [N, D] and per-batch-row [B, 1, N, D]; a new q laid out as the PyTorch result is, k written into its slot
    of a larger cache with v carried into its slot of the values, an odd token count (the last program's
    second token masked) and ViT-g's 22 heads (blocks of 8, the last part masked)."""
    batch, heads, rows, cols = 3, 5, 2, 3
    positions = grid_positions(2, rows, cols, col_scale=rows / cols)
    rotate = torch.ones_like(positions, dtype=torch.bool)
    rotate[::4, 1:] = False  # some tokens turn by frame only, as the AC predictor's action tokens do
    cos, sin = rope_tables(positions, head_dim, rotate)
    tokens = positions.shape[0]
    q, k, v = qkv_views(batch, tokens, heads, head_dim, dtype)
    got, want = apply_rope(q, cos, sin), torch_form(apply_rope, q, cos, sin)
    rope_equal(got, want)
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    keys, values, ref_keys, ref_values = (torch.zeros(batch, heads, tokens + 4, head_dim, dtype=dtype) for _ in range(4))
    slot = apply_rope(k, cos, sin, out=keys[:, :, 2:2 + tokens], carry=(v, values[:, :, 2:2 + tokens]))
    torch_form(apply_rope, k, cos, sin, out=ref_keys[:, :, 2:2 + tokens], carry=(v, ref_values[:, :, 2:2 + tokens]))
    assert slot.data_ptr() == keys[:, :, 2:].data_ptr()
    rope_equal(keys, ref_keys)
    assert torch.equal(values, ref_values) and torch.equal(values[:, :, 2:2 + tokens], v)  # copied as is
    for cache in (keys, values):
        assert not cache[:, :, :2].any() and not cache[:, :, 2 + tokens:].any(), "wrote outside the slot"
    per_row = [t.unsqueeze(0).expand(batch, -1, -1).clone() for t in (cos, sin)]
    per_row = [t.roll(1, 0).unsqueeze(1) for t in per_row]  # a different table for each row, [B, 1, N, D]
    rope_equal(apply_rope(q, *per_row), torch_form(apply_rope, q, *per_row))
    odd = (q[:, :, :tokens - 1], cos[:tokens - 1], sin[:tokens - 1])
    rope_equal(apply_rope(*odd), torch_form(apply_rope, *odd))
    wide, _, _ = qkv_views(1, tokens, 22, head_dim, dtype)
    rope_equal(apply_rope(wide, cos, sin), torch_form(apply_rope, wide, cos, sin))


def rope_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """The rotary kernel's result against the PyTorch form's: bitwise in float16, where the interpreter rounds as
    torch does (bf16 it does not; torch's float32 addcmul fuses its multiply-add), else within one rounding."""
    if got.dtype == torch.float16:
        assert torch.equal(got, want), "the rotary kernel does not round as the PyTorch form does"
    else:
        close(got, want)


def check_add_norm(dtype: torch.dtype) -> None:
    """The residual add and the LayerNorm after it (a width that is not a power of two, a weight and bias
    far from 1 and 0, rows whose mean is far from 0), and the first norm alone."""
    norm = torch.nn.LayerNorm(48, eps=1e-6).to(dtype)
    torch.nn.init.normal_(norm.weight, 1.0, 0.5)
    torch.nn.init.normal_(norm.bias, 0.0, 0.5)
    x, delta = (torch.randn(2, 7, 48) + 3.0).to(dtype), torch.randn(2, 7, 48).to(dtype)
    for d in (delta, None):
        (s, h), (want_s, want_h) = add_layer_norm(x, d, norm), torch_form(add_layer_norm, x, d, norm)
        if dtype == torch.bfloat16:  # the interpreter's bf16 rounding is not torch's
            close(s, want_s)
        else:  # the add rounds once, as torch's does
            torch.testing.assert_close(s, want_s, atol=0, rtol=0)
        close(h, want_h)


def counting(names):
    """(launch counts by name, undo): each named fused_ops function counts its calls until undo()."""
    launches = dict.fromkeys(names, 0)
    kernels = {name: getattr(fused_ops, name) for name in launches}

    def counted(name):
        def call(*args, **kwargs):
            launches[name] += 1
            return kernels[name](*args, **kwargs)
        return call

    for name in launches:
        setattr(fused_ops, name, counted(name))

    def undo():
        for name, kernel in kernels.items():
            setattr(fused_ops, name, kernel)
    return launches, undo


def check_encoder(dtype: torch.dtype) -> None:
    """The tiny encoder through the kernels: its patch tokens come out of the convolution transposed, and
    every residual add still fuses with the norm after it."""
    torch.manual_seed(0)
    model = VJEPA2Encoder(tiny_config().encoder).to(dtype)
    video = torch.randn(1, 4, 3, 32, 32).to(dtype)
    launches, undo = counting(["rotary_pairs", "layer_norm"])
    try:
        with torch.no_grad():
            got, want = model(video), torch_form(model, video)
    finally:
        undo()
    n = len(model.blocks)
    assert launches == {"rotary_pairs": 2 * n, "layer_norm": 2 * n}, launches
    # half precision: within two bf16 steps of the largest (LayerNorm-scaled) output
    tol = 1e-5 if dtype == torch.float32 else 2 * 2.0 ** -7 * want.float().abs().max().item()
    torch.testing.assert_close(got, want, atol=tol, rtol=0)


def check_predictor(dtype: torch.dtype) -> None:
    """The tiny AC predictor through the kernels (each launched where it should be): two frames at once,
    then one more onto the cache."""
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

    launches, undo = counting(["rotary_pairs", "layer_norm"])
    try:
        with torch.no_grad():
            got, want = run(), torch_form(run)
    finally:
        undo()
    n = len(model.blocks)
    # two forwards: q and k of each layer; the first norm, then each layer's two adds but the very last
    assert launches == {"rotary_pairs": 2 * 2 * n, "layer_norm": 2 * 2 * n}, launches
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 3e-2, rtol=0)


def check_search() -> None:
    """A seeded float32 search through the kernels plans the eager search's actions."""
    torch.manual_seed(0)
    model = ACPredictor(tiny_ac_config())
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    gen = torch.Generator().manual_seed(2)
    latents = torch.nn.functional.layer_norm(torch.randn(3, 16, 64, generator=gen), (64,))
    states, history = torch.rand(2, 7, generator=gen), 0.1 * torch.randn(1, 7, generator=gen)
    settings = CEMSettings(horizon=2, samples=12, topk=3, iterations=3, gripper_limit=0.75)

    def plan():
        search = CEMSearch(model, latents[:2], states, history, latents[2], settings, torch.Generator().manual_seed(11))
        for _ in range(settings.iterations):
            search.iterate()
        return search.actions()

    with torch.no_grad():
        got, want = plan(), torch_form(plan)
    assert want[:, :3].abs().max() > 1e-4, want  # the search moved
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


if __name__ == "__main__":
    assert FUSED.ops_for(torch.zeros(1)) is not None, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    # one part a run, so that each stays well inside the test's time limit on a loaded 2-core machine:
    # a dtype's checks (`--dtype NAME`; float32 is the default run's), or the seeded search (`--search`)
    if "--search" in sys.argv:
        check_search()
    else:
        name = sys.argv[sys.argv.index("--dtype") + 1] if "--dtype" in sys.argv else "float32"
        dt = getattr(torch, name)
        check_rope(dt, 16)  # three 4-channel axes and 4 left as they are (the tiny heads)
        check_rope(dt, 20)  # 10 pairs: not a power of two (ViT-H's heads are 80 wide)
        check_add_norm(dt)
        check_predictor(dt)
        check_encoder(dt)
    assert rope._ROTARY.usable, "the rotary kernel failed and its PyTorch form served"
    assert norms.ADD_LAYER_NORM.usable, "the add + layer norm kernel failed and its PyTorch form served"
    print("vjepa2 kernels ok")
