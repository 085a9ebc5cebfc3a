"""Checks of the per-token activation quantization kernel (mstar/kernels/fp8_quant.py) and of the W8A8 path
that uses it (`layers.fp8.scaled_mm`); run with TRITON_INTERPRET=1 by test_fp8_quant_interpreted.py, in a
fresh process so the interpreter setting holds for every kernel."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mstar.kernels.fp8_quant import INV_FP8_MAX, quantize_rows, quantize_rows_as
from mstar.layers import fp8
from mstar.layers.fused import fused_kernels

# (rows, K): one chunk, ragged chunks, Wan's hidden and FFN widths
SHAPES = [(1, 16), (5, 1000), (3, 1025), (4, 3072), (2, 14336)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def rows_of(rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different ranges, with zeros, -0, values far below a row's amax (E4M3 subnormals and
    flush to +-0) and one all-zero row."""
    x = torch.randn(rows, k) * torch.logspace(-3, 3, rows)[:, None]
    x[:, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    x[:, 4:12] *= 1e-4
    x[-1] = 0.0 if rows > 1 else x[-1]
    return x.to(dtype)


def cuda_formula(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_channel` as torch computes it on CUDA: there `amax / 448` (a CPU scalar divisor) is a
    multiply by the float32 reciprocal of 448; the rest as on the CPU."""
    w = x.float()
    scale = (w.abs().amax(dim=1, keepdim=True) * torch.tensor(INV_FP8_MAX)).clamp(min=1e-12)
    return (w / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(torch.float8_e4m3fn), scale


def check_same_bits(x: torch.Tensor) -> None:
    check_bits(quantize_rows(x), fp8.quantize_per_channel(x), x)
    check_bits(quantize_rows_as(x, cuda_rounding=True), cuda_formula(x), x)


def check_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> None:
    (q, s), (ref_q, ref_s) = got, want
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous(), (q.dtype, q.stride())
    assert s.dtype == torch.float32 and s.shape == (x.shape[0], 1)
    assert torch.equal(s, ref_s), f"scales differ for {tuple(x.shape)} {x.dtype}"
    differ = int((bits(q) != bits(ref_q)).sum())
    assert differ == 0, f"{differ} E4M3 values differ for {tuple(x.shape)} {x.dtype}"


def check_not_finite(dtype: torch.dtype) -> None:
    """Rows holding a NaN or an inf quantize as the formula does: a NaN makes the row's scale and every value
    NaN, an inf makes the scale inf, its own value NaN and the others +-0 (none of them finite garbage)."""
    x = rows_of(4, 1500, dtype)
    x[0, 1100] = float("nan")
    x[1, 7] = float("inf")
    x[2, 1200] = -float("inf")
    for got, want in ((quantize_rows(x), fp8.quantize_per_channel(x)),
                      (quantize_rows_as(x, cuda_rounding=True), cuda_formula(x))):
        check_same_nan_bits(got, want)


def check_same_nan_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The same scales and E4M3 values, NaN where the reference is NaN (a NaN's sign bit aside)."""
    (q, s), (ref_q, ref_s) = got, want
    assert torch.equal(s.isnan(), ref_s.isnan()) and torch.equal(s.nan_to_num(), ref_s.nan_to_num()), (s, ref_s)
    q, ref_q = q.float(), ref_q.float()
    assert torch.equal(q.isnan(), ref_q.isnan()), f"NaN at {q.isnan().sum()} places, the formula at {ref_q.isnan().sum()}"
    finite = ~ref_q.isnan()
    assert torch.equal(bits(q[finite].to(torch.float8_e4m3fn)), bits(ref_q[finite].to(torch.float8_e4m3fn)))


def check_grid() -> None:
    """Every finite E4M3 value, every midpoint between neighbours (ties: to even) and the floats either side
    of each midpoint, in one row whose amax is 448 (scale 1)."""
    values = bits(torch.arange(256, dtype=torch.uint8)).view(torch.float8_e4m3fn).float()
    values = values[~values.isnan()].sort().values
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    row = torch.cat([values, mids, mids.nextafter(up), mids.nextafter(down)])
    assert row.abs().max() == fp8.FP8_MAX
    check_same_bits(row[None])


class Ops(TorchDispatchMode):
    """The aten ops run inside the block, with their first tensor argument and their tensor result."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple, torch.Tensor | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func.overloadpacket.__name__, args, out if isinstance(out, torch.Tensor) else None))
        return out


def check_scaled_mm_path() -> None:
    """`scaled_mm` quantizes the activations in the one kernel (no float32 copy of them, none of the
    formula's ops), hands `_scaled_mm` the row-major E4M3 rows, the weight's transposed view (column
    major, no copy) and the bias (added in its epilogue: nothing runs after it), and matches its CPU
    emulation; with the fused kernels off it runs the formula."""
    torch.manual_seed(1)
    rows, k, n = 40, 256, 64
    layer = fp8.Fp8Linear.from_linear(torch.nn.Linear(k, n).to(torch.bfloat16), None)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    with Ops() as ops:
        got = fp8.scaled_mm(x, layer.weight, layer.weight_scale, layer.bias)
    names = [name for name, _, _ in ops.calls]
    formula = {"abs", "amax", "div", "clamp", "_to_copy"}
    assert not formula & set(names), names
    temporaries = [name for name, _, out in ops.calls
                   if out is not None and out.dtype == torch.float32 and out.numel() == x.numel()]
    assert not temporaries, f"float32 copies of the activations: {temporaries}"
    (_, args, out), = [call for call in ops.calls if call[0] == "_scaled_mm"]
    xq, wt = args[0], args[1]
    assert args[4] is layer.bias and out is got  # the bias added in _scaled_mm's epilogue, no add after it
    assert xq.dtype == torch.float8_e4m3fn and xq.stride() == (k, 1), xq.stride()
    assert wt.stride() == (1, k) and wt.data_ptr() == layer.weight.data_ptr(), (wt.stride(), "weight copied")
    want = fp8.w8a8_reference(x, layer)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)

    with fused_kernels(False), Ops() as ops:
        again = fp8.scaled_mm(x, layer.weight, layer.weight_scale, layer.bias)
    assert "amax" in [name for name, _, _ in ops.calls]  # the PyTorch formula: the switch's reference
    assert torch.equal(again, got)  # same bits of q and s, so the same product


def main() -> None:
    torch.manual_seed(0)
    for rows, k in SHAPES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            check_same_bits(rows_of(rows, k, dtype))
    wide = rows_of(3, 1200, torch.bfloat16)
    check_same_bits(wide[:, 100:1100])  # a row stride wider than the row
    q, s = quantize_rows(torch.empty(0, 64, dtype=torch.bfloat16))
    assert q.shape == (0, 64) and s.shape == (0, 1)
    check_grid()
    for dtype in (torch.bfloat16, torch.float32):
        check_not_finite(dtype)
    check_scaled_mm_path()
    print("fp8 quant ok")


if __name__ == "__main__":
    main()
