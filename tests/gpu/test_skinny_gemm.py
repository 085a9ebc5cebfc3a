"""The skinny-GEMM kernel on the GPU: bf16 equals F.linear at the decode shapes of a 3B Llama, split-K
is reproducible, a CUDA-graph replay equals eager, and the selection layer decides once per shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.kernels.skinny_gemm import SkinnyConfig, pick_config, skinny_linear
from mstar.layers.linear import SKINNY, linear

# (N, K): qkv, o_proj, gate_up, down, lm_head of the Orpheus/Llama-3.2-3B shape.
SHAPES = [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192), (156940, 3072)]


def _inputs(m: int, n: int, k: int, bias: bool = False):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    torch.cuda.synchronize()  # weights complete before a GEMV reads them ahead of its PDL wait (kernels/pdl.py)
    return x, w, b


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 16, 33, 64])
def test_matches_f_linear_bf16(m, n, k):
    x, w, _ = _inputs(m, n, k)
    want = F.linear(x.float(), w.float())
    got = skinny_linear(x, w)
    # bf16 output rounding (2^-8 relative) on values of order 1, plus summation-order differences.
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=1.6e-2)


@pytest.mark.parametrize("m", [1, 4, 16])
def test_bias_and_forced_split_k_reproducible(m):
    x, w, b = _inputs(m, 3072, 8192, bias=True)
    want = F.linear(x.float(), w.float(), b.float())
    cfg = pick_config(m, 3072, 8192)
    forced = SkinnyConfig(cfg.block_m, cfg.block_n, cfg.block_k, split_k=8, num_warps=cfg.num_warps)
    got = skinny_linear(x, w, b, config=forced)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=1.6e-2)
    assert torch.equal(got, skinny_linear(x, w, b, config=forced))


@pytest.mark.parametrize("n,k", [(5120, 3072), (3072, 8192), (16384, 3072)])
def test_graph_replay_equals_eager(n, k):
    x, w, _ = _inputs(8, n, k)
    static_x = x.clone()
    eager = skinny_linear(static_x, w)  # warm-up: compile and workspace allocation outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = skinny_linear(static_x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    new_x, _, _ = _inputs(8, n, k + 1)
    static_x.copy_(new_x[:, :k])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, skinny_linear(static_x, w))


def test_selection_decides_once_and_matches():
    layer = torch.nn.Linear(3072, 5120, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 3072, device="cuda", dtype=torch.bfloat16)
    saved = dict(SKINNY.decisions)
    SKINNY.decisions.clear()  # earlier tests may have decided this shape already
    SKINNY.force, before = None, 0
    try:
        got = linear(x, layer)
        assert len(SKINNY.decisions) == before + 1
        linear(torch.randn(2, 3072, device="cuda", dtype=torch.bfloat16), layer)  # same bucket: no new decision
        assert len(SKINNY.decisions) == before + 1
    finally:
        SKINNY.force = None
        SKINNY.decisions.update(saved)
    torch.testing.assert_close(got.float(), F.linear(x, layer.weight).float(), atol=3e-2, rtol=1.6e-2)
