"""Programmatic Dependent Launch (mstar/kernels/pdl.py) on an sm_90+ GPU.

Every decode-step kernel gives the same bits launched with PDL as without, over chains of dependent
launches (each reads what the one before wrote, so a missing wait would show), eagerly and inside
CUDA-graph replays; the compiled PDL variants carry the griddepcontrol instructions (the GEMV with a
weight load ahead of its wait); and a decode engine with PDL replays its graphs token for token equal
to eager with PDL off.
"""

from __future__ import annotations

import pytest
import torch

from mstar.kernels import decode_attention, fused_ops, gemv, kv_store, prefill_attention, skinny_gemm
from mstar.kernels.pdl import PDL, triton_supports_pdl
from mstar.kernels.skinny_gemm import (
    SkinnyConfig,
    skinny_linear,
    skinny_silu_and_mul_linear,
)
from mstar.layers.rope import RopeSpec, RotaryEmbedding
from tests.unit.paged_attention_cases import Shape, make_pair, random_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CHAIN = 6  # dependent launches per case
ATTN = Shape(hq=24, hkv=8, head_dim=128, page_size=16, num_pages=512, max_pages_per_seq=256, dtype=torch.bfloat16)
KERNELS = [gemv._gemv_kernel, skinny_gemm._skinny_kernel, skinny_gemm._splitk_reduce_kernel,
           decode_attention._decode_kernel, decode_attention._reduce_kernel, fused_ops._rms_norm_kernel,
           fused_ops._rotary_kernel, fused_ops._act_mul_kernel, kv_store._store_kv_kernel,
           prefill_attention._prefill_kernel]


@pytest.fixture
def pdl_mode():
    """Sets PDL.mode (True / False) for the launches that follow; restored afterwards."""
    if torch.cuda.get_device_capability() < (9, 0) or not triton_supports_pdl():
        pytest.skip("PDL needs an sm_90+ GPU and a Triton with launch_pdl")
    saved = PDL.mode

    def set_mode(on: bool) -> None:
        PDL.mode = on

    yield set_mode
    PDL.mode = saved


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()


# Each case builds its inputs (seeded) and returns a step: a capturable function giving the same outputs
# on every call (state it changes, the KV caches, is restored first).

def gemv_chain(m: int, n: int, config: SkinnyConfig | None = None):
    g = torch.Generator(device="cuda").manual_seed(n + m)
    w, b, x0 = _randn(g, n, n, scale=n ** -0.5), _randn(g, n), _randn(g, m, n)

    def step():
        outs = [x0]
        for _ in range(CHAIN):
            outs.append(skinny_linear(outs[-1], w, b, config=config))
        return outs[1:]
    return step


def silu_down_chain():
    g = torch.Generator(device="cuda").manual_seed(3)
    w, x0 = _randn(g, 3072, 1536, scale=0.05), _randn(g, 1, 3072)

    def step():
        outs = [x0]
        for _ in range(CHAIN):
            outs.append(skinny_silu_and_mul_linear(outs[-1], w))
        return outs[1:]
    return step


