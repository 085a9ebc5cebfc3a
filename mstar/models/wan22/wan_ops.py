"""Fused Triton kernels for the Wan DiT block's elementwise and norm work, one kernel per step.

Each kernel reads its activations once, computes in float32 and rounds once to the activation dtype
where the reference (diffusers' float32 norms and modulation, then a cast) rounds:

- `layer_norm_modulate`: LayerNorm (no affine) of x (or of x + residual, rounded first) times
  (1 + scale) plus shift, scale/shift float32 per timestep group (request, frame or token);
- `gated_residual`: x + y * gate (gate float32 per group), optionally followed by an affine LayerNorm
  of the rounded sum (the cross-attention's norm2) in the same pass;
- `rms_norm_rope`: RMSNorm across all heads with its weight, rounded, then the 3D rope from the
  (cos, sin) tables of `mstar.models.wan22.block_math.rope_tables` (or no rope: the cross-attention's q).

One program per token row (the whole hidden size in registers), so per-row statistics need no second
pass over memory. Use through `mstar/models/wan22/block_math.py`, which keeps the PyTorch forms as the
CPU and torch.compile path; tests run these kernels on CPU with TRITON_INTERPRET=1.

Activations are [B, L, D] (rows may be strided, the last dim contiguous); a modulation tensor is
[B, T, 1, D] float32 (any strides, last contiguous) with T dividing L: row l of request b uses group
(b, l // (L / T)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mod_offset(row, seq_len, group_len, stride_b, stride_t):
    """Offset of row `row`'s modulation vector: request row // seq_len, group (row % seq_len) // group_len."""
    b = row // seq_len
    t = (row % seq_len) // group_len
    return b * stride_b + t * stride_t


@triton.jit
def _token_row(ptr, row, seq_len, stride_b, stride_l):
    """Start of packed row `row` (request row // seq_len, token row % seq_len) of a [B, L, D] tensor."""
    return ptr + (row // seq_len) * stride_b + (row % seq_len) * stride_l


@triton.jit
def _centred(xf, mask, n_cols, eps):
    """LayerNorm's statistics of one float32 row: (x - mean, zero where masked; 1 / std)."""
    mean = tl.sum(xf, axis=0) / n_cols
    diff = tl.where(mask, xf - mean, 0.0)
    return diff, 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / n_cols + eps)


