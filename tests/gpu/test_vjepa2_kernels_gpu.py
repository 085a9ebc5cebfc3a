"""V-JEPA 2's fused kernels on a GPU in bf16 at the AC predictor's full width (16 heads of 64): the RoPE
kernel (with the values carried into their cache slot) and the residual add + LayerNorm against the eager
ops they replace, and the full-size predictor's plan forward through them against its eager forward. The
RoPE test also runs the candidate kernel `fused_ops.rotary_pairs_rows`. The interpreter's checks
(tests/models/vjepa2_kernels_check.py) cannot judge bf16 rounding; these do.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_vjepa2_kernels_gpu.py`.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from mstar.kernels import fused_ops
from mstar.layers.fused import fused_kernels
from mstar.layers.norm import add_layer_norm
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


# the kernel serving apply_rope, and the candidate (fused_ops.rotary_pairs_rows) at the token counts a program
# that benchmarks/vjepa2_bench.py --rotary times
ROPE_FORMS = {"apply_rope": apply_rope,
              **{f"rows_t{n}": partial(fused_ops.rotary_pairs_rows, tokens_per_program=n) for n in (1, 2, 4)}}


@pytest.mark.parametrize("form", list(ROPE_FORMS))
def test_rope_kernel_rounds_as_the_eager_addcmul(form: str) -> None:
    rope = ROPE_FORMS[form]
    model = ACPredictor(AC_VITG)
    cos, sin = (t.to(CUDA) for t in model.rope_tables(2, CUDA))  # two frames: conditioning and patch tokens
    batch, heads, tokens, head_dim = 8, 16, cos.shape[0], 64
    qkv = torch.randn(batch, tokens, 3 * heads * head_dim, device=CUDA).bfloat16()
    q, k, v = qkv.view(batch, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    got, want = rope(q, cos, sin), _eager(apply_rope, q, cos, sin)
    assert got.stride() == want.stride()
    _within_one_step(got, want)
    assert (got != want).float().mean().item() < 1e-3  # the same roundings: at most a rare contraction differs
    keys, values, ref_keys, ref_values = (torch.zeros(batch, heads, tokens + 5, head_dim, device=CUDA,
                                                      dtype=torch.bfloat16) for _ in range(4))
    rope(k, cos, sin, out=keys[:, :, 5:], carry=(v, values[:, :, 5:]))
    _eager(apply_rope, k, cos, sin, out=ref_keys[:, :, 5:], carry=(v, ref_values[:, :, 5:]))
    _within_one_step(keys, ref_keys)
    assert torch.equal(values, ref_values)


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
