"""Per-token FP8 (E4M3) quantization of activations in one kernel: `quantize_rows(x) -> (q, s)`.

W8A8 (`mstar.layers.fp8.scaled_mm`) quantizes every activation row before `torch._scaled_mm`:
s = amax(|x[m, :]|) / 448 (at least 1e-12), q = round_e4m3(clamp(x / s, -448, 448)). Written as
PyTorch (`layers.fp8.quantize_per_channel`) that is seven kernels through float32 temporaries of
the activation's size (about 39 bytes of traffic an element); here it is one kernel that reads each
bf16/fp16 row twice (the second time mostly from L2) and writes one byte an element plus the scale.

The result is bit-identical to `quantize_per_channel` on the same device. torch computes `amax / 448`
differently by device: CUDA multiplies by the float32 reciprocal of a scalar divisor, the CPU divides; the
kernel does the same for CUDA tensors and for CPU tensors (the interpreter), and divides x by the scale
correctly rounded (`div_rn`: Triton's `/` is approximate for float32) as torch does on both. The rounding
to E4M3 is done in float32 arithmetic, round-to-nearest-even at the E4M3 spacing of each value (subnormals included),
so the final cast only converts exact values: it does not depend on the target's conversion
instruction, and the Triton interpreter (whose float8 cast does not round to nearest even) gives the
same bits on CPU for tests. Every max, min and clamp propagates NaN as torch's amax and clamp do (Triton's
default on GPUs returns the other operand): a NaN makes its row's scale and values NaN, an inf makes the
scale inf and its own value NaN, instead of both turning into finite values.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from mstar.layers.fp8 import FP8_MAX, MIN_SCALE

INV_FP8_MAX = float(np.float32(1.0 / FP8_MAX))  # what torch's CUDA division by the scalar 448 multiplies by
_BLOCK = 1024  # columns a chunk: 8 bf16 values (16 bytes) a thread at 4 warps


@triton.jit
def _round_e4m3(v):
    """v (float32, |v| <= 448 or NaN) rounded to nearest even at E4M3's spacing there: 2^(e - 3) for
    |v| in [2^e, 2^(e+1)), e >= -6, and the subnormal step 2^-9 below 2^-6; the sign kept (-0 too). A NaN
    becomes the float32 NaN whose top mantissa bits are E4M3's NaN, which every cast keeps a NaN."""
    bits = v.to(tl.int32, bitcast=True)
    ulp = tl.maximum((bits & 0x7F800000) - (3 << 23), (127 - 9) << 23).to(tl.float32, bitcast=True)
    # float32 numbers in [2^23, 2^24) * ulp are exactly the multiples of ulp: adding 1.5 * 2^23 * ulp rounds |v|
    # to one of them (to nearest even), subtracting it again is exact
    magic = ulp * 12582912.0
    rounded = (tl.abs(v) + magic) - magic
    # v's sign put back, so that a negative value rounded to zero stays -0 as torch's cast keeps it
    rounded = tl.where(v == v, rounded.to(tl.int32, bitcast=True), 0x7FF00000)
    return (rounded | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _max_nan(a, b):
    """max(a, b), NaN if either is NaN (torch's amax)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, x_stride, q_stride,
                          FMAX: tl.constexpr, INV_FMAX: tl.constexpr, RECIPROCAL: tl.constexpr, SMIN: tl.constexpr,
                          BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    q_row = q_ptr + row * q_stride
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(CHUNKS):
        start = i * BLOCK
        x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
        amax = _max_nan(amax, tl.abs(x))
    row_amax = tl.reduce(amax, 0, _max_nan)
    if RECIPROCAL:
        scale = row_amax * INV_FMAX
    else:
        scale = tl.math.div_rn(row_amax, FMAX)
    scale = _max_nan(scale, SMIN)
    tl.store(s_ptr + row, scale)
    for i in range(CHUNKS):
        start = i * BLOCK
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(_max_nan(tl.math.div_rn(x, scale), -FMAX), FMAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_row + start + cols, _round_e4m3(v).to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [M, K] row-major, s float32 [M, 1]) for x [M, K] bfloat16/float16/float32 with a unit
    column stride: `layers.fp8.quantize_per_channel(x)`'s bits on x's device in one launch (module docstring)."""
    return quantize_rows_as(x, cuda_rounding=x.is_cuda)


def quantize_rows_as(x: torch.Tensor, cuda_rounding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` with the scale rounded as torch rounds it on CUDA (`cuda_rounding`) or on the CPU,
    whatever x's device: so that the CPU tests check the CUDA form too."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows needs 2-D rows with unit column stride, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, s, cols, x.stride(0), q.stride(0), FMAX=FP8_MAX, INV_FMAX=INV_FP8_MAX,
                                       RECIPROCAL=cuda_rounding, SMIN=MIN_SCALE,
                                       BLOCK=_BLOCK, CHUNKS=triton.cdiv(cols, _BLOCK), num_warps=4)
    return q, s
