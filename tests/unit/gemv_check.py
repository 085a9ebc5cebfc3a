"""Checks of the small-M GEMV kernel (mstar/kernels/gemv.py) and the fused SiLU-and-mul down projection
against PyTorch; run with TRITON_INTERPRET=1 by test_gemv_interpreted.py, in a fresh process so the
interpreter setting holds for every kernel."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from mstar.kernels import fused_ops, gemv, skinny_gemm
from mstar.kernels.skinny_gemm import SkinnyConfig, pick_config, skinny_linear, skinny_silu_and_mul_linear
from mstar.kernels.timing import MAX_COPIES, graph_time_us, weight_copies
from mstar.layers.fused import FUSED, fused_kernels
from mstar.layers.linear import SKINNY
from mstar.layers.mlp import GatedMLP


def tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


# (M, BLOCK_K, SPLIT_K): N and K not multiples of the blocks (ragged last split), M = 1..4, split on/off, x read
# once per thread (BLOCK_K spans the warps: 1024) or through weight-shaped pointers (32)
GEMV_CASES = [(1, 32, 1), (1, 1024, 1), (2, 64, 2), (3, 32, 3), (4, 1024, 1), (4, 32, 3)]


def check_gemv(dtype: torch.dtype, cases=GEMV_CASES) -> None:
    # with and without bias (every other case)
    for i, (m, block_k, split) in enumerate(cases):
        x, w, b = torch.randn(m, 200).to(dtype), (torch.randn(37, 200) / 14).to(dtype), torch.randn(37).to(dtype)
        cfg = SkinnyConfig(block_m=skinny_gemm.m_bucket(m), block_n=8, block_k=block_k, split_k=split)
        assert not cfg.use_dot
        got = skinny_linear(x, w, b, config=cfg)
        torch.testing.assert_close(got, reference(x, w, b), **tol(dtype))
        assert torch.equal(got, skinny_linear(x, w, b, config=cfg)), f"not reproducible: {cfg}"
        if i % 2 == 0:
            torch.testing.assert_close(skinny_linear(x, w, config=cfg), reference(x, w, None), **tol(dtype))
    # Every split-K launch leaves its per-tile counters at zero, ready for the next launch or graph replay.
    locks = [buf for (kind, *_), buf in gemv._BUFFERS.items() if kind == "lock"]
    assert locks and all(int(buf.abs().sum()) == 0 for buf in locks), "split-K counters were not reset"


def check_fold_k(dtype: torch.dtype) -> None:
    # fold_k sums each thread's neighbouring K products every chunk: the same values as fold_k=1 up to
    # summation order, for the plain and SiLU-and-mul GEMVs, split or not, ragged K.
    x, w, b = torch.randn(4, 200).to(dtype), (torch.randn(37, 200) / 14).to(dtype), torch.randn(37).to(dtype)
    gate_up = (torch.randn(3, 400) * 2).to(dtype)
    for m, block_k, split, fold in ((4, 64, 1, 8), (3, 32, 3, 4), (1, 1024, 1, 8), (2, 64, 2, 2)):
        plain = SkinnyConfig(block_m=skinny_gemm.m_bucket(m), block_n=8, block_k=block_k, split_k=split)
        folded = SkinnyConfig(block_m=plain.block_m, block_n=8, block_k=block_k, split_k=split, fold_k=fold)
        got = skinny_linear(x[:m], w, b, config=folded)
        torch.testing.assert_close(got, reference(x[:m], w, b), **tol(dtype))
        torch.testing.assert_close(got, skinny_linear(x[:m], w, b, config=plain), **tol(dtype))
        assert torch.equal(got, skinny_linear(x[:m], w, b, config=folded)), f"not reproducible: {folded}"
        if m <= 3:
            torch.testing.assert_close(skinny_silu_and_mul_linear(gate_up[:m], w, b, config=folded),
                                       skinny_silu_and_mul_linear(gate_up[:m], w, b, config=plain), **tol(dtype))


def check_default_configs(dtype: torch.dtype) -> None:
    # The heuristic sends M <= 4 to the GEMV kernel and M = 8 to tl.dot.
    for m in (1, 4):
        cfg = pick_config(m, 48, 256)
        assert not cfg.use_dot and cfg.block_m == m, cfg
        x, w = torch.randn(m, 256).to(dtype), (torch.randn(48, 256) / 16).to(dtype)
        torch.testing.assert_close(skinny_linear(x, w), reference(x, w, None), **tol(dtype))
    assert pick_config(8, 48, 256).use_dot
    # Few rows of W and a long K: split; many rows: not; more rows of x, fewer of W per program.
    assert pick_config(1, 64, 8192).split_k > 1 and pick_config(1, 64 * 1024, 1024).split_k == 1
    assert pick_config(1, 3008, 3072).block_n > pick_config(4, 3008, 3072).block_n  # a shape not in TUNED


def check_config_validation() -> None:
    for block_m in (3, 8):
        try:
            SkinnyConfig(block_m=block_m, block_n=4, block_k=32)
        except ValueError as err:
            assert f"block_m={block_m}" in str(err), err
        else:
            raise AssertionError(f"block_m={block_m} fits neither kernel and must be refused")
    for bad in (dict(block_m=4, block_k=32, fold_k=3), dict(block_m=4, block_k=4, fold_k=8),
                dict(block_m=16, block_k=64, fold_k=2)):
        try:
            SkinnyConfig(block_n=4, **bad)
        except ValueError as err:
            assert "fold_k" in str(err), err
        else:
            raise AssertionError(f"{bad} must be refused")


def check_silu_down(dtype: torch.dtype, rows=(1, 3)) -> None:
    for m in rows:
        gate_up = (torch.randn(m, 2 * 160) * 2).to(dtype)
        w, b = (torch.randn(24, 160) / 12).to(dtype), torch.randn(24).to(dtype)
        act = fused_ops.silu_and_mul(gate_up)
        # PyTorch in fp32: the kernel's bf16 rounding of the activation is within the tolerance.
        torch_act = F.silu(gate_up[:, :160].float()) * gate_up[:, 160:].float()
        for block_k, split in ((64, 1), (64, 2), (1024, 1)):
            cfg = SkinnyConfig(block_m=4, block_n=8, block_k=block_k, split_k=split)
            got = skinny_silu_and_mul_linear(gate_up, w, b, config=cfg)
            torch.testing.assert_close(got.float(), F.linear(torch_act, w.float(), b.float()), **tol(dtype))
            # Same activation rounding as the SiLU kernel + GEMV it replaces: only summation order differs.
            torch.testing.assert_close(got, skinny_linear(act, w, b, config=cfg), atol=1e-5, rtol=1e-5)
    try:
        skinny_silu_and_mul_linear(torch.randn(16, 64).to(dtype), torch.randn(8, 32).to(dtype))
    except ValueError as err:
        assert "1..4 rows" in str(err), err
    else:
        raise AssertionError("16 rows must be refused by the fused GEMV")


def check_mlp_selection(dtype: torch.dtype) -> None:
    mlp = GatedMLP(32, 48, bias=True).to(dtype)
    x = torch.randn(3, 32).to(dtype)
    calls: list[str] = []
    fused, linear_ = skinny_gemm.skinny_silu_and_mul_linear, skinny_gemm.skinny_linear
    skinny_gemm.skinny_silu_and_mul_linear = lambda *a, **kw: calls.append("fused") or fused(*a, **kw)
    skinny_gemm.skinny_linear = lambda *a, **kw: calls.append("linear") or linear_(*a, **kw)
    SKINNY.force = True
    try:
        got = mlp(x)
        mlp(torch.randn(12, 32).to(dtype))  # 12 rows: gate_up and down through the tl.dot kernel, no fusion
    finally:
        skinny_gemm.skinny_silu_and_mul_linear, skinny_gemm.skinny_linear = fused, linear_
        SKINNY.force = None
    assert calls == ["linear", "fused", "linear", "linear"], calls
    with fused_kernels(False):
        want = mlp(x)  # the PyTorch reference path
    torch.testing.assert_close(got, want, **tol(dtype))


def check_timing_helper() -> None:
    # Enough copies to read >= 2 x L2 per round; one when the weight alone is that large.
    assert weight_copies(31 << 20, 50 << 20) == 4 and weight_copies(200 << 20, 50 << 20) == 1
    # A tiny weight (16 KB) would need 6400 copies and as many launches: capped.
    assert weight_copies(16 << 10, 50 << 20) == MAX_COPIES == 64
    try:
        graph_time_us(lambda w: w, torch.zeros(4))
    except ValueError as err:
        assert "CUDA" in str(err), err
    else:
        raise AssertionError("graph_time_us must refuse CPU tensors")


if __name__ == "__main__":
    assert FUSED.ops_for(torch.zeros(1)) is not None, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    if "--quick" in sys.argv:  # one representative of each kernel, split and not (the default test run)
        check_gemv(torch.float32, [GEMV_CASES[1], GEMV_CASES[5]])
        check_silu_down(torch.float32, rows=(3,))
        print("gemv ok")
        sys.exit(0)
    for dt in (torch.float32, torch.bfloat16):
        check_gemv(dt)
        check_fold_k(dt)
        check_default_configs(dt)
        check_silu_down(dt)
        check_mlp_selection(dt)
    check_timing_helper()
    check_config_validation()
    print("gemv ok")
