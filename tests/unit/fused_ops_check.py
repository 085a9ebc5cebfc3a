"""Checks of the fused Triton kernels against the PyTorch layers; run with TRITON_INTERPRET=1 (by
test_fused_ops.py, in a fresh process so the interpreter setting holds for every kernel)."""

from __future__ import annotations

import sys

import torch

from mstar.kernels import fused_ops
from mstar.layers.fused import FUSED, fused_kernels
from mstar.layers.mlp import GatedMLP
from mstar.layers.norm import RMSNorm
from mstar.layers.rope import RopeSpec, RotaryEmbedding, apply_rotary


def reference(fn):
    with fused_kernels(False):
        return fn()


def check_rms_norm(dtype: torch.dtype) -> None:
    norm = RMSNorm(48, 1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x, r = torch.randn(5, 48).to(dtype), torch.randn(5, 48).to(dtype)
    torch.testing.assert_close(norm(x), reference(lambda: norm(x)), atol=2e-3, rtol=2e-3)
    got, summed = norm.add_forward(x, r)
    want, want_sum = reference(lambda: norm.add_forward(x, r))
    torch.testing.assert_close(summed, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    # A strided row view (rows of a wider tensor) reads the right elements.
    wide = torch.randn(5, 96).to(dtype)
    torch.testing.assert_close(norm(wide[:, :48]), reference(lambda: norm(wide[:, :48].contiguous())),
                               atol=2e-3, rtol=2e-3)


def check_rotary(dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(RopeSpec(head_dim=16, theta=10000.0))
    cos, sin = rope(torch.tensor([0, 3, 7, 100]))
    qkv = torch.randn(4, (6 + 2 + 2) * 16).to(dtype)
    q = qkv[:, : 6 * 16].view(4, 6, 16)  # a strided view, as the attention layer makes it
    got = apply_rotary(q, cos, sin)
    want = reference(lambda: apply_rotary(q, cos, sin))
    torch.testing.assert_close(got, want, atol=1e-6 if dtype == torch.float32 else 1e-3, rtol=1e-3)


def check_rope_cos_sin() -> None:
    """One launch gives the five PyTorch kernels' cos/sin (llama3 scaling, a head_dim whose half is not a
    power of two, more tokens than one program holds, int32, int64 and strided positions)."""
    for spec in (RopeSpec(head_dim=128, theta=500000.0, rope_type="llama3", factor=32.0),
                 RopeSpec(head_dim=24, theta=10000.0)):
        rope = RotaryEmbedding(spec)
        positions = torch.tensor([0, 1, 7, 100, 4095, 70000, 131071])
        strided = torch.stack([positions, positions + 1], dim=1)[:, 0]  # a 1-D view of stride 2
        for pos in (positions, positions.int(), strided):
            got = fused_ops.rope_cos_sin(pos, rope.inv_freq)  # the layer calls it for CUDA tensors only
            want = rope(pos)
            for g, w in zip(got, want):
                assert g.shape == w.shape == (7, spec.head_dim) and g.dtype == torch.float32
                torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert [t.shape for t in fused_ops.rope_cos_sin(torch.zeros(0, dtype=torch.long), rope.inv_freq)] == [(0, 24)] * 2


def check_silu_mul(dtype: torch.dtype) -> None:
    mlp = GatedMLP(16, 40).to(dtype)
    x = torch.randn(3, 16).to(dtype)
    torch.testing.assert_close(mlp(x), reference(lambda: mlp(x)), atol=2e-3, rtol=2e-3)
    wide = torch.randn(2, 2 * 1500).to(dtype)  # more than one column block
    want = torch.nn.functional.silu(wide[:, :1500]) * wide[:, 1500:]
    torch.testing.assert_close(fused_ops.silu_and_mul(wide), want, atol=2e-3, rtol=2e-3)


class _Recorder:
    """An attention stub that records what the layer hands it and returns q."""

    def forward(self, layer, q, k, v):
        self.seen = (q.clone(), k.clone(), v.clone())
        return q


def check_attention_rotary(dtype: torch.dtype, qk_norm: bool = False) -> None:
    from mstar.layers.attention import AttentionSpec, SelfAttention

    spec = AttentionSpec(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=qk_norm)
    layer = SelfAttention(spec, 0).to(dtype)
    if qk_norm:  # norm weights that differ between q and k, so a swapped weight shows
        torch.nn.init.normal_(layer.q_norm.weight, 1.0, 0.5)
        torch.nn.init.normal_(layer.k_norm.weight, -1.0, 0.5)
    cos, sin = RotaryEmbedding(RopeSpec(head_dim=16))(torch.tensor([0, 5, 9]))
    x = torch.randn(3, 32).to(dtype)
    fused, ref = _Recorder(), _Recorder()
    out = layer(x, cos, sin, fused)
    want = reference(lambda: layer(x, cos, sin, ref))
    for got, exp in zip(fused.seen, ref.seen):
        torch.testing.assert_close(got, exp, atol=1e-6 if dtype == torch.float32 else 1e-3, rtol=1e-3)
    torch.testing.assert_close(out, want, atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=2e-3)


def check_qk_norm_rotary(dtype: torch.dtype) -> None:
    """The kernel alone: a strided view of qkv rows, and cos/sin with row stride 0 (one position for all)."""
    qn, kn = RMSNorm(16, 1e-6).to(dtype), RMSNorm(16, 1e-6).to(dtype)
    torch.nn.init.normal_(qn.weight, 1.0, 0.5)
    torch.nn.init.normal_(kn.weight, 0.0, 0.5)
    cos, sin = RotaryEmbedding(RopeSpec(head_dim=16, theta=10000.0))(torch.tensor([11]))
    qkv = (3 * torch.randn(5, (3 + 1 + 1) * 16)).to(dtype)
    heads = qkv.view(5, 5, 16)[:, :4]
    got = fused_ops.qk_norm_rotary(heads, qn.weight, kn.weight, 3, cos.expand(5, -1), sin.expand(5, -1), 1e-6)

    def ref():
        q, k = qn(heads[:, :3]), kn(heads[:, 3:])
        c, s = cos.expand(5, -1), sin.expand(5, -1)
        return torch.cat([apply_rotary(q, c, s), apply_rotary(k, c, s)], dim=1)

    torch.testing.assert_close(got, reference(ref), atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=2e-3)
    # in place into the qkv rows (BAGEL's projection): q and k replaced by the same values, v untouched
    v = qkv[:, 64:].clone()
    back = fused_ops.qk_norm_rotary(heads, qn.weight, kn.weight, 3, cos.expand(5, -1), sin.expand(5, -1), 1e-6,
                                    out=heads)
    assert back.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :64].view(5, 4, 16), got, atol=0, rtol=0)
    assert torch.equal(qkv[:, 64:], v)


def check_code_predictor() -> None:
    """Qwen3-Omni's code predictor through the fused kernels (qk-norm rotary, fused add-norm, GEMV) gives the
    reference's codes (greedy) and, within rounding, its embedding sums, for a batch of 3 frames."""
    from mstar.models.qwen3_omni.code_predictor import CodePredictor
    from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
    from mstar.models.qwen3_omni.code_predictor_sampling import CodePredictorSampling, build_sampling_tensors

    cfg = CodePredictorConfig.tiny()
    model = CodePredictor(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)
    hidden, first = torch.randn(3, cfg.hidden_size), torch.tensor([1, 5, 90])
    greedy = build_sampling_tensors([CodePredictorSampling(temperature=0.0)] * 3, [None] * 3, cfg.num_residual,
                                    cfg.vocab_size, torch.device("cpu"))
    with torch.no_grad():
        codes, embed_sum = model.predict(hidden, first, greedy)
        want_codes, want_sum = reference(lambda: model.predict(hidden, first, greedy))
    assert torch.equal(codes, want_codes), (codes, want_codes)
    torch.testing.assert_close(embed_sum, want_sum, atol=1e-5, rtol=1e-5)


def check_sigmoid_gate_add(dtype: torch.dtype) -> None:
    from mstar.layers.moe import MoESpec, SparseMoE

    base, shared = torch.randn(3, 1500).to(dtype), torch.randn(3, 1500).to(dtype)  # two column blocks
    gate = (torch.randn(3, 1) * 3).to(dtype)
    want = base + torch.sigmoid(gate) * shared
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 1e-3}  # an ulp
    torch.testing.assert_close(fused_ops.sigmoid_gate_add(base, gate, shared), want, **tol)
    moe = SparseMoE(MoESpec(hidden_size=16, num_experts=4, top_k=2, intermediate_size=8,
                            shared_intermediate_size=12)).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 16).to(dtype)
    torch.testing.assert_close(moe(x), reference(lambda: moe(x)), atol=1e-5 if dtype == torch.float32 else 2e-3,
                               rtol=1e-3)


if __name__ == "__main__":
    assert FUSED.ops_for(torch.zeros(1)) is fused_ops, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    quick = "--quick" in sys.argv  # float32 alone (the default test run)
    for dt in (torch.float32,) if quick else (torch.float32, torch.float16):
        check_rms_norm(dt)
        check_rotary(dt)
        check_silu_mul(dt)
        check_attention_rotary(dt)
        check_attention_rotary(dt, qk_norm=True)
        check_qk_norm_rotary(dt)
        check_sigmoid_gate_add(dt)
    if not quick:
        check_code_predictor()
        check_rope_cos_sin()
    print("fused ops ok")
