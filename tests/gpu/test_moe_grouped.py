"""The grouped (sorted, torch._grouped_mm) MoE path on CUDA bfloat16 vs the per-expert loop, and its
CUDA-graph capture. Run on the GPU machine: pytest -m gpu tests/gpu/test_moe_grouped.py"""

import pytest
import torch

from mstar.layers.moe import MoESpec, SparseMoE, grouped_mm_usable

pytestmark = pytest.mark.gpu


def _moe(shared: int) -> SparseMoE:
    torch.manual_seed(0)
    # full-size thinker / talker shapes, fewer experts to keep the test quick
    spec = MoESpec(2048, 32, 8, 768, True, shared) if not shared else MoESpec(1024, 32, 6, 384, True, shared)
    moe = SparseMoE(spec).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    return moe


@pytest.mark.parametrize("shared", [0, 768])
@pytest.mark.parametrize("tokens", [1, 7, 512])
def test_grouped_path_matches_loop_on_cuda(shared, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    moe = _moe(shared)
    x = torch.randn(tokens, moe.spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_usable(x)
    with torch.no_grad():
        moe.force_path = "loop"
        want = moe(x).float()
        moe.force_path = None  # the default on CUDA bf16 is the grouped path
        got = moe(x).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_grouped_path_is_cuda_graph_capturable():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    moe = _moe(0)
    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe(x)  # warm up outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        moe.force_path = "loop"
        torch.testing.assert_close(out.float(), moe(x).float(), atol=2e-2, rtol=2e-2)
