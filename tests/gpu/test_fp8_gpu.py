"""FP8 weights on CUDA (layers/fp8.py): `fp8_linear` runs W8A8 `torch._scaled_mm` for bfloat16 batches of
SCALED_MM_MIN_ROWS rows or more and matches its CPU emulation `w8a8_reference`, its activations quantized by
a kernel (kernels/fp8_quant.py) that gives the PyTorch formula's bits; decode rows run the FP8
GEMV (kernels/fp8_gemv.py), which matches `weight_only_linear` at the Llama-3.2-3B (Orpheus-3B) decoder
shapes up to 64 rows, as does the skinny GEMM's tl.dot kernel on E4M3 weights (`fp8_skinny_linear`); up to
64 rows `linear` times those (and `_scaled_mm` from 16 rows) and runs the fastest; float32 and block
scales above 64 rows run the weight-only reference; the kernels replay from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mstar.kernels.fp8_gemv import fp8_gemv, fp8_skinny_linear
from mstar.kernels.fused_ops import silu_and_mul
from mstar.kernels.skinny_gemm import m_bucket
from mstar.layers import fp8
from mstar.layers.fp8 import (
    Fp8Linear,
    dequantize,
    fp8_linear,
    gemv_linear,
    quantize_linears,
    skinny_dot_linear,
    w8a8_reference,
    weight_only_linear,
)
from mstar.layers.linear import SKINNY, linear
from mstar.layers.mlp import GatedMLP

pytestmark = pytest.mark.gpu
TOL = {"atol": 4e-2, "rtol": 2e-2}  # two bfloat16 steps at outputs near 4, from rounding and summation order
EXACT_TOL = {"atol": 1e-2, "rtol": 8e-3}  # one bfloat16 rounding of the output plus fp32 summation order
# Llama-3.2-3B / Orpheus-3B decoder linears (N, K): qkv, o, gate_up, down
LLAMA_3B = [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)]


def _module(n: int, k: int, block=None, bias=True) -> Fp8Linear:
    torch.manual_seed(0)
    dense = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    return Fp8Linear.from_linear(dense, block)


@pytest.mark.parametrize("rows", [16, 64, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_matches_its_cpu_emulation(rows, bias):
    module = _module(3072, 2048, bias=bias)
    x = torch.randn(rows, 2048, dtype=torch.bfloat16)
    want = w8a8_reference(x, module)
    gpu = module.cuda()
    assert fp8.scaled_mm_serves(x.cuda(), gpu)
    got = fp8_linear(x.cuda(), gpu).cpu()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), **TOL)
    dense = weight_only_linear(x.cuda(), gpu).cpu().float()
    assert (got.float() - dense).abs().mean() < 0.05 * dense.abs().mean()  # activation rounding only


@pytest.mark.parametrize("shape", [(7020, 3072), (7020, 14336), (5, 1000)], ids=["wan_hidden", "wan_ffn", "ragged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_activation_quantization_kernel_gives_the_formulas_bits(shape, dtype):
    """`quantize_rows` (the W8A8 path's activation quantization) against `quantize_per_channel` on the GPU,
    at Wan2.2's DiT rows (2 x 3510 tokens, hidden and FFN widths): the same scales and E4M3 bytes."""
    from mstar.kernels.fp8_quant import quantize_rows

    torch.manual_seed(0)
    x = (torch.randn(*shape, device="cuda") * torch.logspace(-3, 3, shape[0], device="cuda")[:, None]).to(dtype)
    x[:, :2] = torch.tensor([0.0, -0.0], device="cuda", dtype=dtype)
    q, s = quantize_rows(x)
    want_q, want_s = fp8.quantize_per_channel(x)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_quantization_kernel_keeps_nan_and_inf_as_the_formula(dtype):
    """A NaN or an inf in a row: `quantize_rows` gives the formula's NaN/inf scale and NaN values on the GPU,
    where Triton's default max/min would drop the NaN (a finite scale, the NaN turned into -448)."""
    from mstar.kernels.fp8_quant import quantize_rows

    torch.manual_seed(0)
    x = torch.randn(4, 3072, device="cuda").to(dtype)
    x[0, 1100], x[1, 7], x[2, 1200] = float("nan"), float("inf"), -float("inf")
    (q, s), (want_q, want_s) = quantize_rows(x), fp8.quantize_per_channel(x)
    assert torch.equal(s.isnan(), want_s.isnan()) and torch.equal(s.nan_to_num(), want_s.nan_to_num())
    q, want_q = q.float(), want_q.float()
    assert torch.equal(q.isnan(), want_q.isnan()) and bool(q[0].isnan().all()) and int(q[1].isnan().sum()) == 1
    assert torch.equal(q.nan_to_num(), want_q.nan_to_num())


@pytest.mark.parametrize("kernel", [fp8_gemv, fp8_skinny_linear], ids=["gemv", "skinny_dot"])
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("rows", [1, 4, 8, 16, 64])
@pytest.mark.parametrize("shape", LLAMA_3B, ids=[f"{n}x{k}" for n, k in LLAMA_3B])
def test_fp8_gemv_matches_the_references_at_llama_3b_shapes(shape, rows, block, kernel):
    n, k = shape
    module = _module(n, k, block=block, bias=False).cuda()
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    got = kernel(x, module.weight, module.weight_scale, None, block)
    exact = (x.double() @ dequantize(module.weight, module.weight_scale, block).double().T).to(torch.bfloat16)
    torch.testing.assert_close(got, exact, **EXACT_TOL)
    torch.testing.assert_close(got.float(), weight_only_linear(x, module).float(), **TOL)
    assert torch.equal(got, kernel(x, module.weight, module.weight_scale, None, block))  # reproducible


@pytest.mark.parametrize("rows", [1, 3, 8, 15])
def test_fp8_linear_sends_decode_rows_to_the_gemv(rows):
    module = _module(1024, 512, bias=True).cuda()
    x = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda")
    assert fp8.gemv_serves(x, module) and not fp8.scaled_mm_serves(x, module)
    got = fp8_linear(x, module)
    assert torch.equal(got, gemv_linear(x, module))
    torch.testing.assert_close(got.float(), weight_only_linear(x, module).float(), **TOL)


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_fused_silu_down_matches_separate(rows, block):
    module = _module(3072, 8192, block=block, bias=False).cuda()
    gate_up = (torch.randn(rows, 2 * 8192, device="cuda") * 2).bfloat16()
    assert fp8.gated_gemv_serves(gate_up, module)
    got = fp8.silu_and_mul_gemv_linear(gate_up, module)
    assert torch.equal(got, fp8_linear(silu_and_mul(gate_up), module))  # one rounding of the activation, one GEMV
    torch.testing.assert_close(got.float(), weight_only_linear(silu_and_mul(gate_up), module).float(), **TOL)


def test_mlp_with_fp8_weights_decides_fused_silu_by_timing():
    mlp = GatedMLP(3072, 8192, bias=False).to(device="cuda", dtype=torch.bfloat16)
    quantize_linears(mlp, None)
    x = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
    saved, SKINNY.force = SKINNY.force, None
    try:
        got = mlp(x)
    finally:
        SKINNY.force = saved
    assert any(key[0] == "fp8_silu_and_mul" for key in SKINNY.decisions), SKINNY.decisions
    want = fp8_linear(silu_and_mul(fp8_linear(x, mlp.gate_up_proj)), mlp.down_proj)
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("rows", [1, 8, 16, 64])
def test_linear_runs_the_fp8_kernel_it_timed_fastest(rows, block):
    module = _module(3072, 3072, block=block, bias=False).cuda()
    x = torch.randn(rows, 3072, dtype=torch.bfloat16, device="cuda")
    assert fp8.gemv_serves(x, module)
    saved, SKINNY.force = SKINNY.force, None
    try:
        got = linear(x, module)
    finally:
        SKINNY.force = saved
    # earlier tests of this file leave decisions for other shapes in SKINNY.decisions: only this shape's counts
    this = ("fp8", block, fp8.scaled_mm_serves(x, module), m_bucket(rows), 3072, 3072)
    chosen = [v for key, v in SKINNY.decisions.items() if key[:6] == this]
    assert len(chosen) == 1 and chosen[0] in ("gemv", "skinny_dot", "scaled_mm"), SKINNY.decisions
    assert chosen[0] != "scaled_mm" or fp8.scaled_mm_serves(x, module)
    # _scaled_mm rounds the activations to E4M3 too: its reference is the W8A8 emulation, not weight-only
    want = w8a8_reference(x, module) if chosen[0] == "scaled_mm" else weight_only_linear(x, module)
    torch.testing.assert_close(got.float(), want.float(), **TOL)


def test_the_weight_only_path_serves_large_blocks_and_float32():
    per_channel, blocks = _module(1024, 512).cuda(), _module(1024, 512, block=(128, 128)).cuda()
    for x, module in [(torch.randn(80, 512, dtype=torch.bfloat16, device="cuda"), blocks),
                      (torch.randn(4, 512, device="cuda"), per_channel)]:
        assert not fp8.scaled_mm_serves(x, module) and not fp8.gemv_serves(x, module)
        want = weight_only_linear(x.cpu(), module.cpu()).float()
        module.cuda()
        torch.testing.assert_close(fp8_linear(x, module).cpu().float(), want, **TOL)


# GEMV, tl.dot kernel, _scaled_mm; the tl.dot kernel at the bf16 configs, K split at 2048 x 1024
@pytest.mark.parametrize("run, rows", [(fp8_linear, 1), (fp8_linear, 8), (fp8_linear, 32), (skinny_dot_linear, 1),
                                       (skinny_dot_linear, 8)])
def test_fp8_linear_replays_from_a_cuda_graph(run, rows):
    module = _module(2048, 1024).cuda()
    x = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
    eager = run(x, module)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(x, module)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, module)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
