"""Checks of the skinny-GEMM Triton kernel against F.linear; run with TRITON_INTERPRET=1 (by
test_skinny_gemm.py, in a fresh process so the interpreter setting holds for every kernel)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from mstar.kernels import gemv, skinny_gemm
from mstar.kernels.skinny_gemm import SkinnyConfig, pick_config, skinny_linear
from mstar.layers.fused import FUSED, fused_kernels
from mstar.layers.linear import SKINNY, linear, linear_weight
from mstar.layers.mlp import GatedMLP


def tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}


def check_against_torch(dtype: torch.dtype, rows=(1, 3, 16), sizes=((40, 48), (33, 200), (17, 512))) -> None:
    # N, K not multiples of the blocks; M on both paths (broadcast for M <= 4, tl.dot above).
    for m in rows:
        for n, k in sizes:
            x, w = torch.randn(m, k).to(dtype), (torch.randn(n, k) / k**0.5).to(dtype)
            b = torch.randn(n).to(dtype)
            want_b = F.linear(x.float(), w.float(), b.float()).to(dtype)
            torch.testing.assert_close(skinny_linear(x, w, b), want_b, **tol(dtype))
            torch.testing.assert_close(skinny_linear(x, w), F.linear(x.float(), w.float()).to(dtype), **tol(dtype))


def check_split_k(dtype: torch.dtype) -> None:
    # Forced split-K (ragged last split) equals the unsplit result and is bit-identical across calls.
    for m, block_m in ((2, 2), (5, 16)):
        x, w, b = torch.randn(m, 300).to(dtype), (torch.randn(24, 300) / 17).to(dtype), torch.randn(24).to(dtype)
        split = SkinnyConfig(block_m=block_m, block_n=16, block_k=32, split_k=4)
        got = skinny_linear(x, w, b, config=split)
        buffers = skinny_gemm._WORKSPACES if split.use_dot else gemv._BUFFERS
        assert buffers, "split-K path did not use the workspace"
        torch.testing.assert_close(got, F.linear(x.float(), w.float(), b.float()).to(dtype), **tol(dtype))
        assert torch.equal(got, skinny_linear(x, w, b, config=split)), "split-K is not deterministic"
    # The heuristic splits K for a shape with few N blocks and a long K.
    assert pick_config(1, 64, 8192).split_k > 1 and pick_config(1, 64 * 1024, 1024).split_k == 1


def check_strided_rows(dtype: torch.dtype) -> None:
    x = torch.randn(3, 96).to(dtype)[:, :64]  # row stride 96, unit K stride
    w = torch.randn(20, 64).to(dtype)
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x.float(), w.float()).to(dtype), **tol(dtype))


def check_selection(dtype: torch.dtype) -> None:
    # 12 rows: both projections through skinny_linear (up to 8 rows, gemv_check covers the fused down).
    mlp = GatedMLP(32, 48).to(dtype)
    x = torch.randn(12, 32).to(dtype)
    SKINNY.force = True
    got = mlp(x)
    calls = []
    original = skinny_gemm.skinny_linear
    skinny_gemm.skinny_linear = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    try:
        mlp(x)
        linear(torch.randn(SKINNY.max_m + 1, 32).to(dtype), mlp.gate_up_proj)  # too many rows: F.linear
    finally:
        skinny_gemm.skinny_linear = original
    assert len(calls) == 2, f"expected gate_up and down through skinny_linear, saw {len(calls)} calls"
    SKINNY.force = None
    with fused_kernels(False):
        want = mlp(x)
    torch.testing.assert_close(got, want, **tol(dtype))


def check_row_slice(dtype: torch.dtype) -> None:
    # A contiguous row slice of a head (a view at a storage offset, as `SpanHeadLM` reads it)
    # goes through skinny_linear and equals F.linear on those rows.
    head = (torch.randn(300, 64) / 8).to(dtype)
    rows = head[37:229]
    x = torch.randn(2, 64).to(dtype)
    calls = []
    original = skinny_gemm.skinny_linear
    skinny_gemm.skinny_linear = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    SKINNY.force = True
    try:
        got = linear_weight(x, rows)
    finally:
        SKINNY.force, skinny_gemm.skinny_linear = None, original
    assert calls == [1], "the row slice did not go through skinny_linear"
    torch.testing.assert_close(got, F.linear(x.float(), rows.float()).to(dtype), **tol(dtype))


class _Echo:
    """An attention stub that returns q, so the layer's output goes through qkv_proj and o_proj only."""

    def forward(self, layer, q, k, v):
        return q


def check_attention_projections(dtype: torch.dtype) -> None:
    from mstar.layers.attention import AttentionSpec, SelfAttention
    from mstar.layers.rope import RopeSpec, RotaryEmbedding

    layer = SelfAttention(AttentionSpec(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=16, o_bias=True), 0)
    layer = layer.to(dtype)
    cos, sin = RotaryEmbedding(RopeSpec(head_dim=16))(torch.tensor([0, 5]))
    x = torch.randn(2, 32).to(dtype)
    SKINNY.force = True
    try:
        got = layer(x, cos, sin, _Echo())
    finally:
        SKINNY.force = False
    try:
        want = layer(x, cos, sin, _Echo())
    finally:
        SKINNY.force = None
    torch.testing.assert_close(got, want, **tol(dtype))


if __name__ == "__main__":
    assert FUSED.ops_for(torch.zeros(1)) is not None, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    quick = "--quick" in sys.argv  # float32, one (N, K) on each path (the default test run)
    for dt in (torch.float32,) if quick else (torch.float32, torch.float16):
        if quick:
            check_against_torch(dt, rows=(1, 16), sizes=((33, 200),))
        else:
            check_against_torch(dt)
        check_split_k(dt)
        check_strided_rows(dt)
        check_row_slice(dt)
        check_selection(dt)
        check_attention_projections(dt)
    print("skinny gemm ok")
