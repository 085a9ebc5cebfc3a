"""Fused elementwise Triton kernels for the decoder layers: (residual add +) RMSNorm or LayerNorm, rotary
(rotate-half, or V-JEPA 2's adjacent pairs) and its cos/sin, Qwen3's qk-norm with rotary, SiLU- and
GELU(tanh)-and-mul, and a MoE block's sigmoid-gated shared-expert add.

Each replaces a handful of small PyTorch kernels with one, which is what decides decode speed once
the weights are read at full bandwidth. They round intermediate values to the input dtype at the
same points as the PyTorch code in `mstar/layers/` does, so results match it to the last bit or
within one rounding step (reduction order in the norm may differ).

Use through `mstar/layers` and `mstar/models/vjepa2` (which fall back to PyTorch on CPU or when
`fused_enabled` is False); tests run these kernels on CPU with TRITON_INTERPRET=1.

PDL (sm_90+, `mstar.kernels.pdl`): each kernel lets the next one launch at its start and waits for
the previous one before its first load or store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mstar.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, n_cols, x_stride, res_stride, out_stride,
                     eps, HAS_RESIDUAL: tl.constexpr, LAYER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in a large packed prefill
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum is rounded like `x + r` in torch
        tl.store(res_out_ptr + row * out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    if LAYER:  # centred first: LayerNorm's variance
        xf = tl.where(mask, xf - tl.sum(xf, axis=0) / n_cols, 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if LAYER:  # torch's LayerNorm rounds once, after the affine
        out = xf * inv * w + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:  # HF's RMSNorm rounds the normed value, then the product with the weight
        out = (xf * inv).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of the rows of 2-D `x` (or of `x + residual`): returns (normed, x + residual or None)."""
    return _norm_rows(x, weight, None, eps, residual)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Affine LayerNorm of the rows of 2-D `x` (or of `x + residual`, rounded to x's dtype as torch's add
    rounds), rounded once as torch's LayerNorm rounds: returns (normed, x + residual or None)."""
    return _norm_rows(x, weight, bias, eps, residual)


