"""The grouped (sorted, torch._grouped_mm), small (kernels/moe_small.py) and tiled (kernels/moe_tiled.py) MoE
paths on CUDA bfloat16 vs the per-expert loop, and their CUDA-graph capture. Run on the GPU machine:
pytest -m gpu tests/gpu/test_moe_grouped.py"""

import pytest
import torch

from mstar.layers.moe import MoESpec, SparseMoE, grouped_mm_usable, pick_path

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
        moe.force_path = "grouped"  # unforced, few tokens take the small path
        got = moe(x).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_grouped_path_is_cuda_graph_capturable():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    moe = _moe(0)
    moe.force_path = "grouped"  # unforced, 16 tokens take the small path
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


# Qwen3-Omni's MoE blocks at full size: thinker (top-8 of 128, expert intermediate 768), talker (top-6
# of 128, 384, shared expert 768)
FULL = {"thinker": MoESpec(2048, 128, 8, 768), "talker": MoESpec(1024, 128, 6, 384, True, 768)}


def _full(name: str) -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(FULL[name]).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    return moe


@pytest.mark.parametrize("name", ["thinker", "talker"])
@pytest.mark.parametrize("path, tokens", [("small", t) for t in (1, 2, 4, 8, 32)]  # 32: 256 thinker slots
                         + [("tiled", t) for t in (3, 16, 32, 64, 128)])
def test_triton_paths_match_loop_at_full_size(name, path, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    moe = _full(name)
    x = torch.randn(tokens, moe.spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    picked = pick_path(x, moe.spec.top_k) == path
    with torch.no_grad():
        got = moe(x)
        moe.force_path = path
        if picked:
            assert torch.equal(got, moe(x))  # the unforced pick ran this path's kernels
        got = moe(x)
        moe.force_path = "loop"
        want = moe(x)
    # outputs are ~0.1: a few bf16 steps of the loop's per-expert rounding
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", ["thinker", "talker"])
@pytest.mark.parametrize("path, tokens", [("small", 4), ("tiled", 24)])
def test_triton_paths_are_cuda_graph_capturable(name, path, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    moe = _full(name)
    moe.force_path = path
    x = torch.randn(tokens, moe.spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe(x)  # warm up (Triton compiles) outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x)
        x.copy_(torch.randn_like(x))  # a new routing, replayed
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe(x))
        moe.force_path = "loop"
        torch.testing.assert_close(out.float(), moe(x).float(), atol=1e-2, rtol=1e-2)


def test_tiled_path_with_many_slots_on_few_experts():
    """Every token routed to the same 8 experts: 64 slots on each, four 16-slot tiles in one program."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mstar.kernels.moe_tiled import experts_tiled
    from mstar.layers.moe import experts_loop

    moe = _full("thinker")
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.arange(8, device="cuda").repeat(64, 1) * 5
    weights = torch.softmax(torch.randn(64, 8, device="cuda"), -1).to(torch.bfloat16)
    with torch.no_grad():
        got = experts_tiled(x, moe.experts.gate_up_proj, moe.experts.down_proj, ids, weights)
        want = experts_loop(x, moe.experts, ids, weights)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_eager_calls_take_the_small_path_and_graphs_the_tiled_one():
    """Outside a capture (a prefill) up to SMALL_MAX_SLOTS slots take the small path, which costs the host
    fewer launches; captured, from TILED_MIN_SLOTS slots the tiled one."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mstar.layers.moe import SMALL_MAX_SLOTS, TILED_MIN_SLOTS

    x = torch.zeros(SMALL_MAX_SLOTS // 8, 2048, device="cuda", dtype=torch.bfloat16)
    assert TILED_MIN_SLOTS <= SMALL_MAX_SLOTS
    assert pick_path(x, 8) == "small"
    assert pick_path(torch.zeros(SMALL_MAX_SLOTS // 8 + 1, 2048, device="cuda", dtype=torch.bfloat16), 8) == "tiled"
    picked = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        picked.append(pick_path(x, 8))
        picked.append(pick_path(x[: TILED_MIN_SLOTS // 8 - 1], 8))
    assert picked == ["tiled", "small"]
