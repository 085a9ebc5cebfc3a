"""An engine on a CUDA stream of its own (engines/own_stream.py) shares no scratch with the worker's stream
(kernels/scratch.py): split-K GEMVs of one workspace size and tile count, launched side by side on two
streams as the thinker's forward launched ahead and the talk loop's steps are, each under its stream's
scratch owner, all equal F.linear; and a BatchGraphs built under a stream's owner is captured on that
stream (not on the capture stream other engines' graphs share, with its cuBLAS workspace).

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_own_stream_scratch_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.engines.cuda_graphs import BatchGraphs
from mstar.kernels.scratch import scratch_owner
from mstar.kernels.skinny_gemm import SkinnyConfig, skinny_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TOL = {"atol": 3e-2, "rtol": 1.6e-2}  # bf16 rounding, as tests/gpu/test_gemv_gpu.py
ROUNDS = 300


def _side_by_side(streams, owners, xs, ws, cfg) -> list[list[torch.Tensor]]:
    """ROUNDS launches on each stream, queued in turn behind a spin kernel on each, so they run together."""
    outs: list[list[torch.Tensor]] = [[] for _ in streams]
    for stream in streams:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms: both queues fill before either starts
    for _ in range(ROUNDS):
        for out, stream, owner, x, w in zip(outs, streams, owners, xs, ws):
            with torch.cuda.stream(stream), scratch_owner(owner):
                out.append(skinny_linear(x, w, config=cfg))
    return outs


def _race(owners) -> None:
    """Same (split, rows, columns) on both streams: the same workspace size and tile count, so one shared
    buffer pair would take both streams' partial sums and tile counts. The K differ, so a mixed-up sum
    shows."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x_a, x_b = (torch.randn(1, k, device="cuda", generator=g).bfloat16() for k in (2048, 4096))
    w_a, w_b = ((torch.randn(128, k, device="cuda", generator=g) / k**0.5).bfloat16() for k in (2048, 4096))
    cfg = SkinnyConfig(block_m=1, block_n=4, block_k=256, split_k=8)
    want_a, want_b = F.linear(x_a.float(), w_a.float()), F.linear(x_b.float(), w_b.float())
    streams = (torch.cuda.Stream(), torch.cuda.current_stream())  # the engine's, the worker's
    for stream, owner in zip(streams, owners):  # compile and allocate each owner's buffers first
        with torch.cuda.stream(stream), scratch_owner(owner):
            skinny_linear(x_a, w_a, config=cfg)
    torch.cuda.synchronize()
    got_a, got_b = _side_by_side(streams, owners, (x_a, x_b), (w_a, w_b), cfg)
    torch.cuda.synchronize()
    for out in got_a:
        torch.testing.assert_close(out.float(), want_a, **TOL)
    for out in got_b:
        torch.testing.assert_close(out.float(), want_b, **TOL)


def test_split_k_gemvs_on_two_streams_with_their_own_scratch():
    _race(("engine", None))  # the engine's stream under its owner, the worker's under the shared one


def test_graphs_built_under_a_stream_owner_are_captured_on_that_stream(monkeypatch):
    captured_on = []
    real = torch.cuda.graph

    def graph(*args, **kwargs):
        captured_on.append(kwargs.get("stream"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "graph", graph)
    own = torch.cuda.Stream()
    example = [((8,), torch.float32)]
    BatchGraphs(lambda x: x * 2, [1, 2], example, torch.device("cuda"))
    with scratch_owner(own):
        graphs = BatchGraphs(lambda x: x * 2, [1, 2], example, torch.device("cuda"))
    assert captured_on == [None, None, own, own]
    with torch.cuda.stream(own):
        out = graphs(torch.ones(2, 8, device="cuda"))[0]
    own.synchronize()
    assert torch.equal(out, torch.full((2, 8), 2.0, device="cuda"))