@triton.jit
def _ln_modulate_kernel(x_ptr, res_ptr, sum_ptr, shift_ptr, scale_ptr, out_ptr, n_cols, seq_len, group_len,
                        x_sb, x_sl, r_sb, r_sl, sh_sb, sh_st, sc_sb, sc_st, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # offsets of long videos pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(_token_row(x_ptr, row, seq_len, x_sb, x_sl) + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(_token_row(res_ptr, row, seq_len, r_sb, r_sl) + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # `x + residual` in torch rounds here
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    diff, rstd = _centred(x.to(tl.float32), mask, n_cols, eps)
    shift = tl.load(shift_ptr + _mod_offset(row, seq_len, group_len, sh_sb, sh_st) + cols, mask=mask)
    scale = tl.load(scale_ptr + _mod_offset(row, seq_len, group_len, sc_sb, sc_st) + cols, mask=mask)
    out = (diff * rstd) * (1.0 + scale.to(tl.float32)) + shift.to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_residual_kernel(x_ptr, y_ptr, gate_ptr, w_ptr, bias_ptr, out_ptr, h_ptr, n_cols, seq_len,
                           group_len, x_sb, x_sl, y_sb, y_sl, g_sb, g_st, eps,
                           HAS_NORM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # offsets of long videos pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(_token_row(x_ptr, row, seq_len, x_sb, x_sl) + cols, mask=mask, other=0.0)
    y = tl.load(_token_row(y_ptr, row, seq_len, y_sb, y_sl) + cols, mask=mask, other=0.0)
    gate = tl.load(gate_ptr + _mod_offset(row, seq_len, group_len, g_sb, g_st) + cols, mask=mask,
                   other=0.0)
    summed = (x.to(tl.float32) + y.to(tl.float32) * gate.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n_cols + cols, summed, mask=mask)
    if HAS_NORM:  # the norm reads the rounded sum, as a separate torch LayerNorm would
        diff, rstd = _centred(summed.to(tl.float32), mask, n_cols, eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * n_cols + cols, (diff * rstd * w + bias).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_cols, seq_len, head_dim, x_sb, x_sl,
                          cs_stride, eps, HAS_ROPE: tl.constexpr, SHUFFLE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # offsets of long videos pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    tok = row % seq_len
    x_row = _token_row(x_ptr, row, seq_len, x_sb, x_sl)
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (xf * rstd * w).to(x.dtype)  # the norm's output is a tensor of x's dtype in the reference
    if HAS_ROPE:
        # out = x * cos + (x2, x1) * sin per channel pair
        pairs = normed.to(tl.float32)
        if SHUFFLE:  # the pair swap as a register shuffle
            even, odd = tl.split(tl.reshape(pairs, (BLOCK // 2, 2)))
            swapped = tl.reshape(tl.join(odd, even), (BLOCK,))
        else:  # or the partner channels re-read (same cache lines) and normed again
            partner = cols ^ 1
            xp = tl.load(x_row + partner, mask=mask, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32)
            swapped = (xp * rstd * wp).to(x.dtype).to(tl.float32)
        channel = cols % head_dim
        c = tl.load(cos_ptr + tok * cs_stride + channel, mask=mask, other=0.0)
        s = tl.load(sin_ptr + tok * cs_stride + channel, mask=mask, other=0.0)
        normed = (pairs * c + swapped * s).to(x.dtype)
    tl.store(out_ptr + row * n_cols + cols, normed, mask=mask)


# How the rope swaps channel pairs: True shuffles registers (no extra loads); False re-reads the partner
# channel, for a Triton version whose reshape/split/join cannot compile the shuffle.
SHUFFLE_PAIRS = True


def _launch_meta(n_cols: int) -> dict[str, int]:
    block = triton.next_power_of_2(n_cols)
    return {"BLOCK": block, "num_warps": min(max(block // 512, 1), 8)}


def _rows(x: torch.Tensor, name: str) -> tuple[int, int]:
    """(batch stride, token stride) of a [B, L, D] tensor whose last dim is contiguous."""
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"{name} must be [B, L, D] with a contiguous last dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    return x.stride(0), x.stride(1)


def _groups(x: torch.Tensor, mod: torch.Tensor, name: str) -> tuple[int, int, int]:
    """(tokens per group, batch stride, group stride) of a [B, T, 1, D] modulation tensor for x."""
    batch, length, dim = x.shape
    if mod.dim() != 4 or mod.shape[0] != batch or mod.shape[2] != 1 or mod.shape[3] != dim \
            or length % mod.shape[1] or mod.stride(3) != 1:
        raise ValueError(f"{name} of shape {tuple(mod.shape)} (strides {mod.stride()}) does not modulate x of "
                         f"shape {tuple(x.shape)}: need [B, T, 1, D] with T dividing L and a contiguous last dim")
    return length // mod.shape[1], mod.stride(0), mod.stride(1)


def layer_norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                        residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(s) * (1 + scale) + shift in x's dtype, s) with s = x, or x + residual rounded to
    x's dtype; x, residual [B, L, D]; shift, scale [B, T, 1, D] float32. The normed result is
    contiguous; s is x itself when there is no residual."""
    batch, length, dim = x.shape
    group_len, sh_sb, sh_st = _groups(x, shift, "shift")
    _, sc_sb, sc_st = _groups(x, scale, "scale")
    out = torch.empty((batch, length, dim), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else x
    res = residual if residual is not None else x
    _ln_modulate_kernel[(batch * length,)](
        x, res, summed, shift, scale, out, dim, length, group_len, *_rows(x, "x"), *_rows(res, "residual"),
        sh_sb, sh_st, sc_sb, sc_st, eps, HAS_RESIDUAL=residual is not None, **_launch_meta(dim))
    return out, summed


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor,
                   norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(s, layer_norm(s, weight, bias, eps) or None), s = x + y * gate rounded once to x's dtype;
    x, y [B, L, D]; gate [B, T, 1, D] float32; `norm` = (weight, bias, eps) of an affine LayerNorm."""
    batch, length, dim = x.shape
    group_len, g_sb, g_st = _groups(x, gate, "gate")
    out = torch.empty((batch, length, dim), dtype=x.dtype, device=x.device)
    h = torch.empty_like(out) if norm is not None else out
    weight, bias, eps = norm if norm is not None else (gate, gate, 0.0)
    _gated_residual_kernel[(batch * length,)](
        x, y, gate, weight, bias, out, h, dim, length, group_len, *_rows(x, "x"), *_rows(y, "y"),
        g_sb, g_st, eps, HAS_NORM=norm is not None, **_launch_meta(dim))
    return out, h if norm is not None else None


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """rope(rms_norm(x) * weight rounded to x's dtype) rounded again, as [B, L, heads, D / heads]
    (contiguous); x [B, L, D] (a strided view such as a chunk of a fused QKV is fine); rope = (cos, sin)
    [L, D / heads] float32 in `rope_tables`' layout, or None for the norm alone."""
    batch, length, dim = x.shape
    head_dim = dim // heads
    cos, sin = rope if rope is not None else (weight[None], weight[None])
    if rope is not None and (cos.shape != (length, head_dim) or sin.shape != cos.shape or head_dim % 2
                             or cos.stride(1) != 1 or sin.stride() != cos.stride()):
        raise ValueError(f"rope tables of shapes {tuple(cos.shape)}, {tuple(sin.shape)} do not fit x of shape "
                         f"{tuple(x.shape)} with {heads} heads: need [L, head_dim] (even head_dim), same strides")
    out = torch.empty((batch, length, heads, head_dim), dtype=x.dtype, device=x.device)
    _rms_norm_rope_kernel[(batch * length,)](
        x, weight, cos, sin, out, dim, length, head_dim, *_rows(x, "x"), cos.stride(0), eps,
        HAS_ROPE=rope is not None, SHUFFLE=SHUFFLE_PAIRS, **_launch_meta(dim))
    return out
