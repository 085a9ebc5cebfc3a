"""The Triton kernels the Qwen3-Omni decoders use on a GPU at full-size shapes: the MoE route, qk-norm with
RoPE, the code predictor's sampler; and the code predictor, fused, replaying its CUDA graph."""

from __future__ import annotations

import torch

from mstar.kernels.fused_ops import qk_norm_rotary
from mstar.kernels.moe_route import route_topk
from mstar.layers.fused import fused_kernels
from mstar.layers.moe import route
from mstar.layers.norm import RMSNorm
from mstar.layers.rope import RopeSpec, RotaryEmbedding, apply_rotary
from mstar.models.qwen3_omni.code_predictor_sampling import SamplingTensors, sample_step
from mstar.models.qwen3_omni.small_vocab_sampling import sample_rows


def test_route_kernel_equals_route_at_thinker_and_talker_shapes():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens, experts, k in ((1, 128, 8), (16, 128, 8), (64, 128, 6)):
        # float32: bf16 router logits tie often, and topk's order among ties is its own
        logits = torch.randn(tokens, experts, device="cuda", generator=gen) * 2
        weights, ids = route_topk(logits, k, True)
        with fused_kernels(False):
            want_w, want_ids = route(logits, k, True)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)


def test_qk_norm_rotary_equals_the_layers_in_bf16():
    gen = torch.Generator(device="cuda").manual_seed(1)
    qn, kn = RMSNorm(128).cuda().bfloat16(), RMSNorm(128).cuda().bfloat16()
    torch.nn.init.normal_(qn.weight, 1.0, 0.3)
    torch.nn.init.normal_(kn.weight, 1.0, 0.3)
    cos, sin = RotaryEmbedding(RopeSpec(head_dim=128, theta=1e6)).cuda()(torch.arange(5, 13, device="cuda"))
    qkv = torch.randn(8, (32 + 4 + 4) * 128, device="cuda", generator=gen).bfloat16()
    heads = qkv.view(8, 40, 128)[:, :36]

    def reference(c, s):
        with fused_kernels(False):
            return torch.cat([apply_rotary(qn(heads[:, :32]), c, s), apply_rotary(kn(heads[:, 32:]), c, s)], 1)

    # the norm alone (cos 1, sin 0: the rotation is the identity): as RMSNorm rounds, but for the rare
    # value whose 1/rms differs in its last bit
    ones, zeros = torch.ones_like(cos), torch.zeros_like(sin)
    normed, want_normed = qk_norm_rotary(heads, qn.weight, kn.weight, 32, ones, zeros, 1e-6), reference(ones, zeros)
    exact = (normed == want_normed).float().mean().item()
    assert exact > 0.99, f"normed: {exact:.4f} exact, max diff {(normed.float() - want_normed.float()).abs().max()}"
    got, want = qk_norm_rotary(heads, qn.weight, kn.weight, 32, cos, sin, 1e-6), reference(cos, sin)
    by_part = {part: (got[:, sl] == want[:, sl]).float().mean().item()
               for part, sl in (("q", slice(0, 32)), ("k", slice(32, 36)))}
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7, msg=lambda m: f"{m} exact by part {by_part}")


def test_small_vocab_sampler_equals_the_pytorch_sampler():
    gen = torch.Generator(device="cuda").manual_seed(2)
    b, vocab = 8, 2048
    table = torch.tensor([[0.0, vocab, 2.0], [1.0, 1, 2.0], [1.0, 50, 0.8], [0.9, vocab, 0.8]] * 2, device="cuda")
    st = SamplingTensors(table[:, 0], table[:, 1].long(), table[:, 2],
                         torch.empty(b, 2, vocab, device="cuda").exponential_(generator=gen))
    for step in range(2):
        logits = torch.randn(b, vocab, device="cuda", generator=gen) * 3
        got = sample_rows(logits, st.temperature, st.top_k, st.top_p, st.noise[:, step])
        with fused_kernels(False):
            want = sample_step(logits, st, step)
        assert torch.equal(got, want)


def test_code_predictor_graphs_replay_the_fused_predict():
    from mstar.models.qwen3_omni.code_predictor import CodePredictor
    from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
    from mstar.models.qwen3_omni.code_predictor_sampling import CodePredictorSampling, build_sampling_tensors

    torch.manual_seed(3)
    cfg = CodePredictorConfig.full()
    model = CodePredictor(cfg).cuda().bfloat16().eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    from mstar.engines.stateless import capture_step_graphs

    capture_step_graphs(model, [1, 4], torch.device("cuda"))
    hidden = torch.randn(3, cfg.hidden_size, device="cuda").bfloat16()
    first = torch.tensor([5, 70, 900], device="cuda")
    params = [CodePredictorSampling(seed=7)] * 3
    with torch.inference_mode():
        st = build_sampling_tensors(params, [0, 1, 2], cfg.num_residual, cfg.vocab_size, hidden.device)
        eager = model.predict(hidden, first, st)
        replayed = model._predict(hidden, first, st)
    assert torch.equal(eager[0], replayed[0])
    torch.testing.assert_close(eager[1], replayed[1])
    assert eager[0].shape == (3, cfg.num_code_groups) and bool((eager[0][:, 1:] < cfg.vocab_size).all())


