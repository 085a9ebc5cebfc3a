"""Checks of the FP8-weight GEMV (mstar/kernels/fp8_gemv.py) against the dequantize-then-linear references
of layers/fp8.py; run with TRITON_INTERPRET=1 by test_fp8_gemv_interpreted.py, in a fresh process so the
interpreter setting holds for every kernel."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from mstar.kernels import fused_ops
from mstar.kernels.fp8_gemv import fp8_gemv, pick_fp8_config
from mstar.kernels.skinny_gemm import SkinnyConfig
from mstar.layers.fp8 import Fp8Linear, dequantize, gemv_linear, silu_and_mul_gemv_linear, weight_only_linear

# One rounding of an output to bf16 (up to 2^-7 relative: the interpreter rounds toward zero) plus fp32 sums.
EXACT_TOL = {torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3}, torch.float16: {"atol": 2e-3, "rtol": 1e-3}}
# weight_only_linear also rounds every q * s to x's dtype before multiplying.
REFERENCE_TOL = {"atol": 5e-2, "rtol": 3e-2}


def module(n: int, k: int, block, bias: bool, dtype: torch.dtype, seed: int = 0) -> Fp8Linear:
    torch.manual_seed(seed)
    dense = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        dense.weight.mul_(torch.logspace(-1, 1, n)[:, None])  # rows of different ranges: scales matter
    return Fp8Linear.from_linear(dense.to(dtype), block)


def exact(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """x @ (q * s).T + bias in float64, rounded once to x's dtype: what the kernel computes up to fp32 sums."""
    w = dequantize(layer.weight, layer.weight_scale, layer.block).double()
    out = F.linear(x.double(), w, None if layer.bias is None else layer.bias.double())
    return out.to(x.dtype)


def check(x: torch.Tensor, layer: Fp8Linear, config: SkinnyConfig | None = None) -> None:
    got = fp8_gemv(x, layer.weight, layer.weight_scale, layer.bias, layer.block, config=config)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], layer.out_features)
    torch.testing.assert_close(got, exact(x, layer), **EXACT_TOL[x.dtype])
    torch.testing.assert_close(got.float(), weight_only_linear(x, layer).float(), **REFERENCE_TOL)
    again = fp8_gemv(x, layer.weight, layer.weight_scale, layer.bias, layer.block, config=config)
    assert torch.equal(got, again), f"not reproducible: {config}"


# (rows, N, K, block): ragged N and K, 128x128 blocks as served, small blocks with ragged edges
CASES = [(1, 37, 200, None), (3, 40, 256, None), (4, 300, 1024, None), (5, 48, 200, None), (16, 33, 256, None),
         (1, 300, 256, (128, 128)), (2, 40, 200, (16, 32)), (8, 300, 256, (128, 128)), (16, 37, 96, (16, 32)),
         (33, 70, 200, None), (64, 40, 128, (16, 32))]
# --quick: per channel (bf16 and fp16), 128x128 blocks with a ragged N, the tl.dot kernel; a block-scaled GEMV
# runs one interpreted program per output row, so its N stays small here
QUICK_CASES = [CASES[0], (1, 40, 256, (128, 128)), CASES[7]]


def check_default_configs(cases=CASES) -> None:
    for i, (m, n, k, block) in enumerate(cases):
        for dtype in (torch.bfloat16, torch.float16) if i % 3 == 0 else (torch.bfloat16,):
            layer = module(n, k, block, bias=i % 2 == 0, dtype=dtype, seed=i)
            check(torch.randn(m, k).to(dtype), layer)


