"""Pi0.5's norms as one Triton kernel each: the residual branch's add (gated, in the action expert) and the
next norm, Gemma's (x / rms(x) * (1 + weight)) or the expert's adaRMS (x / rms(x) * (1 + scale) + shift).

In PyTorch a norm is a float32 cast of x, the RMS norm, the modulation and a cast back, and the gated residual
before it one more kernel; here one program reads a row of x (and of the branch) once and writes the new
residual row and the normed row. It rounds where the PyTorch form (`gemma.py`) does: the residual sum to x's
dtype, the norm in float32 to x's dtype once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _modulated_norm_kernel(x_ptr, branch_ptr, gate_ptr, scale_ptr, shift_ptr, normed_ptr, sum_ptr, n_cols,
                           rows_per_cond, x_stride, branch_stride, sum_stride, normed_stride, gate_stride,
                           scale_stride, shift_stride, eps, HAS_BRANCH: tl.constexpr, HAS_GATE: tl.constexpr,
                           HAS_SHIFT: tl.constexpr, PLUS_ONE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cond = row // rows_per_cond  # the row of the modulation (the robot's time condition) this row takes
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_BRANCH:
        y = tl.load(branch_ptr + row * branch_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            y = y * tl.load(gate_ptr + cond * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) + y).to(x.dtype)  # rounded as `addcmul(x, y, gate)` (or `x + y`) rounds
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    scale = tl.load(scale_ptr + cond * scale_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if PLUS_ONE:
        scale += 1.0
    out = xf * inv * scale
    if HAS_SHIFT:
        out += tl.load(shift_ptr + cond * shift_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * normed_stride + cols, out.to(normed_ptr.dtype.element_ty), mask=mask)


def modulated_rms_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, eps: float,
                       branch: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                       plus_one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, s) for rows x [R, W], where s = x + gate * branch (x + branch without a gate; x itself without a
    branch, [R, W] like x) rounded to x's dtype, and normed = s / rms(s) * scale + shift computed in float32
    and rounded to x's dtype. `scale`, `shift` and `gate` are [N, W] with N dividing R: row r takes their row
    r // (R / N), so N = 1 shares one modulation and N = B gives each robot's L rows its own. Every tensor's
    last dimension has unit stride; rows may be strided. `plus_one`: the scale is 1 + `scale` in float32 (Gemma's
weight). Launch only: no host sync."""
    rows, width = x.shape
    cond_rows = scale.shape[0]
    assert rows % cond_rows == 0 and scale.shape == (cond_rows, width), (x.shape, scale.shape)
    for t in (x, scale, shift, branch, gate):
        assert t is None or t.stride(-1) == 1, "modulated_rms_norm needs unit-stride rows"
    assert branch is not None or gate is None, "a gate needs a branch"
    assert shift is None or shift.shape == scale.shape
    assert branch is None or branch.shape == x.shape
    assert gate is None or gate.shape == scale.shape
    normed = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    summed = x if branch is None else torch.empty((rows, width), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(width)
    _modulated_norm_kernel[(rows,)](
        x, x if branch is None else branch, scale if gate is None else gate, scale, scale if shift is None else shift,
        normed, summed, width, rows // cond_rows, x.stride(0), 0 if branch is None else branch.stride(0),
        summed.stride(0), normed.stride(0), 0 if gate is None else gate.stride(0), scale.stride(0),
        0 if shift is None else shift.stride(0), eps, HAS_BRANCH=branch is not None, HAS_GATE=gate is not None,
        HAS_SHIFT=shift is not None, PLUS_ONE=plus_one, BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    return normed, summed
