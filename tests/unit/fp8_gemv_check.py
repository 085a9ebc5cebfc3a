"""Checks of the FP8-weight GEMV (mstar/kernels/fp8_gemv.py) against the dequantize-then-linear references
of layers/fp8.py; run with TRITON_INTERPRET=1 by test_fp8_gemv_interpreted.py, in a fresh process so the
interpreter setting holds for every kernel."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from mstar.kernels import fused_ops, skinny_gemm
from mstar.kernels.fp8_gemv import fp8_gemv, fp8_skinny_linear, pick_fp8_config, pick_skinny_config
from mstar.kernels.skinny_gemm import SkinnyConfig, pick_config
from mstar.layers.fp8 import (
    Fp8Linear,
    dequantize,
    gemv_linear,
    silu_and_mul_gemv_linear,
    skinny_dot_linear,
    weight_only_linear,
)
from mstar.layers.linear import FP8_KERNELS, fp8_candidates

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


# (rows, N, K, block): fp8_skinny_linear, the skinny GEMM's tl.dot kernel on E4M3 weights at the bf16
# configs, from 1 to 64 rows; N and K off the tiles; K split (ragged last split) or not; block scales whose
# columns are narrower than the picked BLOCK_K
SKINNY_CASES = [(1, 37, 200, None), (3, 300, 520, (128, 128)), (8, 64, 1000, None), (16, 40, 384, (16, 32)),
                (33, 70, 200, None), (64, 24, 256, None)]
QUICK_SKINNY_CASES = [SKINNY_CASES[1], SKINNY_CASES[2]]


def check_skinny(cases=SKINNY_CASES) -> None:
    for i, (m, n, k, block) in enumerate(cases):
        for bias in (True, False):
            layer = module(n, k, block, bias=bias, dtype=torch.bfloat16, seed=i)
            x = torch.randn(m, k).to(torch.bfloat16)
            cfg = pick_skinny_config(m, n, k, block)
            assert cfg.use_dot and (block is None or block[1] % cfg.block_k == 0), cfg
            check(x, layer, cfg)
            got = fp8_skinny_linear(x, layer.weight, layer.weight_scale, layer.bias, block)
            assert torch.equal(got, fp8_gemv(x, layer.weight, layer.weight_scale, layer.bias, block, config=cfg))
            assert torch.equal(skinny_dot_linear(x[None], layer)[0], got)  # the layer path, leading dims kept


def check_skinny_split_k() -> None:
    # K split into a workspace summed in a fixed order: each split's sum scaled per channel, or each chunk per
    # block; the same as unsplit up to fp32 summation, and the same bits on every call.
    skinny_gemm._WORKSPACES.clear()
    for block, cfg in ((None, SkinnyConfig(16, 16, 64, split_k=4)), ((16, 32), SkinnyConfig(32, 32, 32, split_k=3))):
        layer = module(40, 300, block, bias=True, dtype=torch.bfloat16)
        x = torch.randn(12, 300).to(torch.bfloat16)
        check(x, layer, cfg)
    assert skinny_gemm._WORKSPACES, "split-K did not use the workspace"


def check_split_past_k_block_scales() -> None:
    # K = 300 in 3 splits of 128 leaves whole 32-wide chunks past K in the last split: their (zero) products
    # must not be scaled by memory past the scale tensor (here inf, so a read past it gives NaN).
    layer = module(40, 300, (16, 32), bias=False, dtype=torch.bfloat16)
    s = layer.weight_scale
    padded = torch.full((s.numel() + 64,), float("inf"))
    padded[: s.numel()] = s.reshape(-1)
    scale = padded[: s.numel()].view(s.shape)
    x = torch.randn(12, 300).to(torch.bfloat16)
    got = fp8_gemv(x, layer.weight, scale, None, (16, 32), config=SkinnyConfig(32, 32, 32, split_k=3))
    torch.testing.assert_close(got, exact(x, layer), **EXACT_TOL[x.dtype])


def check_picked_skinny_configs() -> None:
    # The bf16 configs (tuned at the Orpheus-3B shapes) with the 8-row one below 5 rows; block scales narrow
    # BLOCK_K to one block column and keep the rest.
    for n, k in ((5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192), (28680, 3072)):
        for m in (1, 4, 8, 16, 64):
            assert pick_skinny_config(m, n, k, None) == pick_config(max(m, 5), n, k), (m, n, k)
            blocks = pick_skinny_config(m, n, k, (128, 128))
            assert 128 % blocks.block_k == 0 and blocks.split_k == pick_config(max(m, 5), n, k).split_k


def check_timed_candidates() -> None:
    # What `SKINNY.fp8_kernel` times (no `_scaled_mm` on CPU) computes the layer, and the path `linear` then
    # takes for each name runs the same kernel.
    for block in (None, (16, 32)):
        layer = module(40, 96, block, bias=True, dtype=torch.bfloat16)
        x = torch.randn(6, 96).to(torch.bfloat16)
        candidates = fp8_candidates(x, layer)
        assert set(candidates) == {"gemv", "skinny_dot"} <= set(FP8_KERNELS), candidates
        for name, run in candidates.items():
            got = run(x, layer.weight)
            torch.testing.assert_close(got, exact(x, layer), **EXACT_TOL[x.dtype])
            assert torch.equal(got, FP8_KERNELS[name](x, layer)), name


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
    check_skinny(QUICK_SKINNY_CASES if quick else SKINNY_CASES)
    check_picked_skinny_configs()
    check_timed_candidates()
    check_split_past_k_block_scales()
    if not quick:
        check_configs()
        check_layer_and_errors()
        check_skinny_split_k()
    print("fp8 gemv ok")
