"""One decode step of attention over a small dense per-sequence cache, with Qwen3's qk-norm, RoPE and the
cache write in the same launch.

The Qwen3-Omni code predictor runs 15 such steps a frame, each layer attending over at most 16 cached
positions of each sequence. Unfused, a layer's step is four small kernels (qk-norm with RoPE, two cache
copies, SDPA) that cost more in launch latency than in work; here it is one.

One program per (sequence, kv head): it loads the kv head's GROUP query heads, its new key and value
from the qkv projection's rows, norms and rotates q and k (rounded as `fused_ops.qk_norm_rotary`
rounds, so as the layers round), writes k and v at position `start` of the cache, and attends over
positions 0..start: the earlier keys and values from the cache, the new ones from registers. Scores,
softmax and the weighted sum are float32; the output is rounded once to the input dtype (SDPA's
kernels round differently inside: results agree within bf16 rounding, not bit for bit).

PDL (sm_90+, `mstar.kernels.pdl`): lets the next kernel launch at its start and waits for the previous
one before its first load or store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar.kernels.fused_ops import head_norm, rotated
from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait


@triton.jit
def _halves(base, d, HALF: tl.constexpr):
    return tl.load(base + d), tl.load(base + HALF + d)


@triton.jit
def _step_attention_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, k_cache, v_cache, out_ptr, start, num_q, num_kv,
                           x_stride_b, x_stride_h, c_stride_b, c_stride_h, c_stride_s, out_stride_b, out_stride_h,
                           eps, scale, GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr,
                           PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)[None, :]
    g = tl.arange(0, GROUP)[:, None]
    row = x_ptr + b * x_stride_b
    q1, q2 = _halves(row + (h * GROUP + g) * x_stride_h, d, HALF)  # [GROUP, HALF]
    k1, k2 = _halves(row + (num_q + h) * x_stride_h, d, HALF)  # [1, HALF]
    v1, v2 = _halves(row + (num_q + num_kv + h) * x_stride_h, d, HALF)
    dtype = q1.dtype
    qw1, qw2 = _halves(qw_ptr, d, HALF)
    kw1, kw2 = _halves(kw_ptr, d, HALF)
    qn1, qn2 = head_norm(q1.to(tl.float32), q2.to(tl.float32), qw1.to(tl.float32), qw2.to(tl.float32), eps, dtype,
                         HALF)
    kn1, kn2 = head_norm(k1.to(tl.float32), k2.to(tl.float32), kw1.to(tl.float32), kw2.to(tl.float32), eps, dtype,
                         HALF)
    qr1, qr2 = rotated(qn1, qn2, dtype, cos_ptr, sin_ptr, d)
    kr1, kr2 = rotated(kn1, kn2, dtype, cos_ptr, sin_ptr, d)
    # the new key and value go to position `start` of this sequence's cache
    kc = k_cache + b * c_stride_b + h * c_stride_h
    vc = v_cache + b * c_stride_b + h * c_stride_h
    tl.store(kc + start * c_stride_s + d, kr1)
    tl.store(kc + start * c_stride_s + HALF + d, kr2)
    tl.store(vc + start * c_stride_s + d, v1)
    tl.store(vc + start * c_stride_s + HALF + d, v2)
    # positions 0..start: the earlier ones from the cache, this one from registers
    s = tl.arange(0, BLOCK_S)[:, None]
    earlier = s < start
    keys1 = tl.where(s == start, kr1, tl.load(kc + s * c_stride_s + d, mask=earlier, other=0.0)).to(tl.float32)
    keys2 = tl.where(s == start, kr2, tl.load(kc + s * c_stride_s + HALF + d, mask=earlier, other=0.0)).to(tl.float32)
    vals1 = tl.where(s == start, v1, tl.load(vc + s * c_stride_s + d, mask=earlier, other=0.0)).to(tl.float32)
    vals2 = tl.where(s == start, v2, tl.load(vc + s * c_stride_s + HALF + d, mask=earlier, other=0.0)).to(tl.float32)
    qf1, qf2 = qr1.to(tl.float32), qr2.to(tl.float32)
    scores = (tl.sum(qf1[:, None, :] * keys1[None, :, :], axis=2)
              + tl.sum(qf2[:, None, :] * keys2[None, :, :], axis=2)) * scale  # [GROUP, BLOCK_S]
    scores = tl.where(tl.arange(0, BLOCK_S)[None, :] <= start, scores, float("-inf"))
    p = tl.exp(scores - tl.max(scores, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    o1 = tl.sum(p[:, :, None] * vals1[None, :, :], axis=1)  # [GROUP, HALF]
    o2 = tl.sum(p[:, :, None] * vals2[None, :, :], axis=1)
    out = out_ptr + b * out_stride_b + (h * GROUP + g) * out_stride_h
    tl.store(out + d, o1.to(dtype))
    tl.store(out + HALF + d, o2.to(dtype))


def supports(num_q: int, num_kv: int, head_dim: int, cache_len: int) -> bool:
    """Whether `step_attention` takes these shapes (power-of-two query groups and half head dims)."""
    group = num_q // num_kv
    half = head_dim // 2
    return (num_q % num_kv == 0 and group & (group - 1) == 0 and head_dim % 2 == 0 and half & (half - 1) == 0
            and half >= 1 and cache_len <= 256)


def step_attention(heads: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, num_q: int,
                   eps: float) -> torch.Tensor:
    """One query token per sequence: heads [B, Hq + 2 Hkv, D] (each row's q heads, k heads, v heads; any
    strides with a unit last stride, e.g. a view of the qkv projection), qk-norm weights [D], the
    token's cos/sin [D] (one position for every sequence), caches [B, Hkv, S, D] (unit last stride).
    Writes the normed, rotated k and the v at position `start` < S of each cache and returns the
    attention output over positions 0..start, [B, Hq, D] contiguous (SDPA's default 1/sqrt(D) scale)."""
    b, heads_total, dim = heads.shape
    num_kv = (heads_total - num_q) // 2
    cache_len = keys.shape[2]
    assert num_q + 2 * num_kv == heads_total and supports(num_q, num_kv, dim, cache_len), "step_attention shapes"
    assert heads.stride(2) == 1 and keys.stride() == values.stride() and keys.stride(3) == 1
    assert cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() == dim
    assert q_weight.is_contiguous() and k_weight.is_contiguous() and 0 <= start < cache_len
    out = torch.empty((b, num_q, dim), dtype=heads.dtype, device=heads.device)
    _step_attention_kernel[(b, num_kv)](
        heads, q_weight, k_weight, cos, sin, keys, values, out, start, num_q, num_kv, heads.stride(0),
        heads.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), out.stride(0), out.stride(1), eps,
        dim**-0.5, GROUP=num_q // num_kv, HALF=dim // 2, BLOCK_S=max(triton.next_power_of_2(cache_len), 2),
        num_warps=4, **pdl_args(heads.device),
    )
    return out
