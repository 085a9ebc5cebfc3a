"""FP8 routed experts (`StackedExperts.to_fp8`) on CUDA bfloat16: the small and tiled kernels and the chunked
tiled path that stands in for grouped_mm match the per-expert loop over the dequantized experts at the
Qwen3-Omni thinker's block shape (fewer experts), and the decode path replays from a CUDA graph. Run on
the GPU machine: pytest -m gpu tests/gpu/test_moe_fp8_gpu.py"""

import pytest
import torch

from mstar.layers.moe import MoESpec, SparseMoE, moe_graph_capturable
from tests.unit.moe_fp8_check import quantize_experts

pytestmark = pytest.mark.gpu


def _fp8_moe() -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(MoESpec(2048, 32, 8, 768, True, 0)).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    quantize_experts(moe)
    return moe


@pytest.mark.parametrize("path,tokens", [("small", 1), ("small", 7), ("tiled", 32), ("grouped", 1500)])
def test_fp8_paths_match_loop(path, tokens):
    moe = _fp8_moe()
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe.force_path = "loop"
        want = moe(x).float()
        moe.force_path = path  # "grouped" with FP8 experts: the tiled kernels over chunks of 512 tokens
        got = moe(x).float()
    assert ((got - want).norm() / want.norm()).item() < 0.02, path  # bfloat16 rounding of intermediates


def test_fp8_decode_replays_from_a_cuda_graph():
    moe = _fp8_moe()
    assert moe_graph_capturable(moe)
    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)  # 128 slots: "small" eager, "tiled" captured
    with torch.no_grad():
        eager = moe(x)  # warm up outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x)
        x.copy_(torch.randn_like(x))  # a new routing, replayed
        graph.replay()
        torch.cuda.synchronize()
        moe.force_path = "tiled"
        assert torch.equal(out, moe(x))  # the kernel the capture chose, run eagerly
        moe.force_path = None
        eager = moe(x).float()
    assert ((out.float() - eager).norm() / eager.norm()).item() < 0.02  # the eager path's rounding differs