def check_configs() -> None:
    # The GEMV with x broadcast (BLOCK_K spans the warps) or read through weight-shaped pointers, folded
    # along K or not, one or several K chunks, K a multiple of BLOCK_K or not; the tl.dot kernel at M <= 4.
    layer = module(24, 2048 + 64, None, bias=True, dtype=torch.bfloat16)
    x = torch.randn(4, 2048 + 64).to(torch.bfloat16)
    for cfg in (SkinnyConfig(4, 2, 1024, num_warps=4, fold_k=8), SkinnyConfig(4, 8, 64, num_warps=4, fold_k=1),
                SkinnyConfig(4, 4, 512, num_warps=8, fold_k=4), SkinnyConfig(16, 16, 128, num_warps=4)):
        check(x, layer, cfg)
    check(x[:1], layer, SkinnyConfig(1, 4, 1024, num_warps=4))
    blocks = module(64, 512, (32, 128), bias=False, dtype=torch.bfloat16)
    for cfg in (SkinnyConfig(2, 16, 128), SkinnyConfig(2, 8, 32, fold_k=2), SkinnyConfig(16, 16, 64)):
        check(x[:2, :512].contiguous(), blocks, cfg)


def check_picked_configs() -> None:
    # Orpheus-3B decode shapes: per-channel GEMV with x broadcast and K in whole chunks; enough programs.
    for n, k in ((5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)):
        for m in (1, 2, 4):
            cfg = pick_fp8_config(m, n, k, None)
            assert not cfg.use_dot and cfg.block_k == 1024 and cfg.num_warps == 4 and k % cfg.block_k == 0, cfg
            assert -(-n // cfg.block_n) >= 2 * 132, cfg
        assert pick_fp8_config(8, n, k, None).use_dot and pick_fp8_config(1, n, k, (128, 128)).block_k == 128
        assert [pick_fp8_config(m, n, k, None).block_m for m in (5, 16, 17, 64)] == [16, 16, 32, 64]


GATED_CASES = [(1, 37, 200, None, None), (3, 40, 256, (16, 32), None),
               (4, 24, 1024, None, SkinnyConfig(4, 2, 1024, num_warps=2, fold_k=8)), (2, 300, 256, (128, 128), None)]
QUICK_GATED_CASES = [GATED_CASES[0], GATED_CASES[2], (2, 24, 256, (128, 128), None)]


def check_gated(cases=GATED_CASES) -> None:
    # silu(gate) * up taken in the x-load: the same bits as fused_ops.silu_and_mul then the same GEMV (they
    # share silu_times), per channel and in blocks, x broadcast or not, 1..4 rows. Not compared with
    # F.silu: the interpreter rounds float32 -> bfloat16 toward zero, so its activations differ from torch's.
    for m, n, k, block, cfg in cases:
        layer = module(n, k, block, bias=m % 2 == 1, dtype=torch.bfloat16, seed=m)
        gate_up = (torch.randn(m, 2 * k) * 2).to(torch.bfloat16)
        got = fp8_gemv(gate_up, layer.weight, layer.weight_scale, layer.bias, block, config=cfg, gated=True)
        act = fused_ops.silu_and_mul(gate_up)
        assert torch.equal(got, fp8_gemv(act, layer.weight, layer.weight_scale, layer.bias, block, config=cfg))
        torch.testing.assert_close(got, exact(act, layer), **EXACT_TOL[got.dtype])
        if cfg is None:
            assert torch.equal(got, silu_and_mul_gemv_linear(gate_up, layer))
    try:
        fp8_gemv(torch.randn(5, 400).to(torch.bfloat16), layer.weight, layer.weight_scale, None, None, gated=True)
    except ValueError:
        pass
    else:
        raise AssertionError("the gated GEMV accepted 5 rows")


def check_layer_and_errors() -> None:
    # gemv_linear (what fp8_linear runs on CUDA) keeps leading dimensions; bad inputs are refused.
    layer = module(40, 64, None, bias=True, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    torch.testing.assert_close(gemv_linear(x, layer).float(), weight_only_linear(x, layer).float(), **REFERENCE_TOL)
    for bad in (torch.randn(65, 64).to(torch.bfloat16), torch.randn(2, 64)):
        try:
            fp8_gemv(bad, layer.weight, layer.weight_scale, None, None)
        except ValueError:
            continue
        raise AssertionError(f"fp8_gemv accepted x {tuple(bad.shape)} {bad.dtype}")


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    check_default_configs(QUICK_CASES if quick else CASES)
    check_picked_configs()
    check_gated(QUICK_GATED_CASES if quick else GATED_CASES)
    if not quick:
        check_configs()
        check_layer_and_errors()
    print("fp8 gemv ok")
