"""The decode GEMV compiled offline for sm_90a (triton's bundled ptxas, no GPU): folding keeps its
reduction inside each thread, so at 4 rows the accumulators take fewer registers, with 16-byte loads; the
skinny GEMM's tl.dot kernel takes E4M3 weights into bf16 MMAs."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("triton")


def test_fold_k_cuts_the_four_row_gemv_registers():
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    from benchmarks.kernel_registers import compile_report

    plain, folded = compile_report(4, 4, 1024, 4, 1), compile_report(4, 4, 1024, 4, 8)
    for row in (plain, folded):
        assert row["spill_bytes"] == 0 and row["loads"] == ["ld.global.v4.b32"], row
    # the fold adds no shuffles (it sums each thread's own 8 products) and frees registers
    assert folded["shuffles"] == plain["shuffles"], (plain, folded)
    assert folded["registers"] < plain["registers"] - 32, (plain["registers"], folded["registers"])


def test_the_fp8_gemv_streams_its_weight_without_shuffles_in_the_k_loop():
    """The FP8 GEMV at the configs pick_fp8_config gives decode (M = 1 and 4, Orpheus-3B qkv): 8-byte weight
    loads share x's register layout, so no tile goes through shared memory on every K chunk, and nothing
    spills."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    from benchmarks.kernel_registers import compile_report
    from mstar.kernels.fp8_gemv import pick_fp8_config

    for m in (1, 4):
        cfg = pick_fp8_config(m, 5120, 3072, None)
        row = compile_report(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.fold_k,
                             stages=cfg.num_stages, fp8=True)
        assert row["spill_bytes"] == 0 and row["loop_layout_conversions"] == 0, row
        assert "ld.global.v2.b32" in row["loads"], row


def test_the_skinny_gemm_takes_e4m3_weights_into_bf16_mmas():
    """The skinny GEMM's tl.dot kernel on E4M3 weights at the configs pick_skinny_config gives (Orpheus-3B qkv,
    8 / 16 / 64 rows, per channel and 128x128 blocks): the weight tiles stream through cp.async, the MMAs take
    bf16 operands (the weight converted in registers, the activations as they are), and nothing spills."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    from benchmarks.kernel_registers import skinny_report
    from mstar.kernels.fp8_gemv import pick_skinny_config

    for m, block in ((8, None), (16, (128, 128)), (64, None)):
        cfg = pick_skinny_config(m, 5120, 3072, block)
        row = skinny_report(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, split=cfg.split_k,
                            fp8=True, block=block)
        assert row["spill_bytes"] == 0 and "cp.async.cg.shared.global" in row["loads"], row
        assert row["mma"] and all(".bf16.bf16" in op for op in row["mma"]), row