def test_step_attention_equals_the_pytorch_step_in_bf16():
    """The code predictor's one-token attention step (models/qwen3_omni/step_attention.py) against its PyTorch form
    (qk-norm rotary, cache copies, cuDNN/flash SDPA) at full size: cache writes as qk_norm_rotary
    rounds, outputs within bf16 rounding (SDPA's kernels round P and the sum differently)."""
    from mstar.models.qwen3_omni.code_predictor import _Attention
    from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
    from mstar.models.qwen3_omni.step_attention import step_attention

    cfg = CodePredictorConfig.full()
    layer = _Attention(cfg).cuda().bfloat16()
    torch.nn.init.normal_(layer.q_norm.weight, 1.0, 0.3)
    torch.nn.init.normal_(layer.k_norm.weight, 1.0, 0.3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    cos, sin = RotaryEmbedding(RopeSpec(head_dim=cfg.head_dim, theta=cfg.rope_theta)).cuda()(
        torch.arange(cfg.num_code_groups, device="cuda"))
    b, nq, nkv, d, g = 16, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_code_groups
    keys = torch.randn(b, nkv, g, d, device="cuda", generator=gen).bfloat16()
    values = torch.randn(b, nkv, g, d, device="cuda", generator=gen).bfloat16()
    want_keys, want_values = keys.clone(), values.clone()
    for start in (1, 5, g - 1):
        heads = (torch.randn(b, nq + 2 * nkv, d, device="cuda", generator=gen) * 2).bfloat16()
        rc, rs = cos[start:start + 1].expand(b, -1), sin[start:start + 1].expand(b, -1)
        got = step_attention(heads, layer.q_norm.weight, layer.k_norm.weight, rc[0], rs[0], keys, values, start, nq,
                             layer.q_norm.eps)
        with fused_kernels(False):
            want = layer._one_token(heads, rc, rs, (want_keys, want_values), start)
        assert torch.equal(values, want_values)
        torch.testing.assert_close(keys, want_keys, rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -6)


def test_sample_and_embed_equals_its_pytorch_form_in_bf16():
    """The code predictor's per-step draw with the codebook lookup and running sum in the sampler's launch
    (small_vocab_sampling.sample_embed_rows) against sample_step + embedding + add, sampled and greedy."""
    from mstar.models.qwen3_omni.code_predictor_sampling import sample_and_embed

    gen = torch.Generator(device="cuda").manual_seed(5)
    b, vocab, hidden = 16, 2048, 1024
    table = torch.tensor([[0.0, vocab, 2.0], [1.0, 50, 0.8], [0.9, vocab, 0.8], [1.0, vocab, 2.0]] * 4, device="cuda")
    sampled = SamplingTensors(table[:, 0], table[:, 1].long(), table[:, 2],
                              torch.empty(b, 2, vocab, device="cuda").exponential_(generator=gen))
    greedy = SamplingTensors(torch.zeros(b, device="cuda"), torch.full((b,), vocab, device="cuda"),
                             torch.full((b,), 2.0, device="cuda"), None)
    codebook = torch.randn(vocab, hidden, device="cuda", generator=gen).bfloat16()
    for st in (sampled, greedy):
        embed_sum = torch.randn(b, hidden, device="cuda", generator=gen).bfloat16()
        for step in range(2):
            logits = (torch.randn(b, vocab, device="cuda", generator=gen) * 3).bfloat16()
            got = sample_and_embed(logits, st, step, codebook, embed_sum)
            with fused_kernels(False):
                want = sample_and_embed(logits, st, step, codebook, embed_sum)
            for g, w in zip(got, want):
                assert torch.equal(g, w)
            embed_sum = got[2]


def test_sigmoid_gate_add_equals_the_shared_expert_expression_in_bf16():
    """The talker's shared-expert add at its width (1024) and the thinker's (2048), 1 and 16 rows."""
    from mstar.kernels.fused_ops import sigmoid_gate_add

    gen = torch.Generator("cuda").manual_seed(0)
    for rows, width in ((1, 1024), (16, 1024), (16, 2048)):
        base, shared = (torch.randn(rows, width, device="cuda", generator=gen).bfloat16() for _ in range(2))
        gate = (torch.randn(rows, 1, device="cuda", generator=gen) * 3).bfloat16()
        want = base + torch.sigmoid(gate) * shared
        # H200, Triton 3.6: about a fifth of the sums differ from PyTorch's, as they do when the product's
        # rounding to bf16 is dropped (the interpreter rounds it); bound: one output step plus that rounding
        # (a kernel that also dropped the sigmoid's rounding, or worse, breaks it: checked on CPU)
        got = sigmoid_gate_add(base, gate, shared).float()
        bound = 2.0**-7 * torch.maximum(want.float().abs(), got.abs()) + 2.0**-8 * shared.float().abs() + 1e-6
        assert ((got - want.float()).abs() <= bound).all()