def fused_ops_chain():
    g = torch.Generator(device="cuda").manual_seed(5)
    nw, x0, r0 = 1 + _randn(g, 3072, scale=0.2), _randn(g, 4, 3072), _randn(g, 4, 3072)
    cos, sin = RotaryEmbedding(RopeSpec(head_dim=128)).to("cuda")(torch.tensor([3, 70, 900, 4000], device="cuda"))

    def step():
        x, r, outs = x0, r0, []
        for _ in range(CHAIN // 2):
            x, r = fused_ops.rms_norm(x, nw, 1e-5, r)
            x = fused_ops.rotary(x.view(4, 24, 128), cos, sin).view(4, 3072)
            x = fused_ops.rms_norm(x, nw, 1e-5)[0]
            outs += [x, r]
        for _ in range(4):  # [4, 3072] -> [4, 1536] -> ... -> [4, 192]
            x = fused_ops.silu_and_mul(x)
            outs.append(x)
        return outs
    return step


def prefill_case():
    _, tri = make_pair(ATTN, "cuda")
    meta, q, k, v = random_batch(ATTN, [30, 700], [30, 200], "cuda", seed=6)
    tri.prepare(meta)
    k0, v0 = tri.k_cache.clone(), tri.v_cache.clone()

    def step():
        tri.k_cache.copy_(k0)
        tri.v_cache.copy_(v0)
        out = tri.forward(1, q, k, v)  # store_kv, then prefill attention
        return [out, tri.forward(0, out, k, v), tri.k_cache, tri.v_cache]
    return step


def decode_case():
    _, tri = make_pair(ATTN, "cuda")
    meta, q0, k, v = random_batch(ATTN, [100, 3900, 37], [1, 1, 1], "cuda", seed=7)
    g = torch.Generator().manual_seed(8)  # a padding row: the batch replays at 4 rows
    q0, k, v = (torch.cat([x, torch.randn(1, *x.shape[1:], generator=g).to(x)]) for x in (q0, k, v))
    tri.prepare(meta, pad_to=4)
    k0, v0 = tri.k_cache.clone(), tri.v_cache.clone()

    def step():
        tri.k_cache.copy_(k0)
        tri.v_cache.copy_(v0)
        outs = [q0]
        for _ in range(CHAIN // 2):
            q = outs[-1]
            outs.append(tri.forward(1, q, k, v))
        return outs[1:] + [tri.k_cache, tri.v_cache]
    return step


CASES = {
    "gemv": lambda: gemv_chain(1, 3072),  # the TUNED batch-1 config: 3072 one-row programs
    "gemv_split_k_ragged": lambda: gemv_chain(3, 3000, SkinnyConfig(block_m=4, block_n=4, block_k=1024, split_k=3)),
    "gemv_silu_down": silu_down_chain,
    "dot_split_k": lambda: gemv_chain(16, 1024, SkinnyConfig(block_m=16, block_n=32, block_k=128, split_k=4)),
    "fused_ops": fused_ops_chain,
    "prefill": prefill_case,
    "decode_splits_reduce_kernel": decode_case,
}


def _outputs(step) -> list[torch.Tensor]:
    outs = [t.clone() for t in step()]
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_bits_with_and_without_pdl(name, pdl_mode):
    results = {}
    for on in (False, True):
        pdl_mode(on)
        step = CASES[name]()
        torch.cuda.synchronize()  # inputs in place before the first launch (weights may be read pre-wait)
        results[on] = _outputs(step)
        assert all(map(torch.equal, _outputs(step), results[on])), f"{name}: not reproducible"
    for i, (off, on) in enumerate(zip(results[False], results[True], strict=True)):
        assert torch.equal(off, on), f"{name}: output {i} differs with PDL (max {(off.float() - on.float()).abs().max()})"


@pytest.mark.parametrize("name", sorted(CASES))
def test_graph_replay_with_pdl_equals_eager_without(name, pdl_mode):
    pdl_mode(False)
    want = _outputs(CASES[name]())
    pdl_mode(True)
    step = CASES[name]()
    step()  # compiles the PDL variants and allocates the workspaces outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for replay in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for i, (got, ref) in enumerate(zip(outs, want, strict=True)):
            assert torch.equal(got, ref), f"{name}: replay {replay}, output {i} differs"


def _compiled(kernel) -> list:
    """The compiled variants of a @triton.jit kernel launched so far in this process."""
    return [k for entry in kernel.device_caches.values() for k in entry[0].values()]


def test_pdl_variants_carry_griddepcontrol(pdl_mode):
    pdl_mode(True)
    for make in CASES.values():
        make()()
    torch.cuda.synchronize()
    for kernel in KERNELS:
        variants = [k for k in _compiled(kernel) if getattr(k.metadata, "launch_pdl", False)]
        assert variants, f"{kernel.__name__} was never launched with launch_pdl"
        for k in variants:
            ptx = k.asm["ptx"]
            assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx, kernel.__name__
    for k in _compiled(gemv._gemv_kernel):
        if getattr(k.metadata, "launch_pdl", False):  # the first weight tile is requested before the wait
            ptx = k.asm["ptx"]
            assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")
    pdl_mode(False)
    CASES["fused_ops"]()()
    plain = [k for k in _compiled(fused_ops._act_mul_kernel) if not getattr(k.metadata, "launch_pdl", False)]
    assert plain and all("griddepcontrol" not in k.asm["ptx"] for k in plain)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.models.llama_testing import save_hf_model

    path = tmp_path_factory.mktemp("llama_pdl")
    save_hf_model("llama3", path)
    return path


def test_engine_graphs_with_pdl_decode_token_for_token(checkpoint, pdl_mode):
    """Five sequences finishing at different steps (the batch shrinks through the captured sizes); every
    projection on the skinny GEMV."""
    from mstar.layers.linear import SKINNY
    from mstar.models.llama.weights import load_model
    from tests.gpu.test_decode_graphs import engine_for, generate, prompts_of

    model = load_model(checkpoint, dtype=torch.bfloat16, device=torch.device("cuda"))
    prompts, budgets = prompts_of([3, 17, 40, 9, 64]), [40, 33, 20, 7, 50]
    SKINNY.force = True
    tokens = {}
    try:
        for on, graphs in ((True, True), (True, False), (False, False)):
            pdl_mode(on)
            assert PDL.enabled(torch.device("cuda")) is on
            engine = engine_for(model, graphs=graphs)
            assert (engine.runner.graphs is not None) is graphs
            tokens[(on, graphs)] = generate(engine, prompts, budgets)
            del engine
    finally:
        SKINNY.force = None
    assert tokens[(True, True)] == tokens[(True, False)] == tokens[(False, False)]
