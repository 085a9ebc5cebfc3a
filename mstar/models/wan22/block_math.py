"""The Wan DiT block's elementwise and norm math: float32 inside, one rounding to the model dtype.

Two forms of each step. The PyTorch form is the reference and serves CPU tensors and torch.compile
(inductor fuses it itself). On CUDA the Triton kernels of `mstar/models/wan22/wan_ops.py` replace it, one
kernel per step reading the activations once (`MSTAR_FUSED_KERNELS=0` or `FUSED.enabled = False`
keeps PyTorch; TRITON_INTERPRET=1 runs them on CPU for tests).

At full size (B=2, L=3510, D=3072) every float32 pass over the activations is a visible share of a
block's time. The PyTorch form already avoids float32 temporaries where one TensorIterator kernel can
(`addcmul_as`: mixed-dtype inputs read and computed in float32, the result written once in bf16);
the kernels also fuse the norms into the modulation, the residual sums and the rope. The FFN's
GELU runs in the up-projection's cuBLASLt epilogue (`linear_gelu`), so the [B, L, ffn] activation is
written once and never re-read by a separate GELU kernel.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from mstar import envs
from mstar.layers.fp8 import Fp8Linear
from mstar.layers.fused import FUSED
from mstar.layers.linear import gemm_gelu

# MSTAR_WAN_GEMM_GELU, read once per process (tests and benchmarks flip it): `linear_gelu` may put the
# GELU in the GEMM's epilogue.
GEMM_GELU = envs.wan_gemm_gelu()


def wan_kernels(x: torch.Tensor) -> ModuleType | None:
    """`mstar.models.wan22.wan_ops` when its kernels should serve x (CUDA, or CPU under TRITON_INTERPRET=1,
    fused kernels on, triton importable, not tracing under torch.compile), else None."""
    if torch.compiler.is_compiling() or FUSED.ops_for(x) is None:
        return None
    from mstar.models.wan22 import wan_ops

    return wan_ops


def rope_tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [L, d] float32 from angles [L, d/2], laid out for `apply_rope`: each pair's cos twice,
    and its sin as (-sin, +sin), so a rotation is one multiply and one multiply-add per channel."""
    cos, sin = angles.cos(), angles.sin()
    return (torch.stack((cos, cos), dim=-1).flatten(-2).float(),
            torch.stack((-sin, sin), dim=-1).flatten(-2).float())


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of x [B, L, H, d] by the tables of `rope_tables` ([L, d] float32).

    Computed in float32 and rounded once to x's dtype, like the reference's (x1 cos - x2 sin,
    x1 sin + x2 cos), in three kernels instead of ten: x * cos, the pair swap, and a fused multiply-add.
    """
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x2, x1) in each pair
    return addcmul_as(x.dtype, x * cos[:, None], swapped, sin[:, None])


def addcmul_as(dtype: torch.dtype, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """base + a * b (broadcast), computed in the inputs' promoted dtype and rounded once to `dtype`.

    Eager: one kernel that reads bf16 and float32 inputs as they are and writes `dtype` directly (no
    float32 copy of the inputs, no float32 result); under torch.compile the plain form, which inductor
    fuses itself.
    """
    if torch.compiler.is_compiling():
        return torch.addcmul(base, a, b).to(dtype)
    out = torch.empty(torch.broadcast_shapes(base.shape, a.shape, b.shape), dtype=dtype, device=base.device)
    return torch.addcmul(base, a, b, out=out)


def layer_norm32(x: torch.Tensor, norm: nn.LayerNorm | None = None, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm computed in float32 (weights too), returned in float32."""
    weight = bias = None
    if norm is not None:
        weight, bias, eps = norm.weight.float(), norm.bias.float(), norm.eps
    return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, eps)


def layer_norm_as_input(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """norm(x) with float32 statistics, in x's dtype: the reference's float32 norm then cast.

    When the weights are already in x's dtype the fused kernel does exactly that (float32 accumulation,
    weights read as they are, one rounding) without a float32 copy of x or of the result.
    """
    if norm.weight.dtype == x.dtype:
        return norm(x)
    return layer_norm32(x, norm).to(x.dtype)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [B, T, N, D] float32 normed * (1 + scale) + shift, with shift/scale [B, T, 1, D], as `dtype`."""
    return addcmul_as(dtype, shift, x, 1 + scale)


def grouped(h: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, L, D] -> [B, T, L/T, D], T = `groups` timestep groups (request, frame or token)."""
    batch, length, dim = h.shape
    return h.view(batch, groups, length // groups, dim)


def modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(s) * (1 + scale) + shift, s) in x's dtype, s = x or x + residual (rounded like a
    torch add); x, residual [B, L, D]; shift, scale [B, T, 1, D] float32, T dividing L."""
    ops = wan_kernels(x)
    if ops is not None:
        return ops.layer_norm_modulate(x, shift, scale, eps, residual)
    if residual is not None:
        x = x + residual
    h = modulate(grouped(layer_norm32(x, eps=eps), shift.shape[1]), shift, scale, x.dtype)
    return h.view_as(x), x


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor,
                   norm: nn.LayerNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(s, norm(s) in s's dtype or None), s = x + y * gate computed in float32 and rounded once to x's
    dtype; x, y [B, L, D]; gate [B, T, 1, D] float32, T dividing L."""
    ops = wan_kernels(x)
    if ops is not None:
        affine = (norm.weight, norm.bias, norm.eps) if norm is not None else None
        return ops.gated_residual(x, y, gate, affine)
    groups = gate.shape[1]
    summed = addcmul_as(x.dtype, grouped(x, groups), grouped(y, groups), gate).view_as(x)
    return summed, layer_norm_as_input(summed, norm) if norm is not None else None


def norm_heads(x: torch.Tensor, norm: nn.RMSNorm, heads: int,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """norm(x) [B, L, D] split into [B, L, heads, D / heads], then rotated by `rope` = (cos, sin) of
    `rope_tables` when given; each step rounds to x's dtype as the reference does."""
    ops = wan_kernels(x)
    if ops is not None:
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        return ops.rms_norm_rope(x, norm.weight, eps, heads, rope)
    h = norm(x).unflatten(-1, (heads, -1))
    return apply_rope(h, *rope) if rope is not None else h


def linear_gelu(x: torch.Tensor, linear: nn.Linear | Fp8Linear) -> torch.Tensor:
    """gelu_tanh(linear(x)) in x's dtype; x [..., in], `linear` with a bias (an `Fp8Linear` runs its own
    matmul, `fp8_linear`, then the GELU).

    On CUDA where the fused kernels serve x (and GEMM_GELU): `gemm_gelu`, one GEMM whose epilogue adds
    the bias and applies the GELU to the float32 accumulator, rounding once, where the reference rounds
    the projection to x's dtype first: within about one step of x's dtype of it. Else (CPU,
    torch.compile, kernels off) the reference form.
    """
    if GEMM_GELU and isinstance(linear, nn.Linear) and x.is_cuda and linear.bias is not None \
            and x.dtype == linear.weight.dtype and wan_kernels(x) is not None:
        return gemm_gelu(x, linear.weight, linear.bias)
    return F.gelu(linear(x), approximate="tanh")
