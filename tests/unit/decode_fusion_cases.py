"""Checks of the decode fusions against the unfused kernels; run with TRITON_INTERPRET=1 by
test_decode_fusions.py (a fresh process: triton reads that variable when kernels are decorated).

- RoPE inside decode attention (`forward_rotary`) equals fused_ops.rotary + decode attention, bit for bit;
- the in-kernel split merge (`fuse_reduce`) equals the reduce kernel to rounding, leaves its counters at zero;
- skinny_norm_linear equals fused_ops.rms_norm + skinny_linear (M = 1..4, residual or not, split-K);
- a tiny Llama decodes the same greedy tokens with every fusion on as with none.
Prints one line per check and "decode fusions ok" at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from paged_attention_cases import Shape, _fix_interpreter_scalars, make_pair, random_batch  # noqa: E402

from mstar.kernels import fused_ops  # noqa: E402
from mstar.layers.rope import RopeSpec, RotaryEmbedding  # noqa: E402


def decode_inputs(shape: Shape, seq_lens: list[int], pad_to: int | None, seed: int, device: str = "cpu"):
    """(meta, q, k, v, cos, sin) of a decode batch padded to `pad_to` rows; q/k not yet rotated."""
    meta, q, k, v = random_batch(shape, seq_lens, [1] * len(seq_lens), device, seed=seed)
    rows = pad_to or len(seq_lens)
    g = torch.Generator().manual_seed(seed + 1)
    pad = [torch.randn(rows - q.shape[0], *x.shape[1:], generator=g).to(x) for x in (q, k, v)]
    q, k, v = (torch.cat([x, p]) for x, p in zip((q, k, v), pad))
    positions = torch.tensor([s - 1 for s in seq_lens] + [0] * (rows - len(seq_lens)), device=device)
    cos, sin = RotaryEmbedding(RopeSpec(head_dim=shape.head_dim)).to(device)(positions)
    return meta, q, k, v, cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary kernel the fusion replaces; for halves that are not a power of two (which it cannot
    take) the PyTorch rotation of mstar.layers.rope.apply_rotary, used in float32 only."""
    half = x.shape[-1] // 2
    if half & (half - 1) == 0:
        return fused_ops.rotary(x, cos, sin)
    assert x.dtype == torch.float32, "CPU torch rounds bf16 products differently from the kernels"
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def check_attention(shape: Shape, seq_lens: list[int], pad_to: int | None = None, num_sms: int | None = 64,
                    steps: int = 1, device: str = "cpu") -> None:
    """Fused variants against rotary kernel + unfused decode attention, on `steps` consecutive batches."""
    backends = {}
    for name, (rope, reduce) in {"ref": (False, False), "rope": (True, False), "both": (True, True)}.items():
        _, tri = make_pair(shape, device, num_sms=num_sms)
        tri.fuse_rotary, tri.fuse_reduce = rope, reduce
        backends[name] = tri
    splits = None
    for step, lens in enumerate((seq_lens, [s + 7 for s in seq_lens])[:steps]):  # counters must be reusable
        meta, q, k, v, cos, sin = decode_inputs(shape, lens, pad_to, 3 + step, device)
        outs = {}
        for name, tri in backends.items():
            tri.prepare(meta, pad_to=pad_to)
            if tri.fuse_rotary:
                assert tri.fuses_rotary
                outs[name] = tri.forward_rotary(1, q, k, v, cos, sin)
            else:
                outs[name] = tri.forward(1, rotate(q, cos, sin), rotate(k, cos, sin), v)
        from mstar.kernels.decode_attention import decode_num_splits

        splits = decode_num_splits(tri.num_rows, shape.hkv, tri.num_sms, shape.max_pages_per_seq * shape.page_size)
        ref = outs["ref"].float()
        rope_err = (outs["rope"].float() - ref).abs().max().item()
        if shape.dtype == torch.float32 and device != "cpu":
            # the GPU compiler may contract the rotation's multiply-adds into FMAs in one kernel and not
            # the other: a last-bit difference in float32 (seen: 6e-8), which bf16's rounding hides
            assert rope_err <= 1e-6 * max(1.0, ref.abs().max().item()), (shape, rope_err)
        else:
            assert torch.equal(outs["rope"], outs["ref"]), (shape, rope_err)
        tol = 1e-5 if shape.dtype == torch.float32 else 1.6e-2  # bf16: one rounding of the output
        err = (outs["both"].float() - ref).abs().max().item()
        assert err <= tol * max(1.0, ref.abs().max().item()), (shape, splits, err)
        for name, tri in backends.items():
            assert torch.equal(tri.k_cache, backends["ref"].k_cache), f"{name}: k cache differs"
            assert torch.equal(tri.v_cache, backends["ref"].v_cache), f"{name}: v cache differs"
            assert int(tri._lock.abs().sum()) == 0, f"{name}: split counters not reset"
        if pad_to:
            assert outs["both"][len(lens):].abs().max() == 0, "padded rows must give zeros"
    print(f"attention {shape.hq}/{shape.hkv}x{shape.head_dim} page {shape.page_size} {shape.dtype} "
          f"splits {splits}: ok")


