"""FP8 weights on CUDA (layers/fp8.py): `fp8_linear` runs W8A8 `torch._scaled_mm` for bfloat16 batches of
SCALED_MM_MIN_ROWS rows or more and matches its CPU emulation `w8a8_reference`; fewer rows, block
scales and float32 run the weight-only reference; the W8A8 path replays from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mstar.layers import fp8
from mstar.layers.fp8 import Fp8Linear, fp8_linear, w8a8_reference, weight_only_linear

pytestmark = pytest.mark.gpu
TOL = {"atol": 4e-2, "rtol": 2e-2}  # two bfloat16 steps at outputs near 4, from rounding and summation order


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
    assert fp8._scaled_mm_serves(x.cuda(), gpu)
    got = fp8_linear(x.cuda(), gpu).cpu()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), **TOL)
    dense = weight_only_linear(x.cuda(), gpu).cpu().float()
    assert (got.float() - dense).abs().mean() < 0.05 * dense.abs().mean()  # activation rounding only


def test_the_weight_only_path_serves_decode_blocks_and_float32():
    per_channel, blocks = _module(1024, 512).cuda(), _module(1024, 512, block=(128, 128)).cuda()
    for x, module in [(torch.randn(4, 512, dtype=torch.bfloat16, device="cuda"), per_channel),
                      (torch.randn(64, 512, dtype=torch.bfloat16, device="cuda"), blocks),
                      (torch.randn(64, 512, device="cuda"), per_channel)]:
        assert not fp8._scaled_mm_serves(x, module)
        want = weight_only_linear(x.cpu(), module.cpu()).float()
        module.cuda()
        torch.testing.assert_close(fp8_linear(x, module).cpu().float(), want, **TOL)


def test_scaled_mm_replays_from_a_cuda_graph():
    module = _module(2048, 1024).cuda()
    x = torch.randn(32, 1024, dtype=torch.bfloat16, device="cuda")
    eager = fp8_linear(x, module)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear(x, module)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, module)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
