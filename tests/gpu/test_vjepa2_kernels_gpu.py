"""V-JEPA 2's fused kernels on a GPU in bf16 at the AC predictor's full width (16 heads of 64): the RoPE
kernel (with the values carried into their cache slot) and the residual add + LayerNorm against the eager
ops they replace, and the full-size predictor's plan forward through them against its eager forward. The
interpreter's checks (tests/models/vjepa2_kernels_check.py) cannot judge bf16 rounding; these do.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_vjepa2_kernels_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from mstar.layers.fused import fused_kernels
from mstar.layers.norm import add_layer_norm
from mstar.models.vjepa2 import rope as vjepa2_rope
from mstar.models.vjepa2.ac_predictor import ACPredictor
from mstar.models.vjepa2.config import AC_VITG
from mstar.models.vjepa2.rope import apply_rope
from mstar.models.vjepa2.weights import build

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")


def _eager(fn, *args, **kwargs):
    with fused_kernels(False):
        return fn(*args, **kwargs)


def _within_one_step(got: torch.Tensor, want: torch.Tensor, slack: float = 2.0 ** -133) -> None:
    """bf16 values at most one rounding step apart (a step is at most 2**-7 of the magnitude), give or take
    an absolute `slack`."""
    diff = (got.double() - want.double()).abs()
    step = torch.maximum(want.double().abs(), got.double().abs()) * 2.0 ** -7
    assert bool((diff <= step + slack).all()), f"max difference {diff.max().item()} (more than one bf16 step)"


@pytest.mark.parametrize("drop", [0, 1], ids=["two_frames", "odd_tokens"])
def test_rope_kernel_rounds_as_the_eager_addcmul(drop: int) -> None:
    """Two frames (conditioning and patch tokens), whole or less their last token (the kernel's programs take
    two tokens each: the last one's second masked)."""
    model = ACPredictor(AC_VITG)
    cos, sin = model.rope_tables(2, CUDA)
    cos, sin = (t[:t.shape[0] - drop].to(CUDA) for t in (cos, sin))
    batch, heads, tokens, head_dim = 8, 16, cos.shape[0], 64
    assert tokens % 2 == drop  # two whole frames hold an even count
    qkv = torch.randn(batch, tokens, 3 * heads * head_dim, device=CUDA).bfloat16()
    q, k, v = qkv.view(batch, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    got, want = apply_rope(q, cos, sin), _eager(apply_rope, q, cos, sin)
    assert got.stride() == want.stride()
    _within_one_step(got, want)
    assert (got != want).float().mean().item() < 1e-3  # the same roundings: at most a rare contraction differs
    keys, values, ref_keys, ref_values = (torch.zeros(batch, heads, tokens + 5, head_dim, device=CUDA,
                                                      dtype=torch.bfloat16) for _ in range(4))
    apply_rope(k, cos, sin, out=keys[:, :, 5:], carry=(v, values[:, :, 5:]))
    _eager(apply_rope, k, cos, sin, out=ref_keys[:, :, 5:], carry=(v, ref_values[:, :, 5:]))
    _within_one_step(keys, ref_keys)
    assert torch.equal(values, ref_values)
    assert vjepa2_rope._ROTARY.usable, "the rotary kernel failed and its PyTorch form served"


def test_add_norm_kernel_is_one_rounding_from_the_exact_norm() -> None:
    norm = torch.nn.LayerNorm(1024, eps=1e-6).to(CUDA, torch.bfloat16)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    torch.nn.init.normal_(norm.bias, 0.0, 0.3)
    x = (torch.randn(4, 258, 1024, device=CUDA) * 4 + 1).bfloat16()
    delta = torch.randn(4, 258, 1024, device=CUDA).bfloat16()
    (s, h), (want_s, _) = add_layer_norm(x, delta, norm), _eager(add_layer_norm, x, delta, norm)
    assert torch.equal(s, want_s)
    # against the exact LayerNorm of the same sum, not torch's bf16 one: those two can be two steps apart at a
    # few elements, which one rounding from float32 cannot do to both
    exact = torch.nn.functional.layer_norm(s.double(), (1024,), norm.weight.double(), norm.bias.double(), norm.eps)
    _within_one_step(h, exact, slack=1e-5)  # float32 sums of terms up to ~10 near a cancelled zero


def test_full_size_plan_forward_through_the_kernels() -> None:
    """One plan-shaped step (a cached context frame, then a frame of 4 candidates) of the 24-layer
    predictor with dummy weights: the kernels' output within bf16 noise of the eager forward's."""
    predictor = build(lambda: ACPredictor(AC_VITG), torch.bfloat16, CUDA, None, None, seed=3).eval()
    gen = torch.Generator(device=CUDA).manual_seed(0)
    hw, e = AC_VITG.tokens_per_frame, AC_VITG.embed_dim
    latents = torch.nn.functional.layer_norm(torch.randn(4, 2, hw, e, device=CUDA, generator=gen), (e,))
    actions, states = (0.1 * torch.randn(4, 2, 7, device=CUDA, generator=gen) for _ in range(2))

    def step() -> torch.Tensor:
        cache = predictor.new_cache(4, 2)
        predictor(latents[:, :1], actions[:, :1], states[:, :1], cache=cache)
        return predictor(latents[:, 1:], actions[:, 1:], states[:, 1:], cache=cache).float()

    with torch.no_grad():
        got, want = step(), _eager(step)
    scale = want.abs().mean().item()
    assert (got - want).abs().mean().item() < 0.02 * scale, ((got - want).abs().mean().item(), scale)
