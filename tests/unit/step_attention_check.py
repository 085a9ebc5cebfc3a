"""Checks of the one-step attention kernel (`models/qwen3_omni/step_attention.py`) against the code predictor's
PyTorch step (qk-norm rotary, cache copies, SDPA); run with TRITON_INTERPRET=1 (by
test_step_attention.py, in a fresh process so the interpreter setting holds for every kernel)."""

from __future__ import annotations

import sys

import torch

from mstar.layers.fused import FUSED, fused_kernels
from mstar.layers.rope import RopeSpec, RotaryEmbedding
from mstar.models.qwen3_omni.code_predictor import _Attention
from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
from mstar.models.qwen3_omni.step_attention import step_attention, supports


def check(dtype: torch.dtype, num_heads: int, num_kv: int, head_dim: int, batch: int = 3, groups: int = 16) -> None:
    cfg = CodePredictorConfig.tiny(num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim, num_code_groups=groups)
    layer = _Attention(cfg).to(dtype)
    torch.nn.init.normal_(layer.q_norm.weight, 1.0, 0.3)
    torch.nn.init.normal_(layer.k_norm.weight, 1.0, 0.3)  # differs from q's, so a swapped weight shows
    cos, sin = RotaryEmbedding(RopeSpec(head_dim=head_dim, theta=10000.0))(torch.arange(groups))
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim)
    shape = (batch, num_kv, groups, head_dim)
    keys = torch.randn(shape, generator=gen).to(dtype)
    values = torch.randn(shape, generator=gen).to(dtype)
    want_keys, want_values = keys.clone(), values.clone()
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    for start in sorted({s for s in (1, 2, 7, groups - 1) if s < groups}):
        heads = (torch.randn(batch, num_heads + 2 * num_kv, head_dim, generator=gen) * 2).to(dtype)
        rows_cos, rows_sin = cos[start:start + 1].expand(batch, -1), sin[start:start + 1].expand(batch, -1)
        got = step_attention(heads, layer.q_norm.weight, layer.k_norm.weight, rows_cos[0], rows_sin[0], keys, values,
                             start, num_heads, layer.q_norm.eps)
        with fused_kernels(False):
            want = layer._one_token(heads, rows_cos, rows_sin, (want_keys, want_values), start)
        # the cache write is exact: the same roundings as qk_norm_rotary (k) and a copy (v)
        torch.testing.assert_close(keys, want_keys, atol=tol if dtype != torch.float32 else 1e-6, rtol=0)
        assert torch.equal(values, want_values)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        # the layer takes the kernel on its own (fused kernels on) and agrees with it
        again = layer._one_token(heads, rows_cos, rows_sin, (keys.clone(), values.clone()), start)
        assert torch.equal(again, got)


if __name__ == "__main__":
    assert FUSED.ops_for(torch.zeros(1)) is not None, "run with TRITON_INTERPRET=1"
    assert supports(16, 8, 128, 16) and not supports(12, 4, 128, 16)  # 3 query heads a kv head: PyTorch
    if "--quick" in sys.argv:  # one representative shape (the default test run)
        check(torch.float32, num_heads=4, num_kv=2, head_dim=8)
        print("step attention ok")
        sys.exit(0)
    for dt in (torch.float32, torch.float16):
        check(dt, num_heads=4, num_kv=2, head_dim=8)
        check(dt, num_heads=4, num_kv=4, head_dim=16, batch=2)  # one query head a kv head
    check(torch.float32, num_heads=8, num_kv=2, head_dim=32, groups=5)  # a cache shorter than a power of 2
    print("step attention ok")
