"""Decode fusions on CUDA at the Orpheus-3B / Llama-3B shapes: RoPE and the split merge inside decode
attention, RMSNorm folded into the skinny GEMV; eager and inside CUDA-graph replays; engine parity."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from decode_fusion_cases import check_attention, decode_inputs, rotate  # noqa: E402
from paged_attention_cases import Shape, make_pair  # noqa: E402

from mstar.kernels.fused_ops import rms_norm  # noqa: E402
from mstar.kernels.skinny_gemm import SkinnyConfig, skinny_linear, skinny_norm_linear  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = Shape(hq=24, hkv=8, head_dim=128, page_size=16, num_pages=2048, max_pages_per_seq=256, dtype=torch.bfloat16)
FP32 = Shape(hq=16, hkv=4, head_dim=128, page_size=16, num_pages=1024, max_pages_per_seq=128, dtype=torch.float32)
SHORT = Shape(hq=24, hkv=8, head_dim=128, page_size=16, num_pages=256, max_pages_per_seq=8, dtype=torch.bfloat16)


@pytest.mark.parametrize("shape,seq_lens,pad_to", [
    (BF16, [100], None),  # batch 1, 16 splits, most of them empty
    (BF16, [4000], None),  # batch 1, every split busy
    (BF16, [1, 17, 300, 2047], None),
    (BF16, [900, 3, 2000], 4),  # padded rows
    (SHORT, [5, 120], None),  # few pages per sequence: 2 splits
    (FP32, [1500, 64], None),
])
def test_fused_decode_attention_matches_unfused(shape, seq_lens, pad_to):
    # rope alone: bit-equal; rope + merge: within one output rounding; caches equal; counters reset.
    check_attention(shape, seq_lens, pad_to=pad_to, num_sms=None, steps=2, device="cuda")


def test_fused_decode_attention_in_cuda_graph_replay():
    """One captured launch (pad_to 4) replays correctly for later batches of other sizes and lengths."""
    _, ref = make_pair(BF16, "cuda")
    _, fused = make_pair(BF16, "cuda")
    fused.fuse_rotary = fused.fuse_reduce = True
    meta, *inputs = decode_inputs(BF16, [40, 50, 60], 4, seed=5, device="cuda")
    static = [t.clone() for t in inputs]
    for tri in (ref, fused):  # the same eager warm-up (compiles; writes the same slots in both caches)
        tri.prepare(meta, pad_to=4)
    ref.forward(1, rotate(static[0], *static[3:]), rotate(static[1], *static[3:]), static[2])
    fused.forward_rotary(1, *static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused.forward_rotary(1, *static)
    for seed, lens in ((6, [900, 3, 2000]), (7, [1, 4000]), (8, [33, 34, 35, 36])):
        meta, q, k, v, cos, sin = decode_inputs(BF16, lens, 4, seed=seed, device="cuda")
        for dst, src in zip(static, (q, k, v, cos, sin)):
            dst.copy_(src)
        fused.prepare(meta, pad_to=4)
        graph.replay()
        ref.prepare(meta, pad_to=4)
        want = ref.forward(1, rotate(q, cos, sin), rotate(k, cos, sin), v)
        torch.testing.assert_close(out[: len(lens)].float(), want[: len(lens)].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(fused.k_cache, ref.k_cache) and torch.equal(fused.v_cache, ref.v_cache)
        assert int(fused._lock.abs().sum()) == 0


def _norm_inputs(m: int, n: int, k: int = 3072, residual: bool = True):
    g = torch.Generator(device="cuda").manual_seed(m * n)
    x, r = (torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(2))
    nw = (1 + torch.randn(k, device="cuda", generator=g) / 4).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / 40).bfloat16()
    torch.cuda.synchronize()  # weights complete before a GEMV reads them ahead of its PDL wait (kernels/pdl.py)
    return x, (r if residual else None), nw, w


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [5120, 16384])
@pytest.mark.parametrize("residual", [True, False])
def test_norm_gemv_matches_norm_then_linear(m, n, residual):
    x, r, nw, w = _norm_inputs(m, n, residual=residual)
    got, summed = skinny_norm_linear(x, nw, 1e-5, w, None, r)
    normed, want_sum = rms_norm(x, nw, 1e-5, r)
    torch.testing.assert_close(got, skinny_linear(normed, w), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), F.linear(normed.float(), w.float()), atol=3e-2, rtol=3e-2)
    assert (summed is None) if r is None else torch.equal(summed, want_sum)


@pytest.mark.parametrize("cfg", [None, SkinnyConfig(block_m=1, block_n=4, block_k=1024, split_k=3)])
def test_norm_gemv_replays_in_cuda_graph(cfg):
    x, r, nw, w = _norm_inputs(1, 5120)
    eager, eager_sum = skinny_norm_linear(x, nw, 1e-5, w, None, r, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, summed = skinny_norm_linear(x, nw, 1e-5, w, None, r, config=cfg)
    for _ in range(3):
        graph.replay()
        assert torch.equal(out, eager) and torch.equal(summed, eager_sum)  # bit-reproducible
    x.add_(1.0)  # new inputs, same graph
    graph.replay()
    want, want_sum = skinny_norm_linear(x, nw, 1e-5, w, None, r, config=cfg)
    assert torch.equal(out, want) and torch.equal(summed, want_sum)


@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory):
    from llama_testing import save_hf_model

    path = tmp_path_factory.mktemp("llama_fusions")
    save_hf_model("llama3", path)
    return path


def _generate(model, fused: bool, graphs: bool, monkeypatch) -> list[list[int]]:
    """Greedy tokens of three prompts through an engine built with every decode fusion on or off; the
    skinny GEMV is forced everywhere (both ways) so that the norm fold runs where it may."""
    from test_decode_graphs import engine_for, generate, prompts_of

    from mstar.layers.fused import FUSED
    from mstar.layers.linear import SKINNY

    for name in ("MSTAR_FUSE_ROPE_ATTENTION", "MSTAR_FUSE_ATTENTION_REDUCE"):
        monkeypatch.setenv(name, "1" if fused else "0")  # read when the backend is built
    SKINNY.force, FUSED.norm_linear = True, fused
    try:
        engine = engine_for(model, graphs=graphs)
        assert engine.runner.attn.fuse_rotary == engine.runner.attn.fuse_reduce == fused
        return generate(engine, prompts_of([5, 40, 300]), [24, 24, 24])
    finally:
        SKINNY.force, FUSED.norm_linear = None, False


def test_engine_greedy_same_with_fusions_fp32(llama3_checkpoint, monkeypatch):
    from mstar.models.llama.weights import load_model

    model = load_model(llama3_checkpoint, dtype=torch.float32, device=torch.device("cuda"))
    assert _generate(model, True, True, monkeypatch) == _generate(model, False, True, monkeypatch)


def test_engine_fused_graph_replay_equals_eager_bf16(llama3_checkpoint, monkeypatch):
    from mstar.models.llama.weights import load_model

    model = load_model(llama3_checkpoint, dtype=torch.bfloat16, device=torch.device("cuda"))
    assert _generate(model, True, True, monkeypatch) == _generate(model, True, False, monkeypatch)


def test_rope_cos_sin_kernel_equals_the_five_torch_kernels():
    """`fused_ops.rope_cos_sin` (libdevice cosf/sinf) against RotaryEmbedding's PyTorch form on the GPU at
    Orpheus' rope (llama3 scaling, head 128), positions up to its 131,072 context."""
    from mstar.layers.fused import fused_kernels
    from mstar.layers.rope import RopeSpec, RotaryEmbedding

    rope = RotaryEmbedding(RopeSpec(head_dim=128, theta=500000.0, rope_type="llama3", factor=32.0)).cuda()
    positions = torch.cat([torch.arange(0, 5000), torch.randint(0, 131072, (3000,))]).cuda()
    got = rope(positions)
    with fused_kernels(False):
        want = rope(positions)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=0)
    print("bit-equal:", all(torch.equal(g, w) for g, w in zip(got, want)))