def check_norm_gemv(dtype: torch.dtype) -> None:
    """skinny_norm_linear against rms_norm + skinny_linear with the same GEMV config."""
    from mstar.kernels.skinny_gemm import SkinnyConfig, m_bucket, skinny_linear, skinny_norm_linear

    k, n = 200, 21
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    # (M, BLOCK_K, SPLIT_K): ragged K, x through weight-shaped pointers (32, 64) or broadcast (1024), split-K
    cases = [(1, 32, 1), (2, 64, 2), (3, 1024, 1), (4, 32, 3), (4, 64, 1)]
    for i, (m, block_k, split) in enumerate(cases):
        x, r = torch.randn(m, k).to(dtype), torch.randn(m, k).to(dtype)
        nw, w = (1 + torch.randn(k) / 4).to(dtype), (torch.randn(n, k) / 14).to(dtype)
        b = torch.randn(n).to(dtype) if i % 2 else None
        residual = r if i % 3 != 2 else None
        cfg = SkinnyConfig(block_m=m_bucket(m), block_n=8, block_k=block_k, split_k=split)
        got, summed = skinny_norm_linear(x, nw, 1e-5, w, b, residual, config=cfg)
        normed, want_sum = fused_ops.rms_norm(x, nw, 1e-5, residual)
        want = skinny_linear(normed, w, b, config=cfg)
        torch.testing.assert_close(got, want, **tol)
        if residual is None:
            assert summed is None
        else:
            assert torch.equal(summed, want_sum), "x + residual must be written exactly"
        assert torch.equal(got, skinny_norm_linear(x, nw, 1e-5, w, b, residual, config=cfg)[0]), "not reproducible"
    print(f"norm gemv {dtype}: ok")


def check_norm_selection(dtype: torch.dtype) -> None:
    """linear(PendingNorm) runs the fused GEMV when allowed (forced) and materialises the norm otherwise."""
    from mstar.kernels import skinny_gemm
    from mstar.layers.linear import SKINNY, linear
    from mstar.layers.norm import PendingNorm, RMSNorm

    norm, proj = RMSNorm(48, 1e-6).to(dtype), torch.nn.Linear(48, 24).to(dtype)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    x, r = torch.randn(3, 48).to(dtype), torch.randn(3, 48).to(dtype)
    calls: list[str] = []
    original = skinny_gemm.skinny_norm_linear
    skinny_gemm.skinny_norm_linear = lambda *a, **kw: calls.append("fused") or original(*a, **kw)
    try:
        results = {}
        for force in (True, False):
            SKINNY.force = force
            pending = PendingNorm(norm, x, r)
            results[force] = (linear(pending, proj), pending.summed())
        SKINNY.force = True
        wide = PendingNorm(norm, torch.randn(6, 48).to(dtype), None)  # 6 rows: past the GEMV, norm first
        linear(wide, proj)
    finally:
        skinny_gemm.skinny_norm_linear = original
        SKINNY.force = None
    assert calls == ["fused"], calls
    assert torch.equal(results[True][1], results[False][1])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(results[True][0], results[False][0], atol=tol, rtol=tol)
    print(f"norm selection {dtype}: ok")


if __name__ == "__main__":
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    _fix_interpreter_scalars()
    torch.manual_seed(0)
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which in ("all", "attention"):
        check_attention(Shape(hq=4, hkv=1, page_size=4), [5, 37, 90], steps=2)  # GQA 4, several splits
        check_attention(Shape(hq=6, hkv=2, page_size=16), [1, 40], pad_to=3, num_sms=16)  # groups of 3, padded
        check_attention(Shape(hq=2, hkv=2, head_dim=24, page_size=4), [9, 60], num_sms=1)  # MHA, 1 split
        check_attention(Shape(hq=4, hkv=2, dtype=torch.bfloat16, page_size=8), [3, 70])
    if which in ("all", "gemv"):
        for dt in (torch.float32, torch.bfloat16):
            check_norm_gemv(dt)
            check_norm_selection(dt)
    print("decode fusions ok")