def _norm_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm (`bias` None) or LayerNorm of 2-D rows, one program a row."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, bias if bias is not None else weight, out,
        res_out if res_out is not None else out, cols, x.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), eps, HAS_RESIDUAL=residual is not None, LAYER=bias is not None, BLOCK=block,
        num_warps=min(max(block // 256, 1), 16), **pdl_args(x.device),
    )
    return out, res_out


@triton.jit
def _pair_columns(HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns [1, BLOCK_D] of the two members (k, HALF + k) of each of a head's HALF rotate-half pairs, and
    which of them exist (k < HALF)."""
    k = tl.arange(0, BLOCK_D)[None, :]
    return k, HALF + k, k < HALF


@triton.jit
def _head_members(x_ptr, t, x_stride_t, x_stride_h, num_heads, i1, i2, dmask, BLOCK_H: tl.constexpr):
    """This program's heads of token t: (head ids, their mask, x at columns i1 and at i2 [BLOCK_H, len(i1)]
    in x's dtype, zero where `dmask` is false)."""
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads[:, None] < num_heads
    base = x_ptr + t * x_stride_t + heads[:, None] * x_stride_h
    x1 = tl.load(base + i1, mask=hmask & dmask, other=0.0)
    x2 = tl.load(base + i2, mask=hmask & dmask, other=0.0)
    return heads, hmask, x1, x2


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, x_stride_t, x_stride_h, cs_stride, out_stride_t,
                   out_stride_h, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # x and the step's cos/sin come from earlier kernels
    t = tl.program_id(0).to(tl.int64)  # t * stride passes 2**31 in a large packed prefill
    i1, i2, dmask = _pair_columns(HALF, BLOCK_D)
    heads, hmask, x1, x2 = _head_members(x_ptr, t, x_stride_t, x_stride_h, num_heads, i1, i2, dmask, BLOCK_H)
    o1, o2 = rotated(x1.to(tl.float32), x2.to(tl.float32), x1.dtype, cos_ptr + t * cs_stride, sin_ptr + t * cs_stride,
                     i1)
    out_offset = t * out_stride_t + heads[:, None] * out_stride_h
    tl.store(out_ptr + out_offset + i1, o1, mask=hmask & dmask)
    tl.store(out_ptr + out_offset + i2, o2, mask=hmask & dmask)


@triton.jit
def _pair_turned(x1, x2, c1, c2, s1, s2):
    """Pair members x1, x2 (x's dtype) turned to (x1 c1 - x2 s1, x2 c2 + x1 s2) by the pair's table values
    (any float dtype, broadcastable), rounded as `mstar.models.vjepa2.rope.apply_rope` rounds in x's dtype:
    the tables cast to it, x * cos rounded, then the turned product added with one rounding (its addcmul)."""
    dtype = x1.dtype
    c1, c2 = c1.to(dtype).to(tl.float32), c2.to(dtype).to(tl.float32)
    s1, s2 = s1.to(dtype).to(tl.float32), s2.to(dtype).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((a1 * c1).to(dtype).to(tl.float32) - a2 * s1).to(dtype)
    o2 = ((a2 * c2).to(dtype).to(tl.float32) + a1 * s2).to(dtype)
    return o1, o2


@triton.jit
def _pair_rows_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, c_ptr, c_out_ptr, tokens, num_heads, x_stride_b, x_stride_t,
                      x_stride_h, cs_stride_b, cs_stride, out_stride_b, out_stride_t, out_stride_h, DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, COPY: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)  # x and the step's cos/sin come from earlier kernels
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T  # t0 * stride passes 2**31 in a large packed prefill
    b = tl.program_id(2).to(tl.int64)
    # offsets inside the tile stay 32-bit (`rotary_pairs` checks they fit); the tile's corner is 64-bit
    t = tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = ((t0 + t < tokens)[:, None] & (h < num_heads)[None, :])[:, :, None]
    cs_mask = (t0 + t < tokens)[:, None]
    if BLOCK_D != DIM:  # a padded head; a whole head stays unmasked, so its loads and stores stay vectors
        mask = mask & (d < DIM)[None, None, :]
        cs_mask = cs_mask & (d < DIM)[None, :]
    x_tile = (t[:, None] * x_stride_t + h[None, :] * x_stride_h)[:, :, None] + d[None, None, :]
    x_corner = b * x_stride_b + t0 * x_stride_t
    x = tl.load(x_ptr + x_corner + x_tile, mask=mask, other=0.0)
    cs = b * cs_stride_b + t0 * cs_stride + t[:, None] * cs_stride + d[None, :]
    cos = tl.load(cos_ptr + cs, mask=cs_mask, other=0.0)
    sin = tl.load(sin_ptr + cs, mask=cs_mask, other=0.0)
    # whole rows in, pairs (2k, 2k + 1) split apart in registers (each pair sits in one thread)
    x1, x2 = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_H, BLOCK_D // 2, 2]))
    c1, c2 = tl.split(tl.reshape(cos, [BLOCK_T, BLOCK_D // 2, 2]))
    s1, s2 = tl.split(tl.reshape(sin, [BLOCK_T, BLOCK_D // 2, 2]))
    o1, o2 = _pair_turned(x1, x2, c1[:, None, :], c2[:, None, :], s1[:, None, :], s2[:, None, :])
    out_tile = (t[:, None] * out_stride_t + h[None, :] * out_stride_h)[:, :, None] + d[None, None, :]
    out_corner = b * out_stride_b + t0 * out_stride_t
    tl.store(out_ptr + out_corner + out_tile, tl.reshape(tl.join(o1, o2), [BLOCK_T, BLOCK_H, BLOCK_D]), mask=mask)
    if COPY:  # a companion tensor laid out as x (the values beside the keys) copied as is, laid out as out
        c = tl.load(c_ptr + x_corner + x_tile, mask=mask, other=0.0)
        tl.store(c_out_ptr + out_corner + out_tile, c, mask=mask)


@triton.jit
def rotated(a1, a2, dtype, cos_row, sin_row, d):
    """Halves a1, a2 (float32 [heads, HALF]) rotated by one token's cos/sin, rounded as torch's
    `x * cos + rotate_half(x) * sin` rounds in `dtype` (the loaded x's): cos/sin (duplicated halves,
    [freqs, freqs]; `d` indexes the first) cast to it first, each product rounded, then their sum."""
    c = tl.load(cos_row + d).to(dtype).to(tl.float32)
    s = tl.load(sin_row + d).to(dtype).to(tl.float32)
    o1 = ((a1 * c).to(dtype).to(tl.float32) + (-a2 * s).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)).to(dtype)
    return o1, o2


@triton.jit
def _store_rotated(a1, a2, like, cos_row, sin_row, out_base, d, hmask, HALF: tl.constexpr):
    """Store halves a1, a2 rotated as `rotated` makes them (in the dtype of `like`, the loaded x)."""
    o1, o2 = rotated(a1, a2, like.dtype, cos_row, sin_row, d)
    tl.store(out_base + d, o1, mask=hmask)
    tl.store(out_base + HALF + d, o2, mask=hmask)


@triton.jit
def head_norm(a1, a2, w1, w2, eps, dtype, HALF: tl.constexpr):
    """RMSNorm of each head (row) over its two halves a1, a2 (float32 [heads, HALF]) with the weight's
    halves w1, w2, rounded as RMSNorm rounds in `dtype`: the normed value, then times the weight;
    float32 halves back."""
    inv = 1.0 / tl.sqrt((tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) / (2 * HALF) + eps)
    n1 = ((a1 * inv[:, None]).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    n2 = ((a2 * inv[:, None]).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return n1, n2


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (any strides with a unit last stride) by cos/sin [T, D] (rotate-half pairs);
    returns a new contiguous tensor."""
    tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride() and dim % 2 == 0, \
        "rotary needs unit-stride head dims and tables of one layout"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half, block_h = dim // 2, min(triton.next_power_of_2(heads), 16)
    _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
        x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1), HALF=half,
        BLOCK_D=triton.next_power_of_2(half), BLOCK_H=block_h, **pdl_args(x.device),
    )
    return out


def rotary_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None,
                 carry: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """V-JEPA 2's RoPE (`mstar.models.vjepa2.rope.apply_rope`, whose roundings it keeps) in one pass:
    x [B, H, N, D] (any strides with a unit last stride), channel pairs (2k, 2k + 1) turned by per-channel
    cos/sin [N, D] or [B, 1, N, D]; written into `out` (x's shape, unit last stride) when given, else
    into a new tensor whose dims lie in memory in x's order, as torch's elementwise result would.
    `carry` = (c, c_out), c with x's strides and c_out with out's: c copied into c_out in the same pass.
    Each program loads and stores two tokens' heads as whole rows, in vectors, and splits the pairs in
    registers (gathering each pair member with strided scalar loads timed several times slower)."""
    x, cos, sin, out, carry, result = _pair_views(x, cos, sin, out, carry)
    batch, tokens, heads, dim = x.shape
    assert x.stride(3) == out.stride(3) == cos.stride(2) == 1 and cos.stride() == sin.stride() and dim % 2 == 0, \
        "rotary needs unit-stride head dims and tables of one layout"
    assert batch < 65536, f"rotary launches one program row per batch row; {batch} pass the grid's 65535"
    block_t, block_h, block_d = _PAIR_TOKENS, _head_block(heads), triton.next_power_of_2(dim)
    for t in (x, out):
        assert block_t * abs(t.stride(1)) + heads * abs(t.stride(2)) + dim < 2 ** 31, "a tile's offsets pass 2**31"
    c, c_out = carry if carry is not None else (x, out)
    _pair_rows_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(heads, block_h), batch)](
        x, cos, sin, out, c, c_out, tokens, heads, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
        cos.stride(1), out.stride(0), out.stride(1), out.stride(2), DIM=dim, BLOCK_D=block_d, BLOCK_H=block_h,
        BLOCK_T=block_t, COPY=carry is not None, num_warps=_rows_warps(block_t, block_h, block_d), **pdl_args(x.device),
    )
    return result


# tokens a `_pair_rows_kernel` program: of 1, 2 and 4, two timed fastest or within noise of it at the plan's
# and the encoder's shapes, where the time is
_PAIR_TOKENS = 2


def _head_block(heads: int) -> int:
    """Heads per program: the largest power of two up to 16 that pads the heads by at most an eighth (22: 8)."""
    return next(block for block in (16, 8, 4, 2, 1) if triton.cdiv(heads, block) * block * 8 <= heads * 9)


def _rows_warps(block_t: int, block_h: int, block_d: int) -> int:
    """Warps of a `_pair_rows_kernel` program: at least 8 values a thread (a 16-byte vector of bf16), up to 8 warps."""
    return max(1, min(8, block_t * block_h * block_d // 256))


def _pair_views(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None,
                carry: tuple[torch.Tensor, torch.Tensor] | None):
    """The rotary_pairs arguments as the kernels take them, [B, N, H, D] (tables [B, N, D], c and c_out as x and
    out), and the result to return (`out`, or a new tensor laid out as x when out is None)."""
    batch, heads, tokens, dim = x.shape
    if out is None:
        order = sorted(range(4), key=lambda i: x.stride(i), reverse=True)  # outermost first
        out = torch.empty([x.shape[i] for i in order], dtype=x.dtype, device=x.device)
        out = out.permute(*(order.index(i) for i in range(4)))
    assert out.shape == x.shape, f"out {tuple(out.shape)} is not x's shape {tuple(x.shape)}"
    cos, sin = (torch.broadcast_to(t, (batch, 1, tokens, dim))[:, 0] for t in (cos, sin))
    if carry is not None:
        c, c_out = carry
        assert c.shape == x.shape and c.stride() == x.stride() and c_out.stride() == out.stride() \
            and c.dtype == c_out.dtype == x.dtype, "carry needs x's layout and dtype, and out's layout"
        carry = (c.transpose(1, 2), c_out.transpose(1, 2))
    return x.transpose(1, 2), cos, sin, out.transpose(1, 2), carry, out


@triton.jit
def _rope_cos_sin_kernel(pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, tokens, pos_stride, HALF: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rd = tl.arange(0, BLOCK_D)
    dmask = rd < HALF
    pos = tl.load(pos_ptr + rt * pos_stride, mask=rt < tokens, other=0).to(tl.float32)
    freqs = pos[:, None] * tl.load(inv_freq_ptr + rd, mask=dmask, other=0.0)[None, :]
    if LIBDEVICE:  # libdevice's cosf/sinf: the precise functions torch's CUDA cos/sin call (tl.cos is approximate)
        c, s = libdevice.cos(freqs), libdevice.sin(freqs)
    else:  # the interpreter has no libdevice; its tl.cos is numpy's
        c, s = tl.cos(freqs), tl.sin(freqs)
    offs = rt[:, None] * (2 * HALF) + rd[None, :]
    mask = (rt < tokens)[:, None] & dmask[None, :]
    tl.store(cos_ptr + offs, c, mask=mask)
    tl.store(cos_ptr + offs + HALF, c, mask=mask)
    tl.store(sin_ptr + offs, s, mask=mask)
    tl.store(sin_ptr + offs + HALF, s, mask=mask)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin) [T, 2 * len(inv_freq)] of positions [T] (integers, any stride; `inv_freq`
    contiguous): what `RotaryEmbedding` computes with five PyTorch kernels (cast, product, concatenation,
    cos, sin), in one."""
    tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((tokens, 2 * half), dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if tokens:
        block_t = 4
        _rope_cos_sin_kernel[(triton.cdiv(tokens, block_t),)](
            positions, inv_freq, cos, sin, tokens, positions.stride(0), HALF=half,
            BLOCK_D=triton.next_power_of_2(half), BLOCK_T=block_t, LIBDEVICE=positions.is_cuda,
            **pdl_args(positions.device))
    return cos, sin


@triton.jit
def _qk_norm_rotary_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, num_q, x_stride_t,
                           x_stride_h, cs_stride, out_stride_t, out_stride_h, eps, HALF: tl.constexpr,
                           BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)  # t * stride passes 2**31 in a large packed prefill
    d, d2, dmask = _pair_columns(HALF, HALF)
    heads, hmask, x1, x2 = _head_members(x_ptr, t, x_stride_t, x_stride_h, num_heads, d, d2, dmask, BLOCK_H)
    # RMSNorm over each head's 2 * HALF values (q heads first, with q's weight, then k heads, k's)
    is_q = heads[:, None] < num_q
    w1 = tl.where(is_q, tl.load(qw_ptr + d), tl.load(kw_ptr + d)).to(tl.float32)
    w2 = tl.where(is_q, tl.load(qw_ptr + HALF + d), tl.load(kw_ptr + HALF + d)).to(tl.float32)
    n1, n2 = head_norm(x1.to(tl.float32), x2.to(tl.float32), w1, w2, eps, x1.dtype, HALF)
    _store_rotated(n1, n2, x1, cos_ptr + t * cs_stride, sin_ptr + t * cs_stride,
                   out_ptr + t * out_stride_t + heads[:, None] * out_stride_h, d, hmask, HALF)


def qk_norm_rotary(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q: int,
                   cos: torch.Tensor, sin: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen3's qk-norm and RoPE in one launch: x [T, Hq + Hk, D] holds each token's q heads then its k
    heads (any strides with a unit last stride, e.g. a view of the qkv rows); each head is RMS-normed
    over D with `q_weight` (the first `num_q` heads) or `k_weight`, then rotated by cos/sin [T, D]
    (a row stride of 0 gives every token the same position). Returns `out` (shaped like x, unit last
    stride; it may be x itself: a program reads its heads whole before it writes them), by default a new
    contiguous [T, Hq + Hk, D]."""
    tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and cos.stride(1) == 1 and dim % 2 == 0, "qk_norm_rotary needs unit-stride head dims"
    assert q_weight.is_contiguous() and k_weight.is_contiguous() and q_weight.numel() == k_weight.numel() == dim
    if out is None:
        out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(2) == 1, "qk_norm_rotary: out like x"
    block_h = min(triton.next_power_of_2(heads), 16)
    _qk_norm_rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
        x, q_weight, k_weight, cos, sin, out, heads, num_q, x.stride(0), x.stride(1), cos.stride(0), out.stride(0),
        out.stride(1), eps, HALF=dim // 2, BLOCK_H=block_h, **pdl_args(x.device),
    )
    return out


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, n, x_stride, out_stride, ACT: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in a large packed prefill
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0)
    if ACT == "silu":
        out = silu_times(gate, up)
    else:
        out = gelu_tanh_times(gate, up)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


@triton.jit
def silu_times(gate, up):
    """silu(gate) * up in gate's dtype, rounded as `F.silu(gate) * up` rounds: the activation to the
    input dtype first, then the product (the SiLU kernel here and the GEMV's gated x-load share it)."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def gelu_tanh_times(gate, up):
    """gelu_tanh(gate) * up in gate's dtype, rounded as `F.gelu(gate, approximate="tanh") * up` rounds.
    0.5 g (1 + tanh(u)) is written as g * sigmoid(2u): the same value, with no tanh (the interpreter has
    no libdevice) and no cancellation."""
    g = gate.to(tl.float32)
    u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
    act = (g / (1.0 + tl.exp(-2.0 * u))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


def _act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    rows, width = x.shape
    assert x.stride(1) == 1, "act-and-mul needs unit-stride rows"
    half = width // 2
    out = torch.empty((rows, half), dtype=x.dtype, device=x.device)
    block = 1024
    _act_mul_kernel[(rows, triton.cdiv(half, block))](x, out, half, x.stride(0), out.stride(0), ACT=act, BLOCK=block,
                                                      **pdl_args(x.device))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    return _act_and_mul(x, "silu")


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> gelu_tanh(gate) * up, [T, I] (Gemma's MLP)."""
    return _act_and_mul(x, "gelu_tanh")


@triton.jit
def _sigmoid_gate_add_kernel(out_ptr, base_ptr, gate_ptr, shared_ptr, n, base_stride, gate_stride, shared_stride,
                             out_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 in a large packed prefill
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    base = tl.load(base_ptr + row * base_stride + cols, mask=mask, other=0.0)
    shared = tl.load(shared_ptr + row * shared_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * gate_stride).to(tl.float32)
    dtype = base.dtype
    gate = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # torch.sigmoid rounds to the input dtype
    scaled = (gate * shared).to(dtype).to(tl.float32)  # and so does the product
    tl.store(out_ptr + row * out_stride + cols, (base.to(tl.float32) + scaled).to(dtype), mask=mask)


def sigmoid_gate_add(base: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """base + sigmoid(gate) * shared in one pass: base and shared [T, H], gate [T, 1] (one logit a row; a MoE
    block's shared-expert gate). Written to round where that PyTorch expression rounds, which the
    interpreter does; the compiled kernel may drop the product's rounding, so some sums come out one
    bf16 step off (tests/gpu/test_qwen3_omni_kernels_gpu.py allows that)."""
    rows, width = base.shape
    if shared.shape != base.shape or gate.shape != (rows, 1) or base.stride(1) != 1 or shared.stride(1) != 1:
        raise ValueError(f"sigmoid_gate_add needs base and shared [T, H] with unit column stride and gate "
                         f"[T, 1]; got {tuple(base.shape)}, {tuple(shared.shape)}, {tuple(gate.shape)}")
    out = torch.empty((rows, width), dtype=base.dtype, device=base.device)
    block = 1024
    _sigmoid_gate_add_kernel[(rows, triton.cdiv(width, block))](
        out, base, gate, shared, width, base.stride(0), gate.stride(0), shared.stride(0), out.stride(0),
        BLOCK=block, **pdl_args(base.device))
    return out
