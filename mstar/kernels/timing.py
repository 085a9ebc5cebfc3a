"""Honest GPU time of one weight-reading call, as it costs inside a decode CUDA graph.

Timing a single launch between two CUDA events measures the host: Python plus a Triton launch can
take many times longer than the kernel itself, and the GPU idles in between. Decode runs in CUDA
graphs, where launch cost is gone and consecutive kernels follow each other with no gap but the
device's own. So `graph_time_us` captures `calls` back-to-back calls of `fn` into one CUDA graph,
replays it, and divides. Each call reads a different copy of the weight, so that the weights read by
the graph add up to at least twice the L2 cache and every call streams its weight from HBM, as a
decode step does (one call re-reading a weight the previous call left in L2 would look too fast).
The copies are capped (`MAX_COPIES`): a weight of a few kilobytes (a tiny test model) would otherwise
need thousands of copies and as many launches per candidate, each a Triton launch on a slow host,
which would stretch a tiny model's warm-up to minutes. Such weights then share L2, which is what they do in
a decode step too.

Memory borrowed while it runs: the extra weight copies, at most 2 x L2 bytes in all (none when the
weight alone is that large), plus the graph's pool for the `calls`
outputs. Everything is freed before it returns. Call it outside any CUDA-graph capture: it
synchronises the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

DEFAULT_L2_BYTES = 50 << 20  # a large data-centre GPU's L2; used when the device does not report its size
MAX_COPIES = 64  # enough for weights of a few MB to fill 2 x L2 of a large GPU; smaller ones share L2


def l2_bytes(device: torch.device) -> int:
    """The L2 cache size of a CUDA device in bytes."""
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def weight_copies(weight_bytes: int, l2: int) -> int:
    """How many copies of a weight (the original included) make the bytes read add up to >= 2 x L2,
    at most MAX_COPIES."""
    return min(MAX_COPIES, max(1, math.ceil(2 * l2 / max(weight_bytes, 1))))


def graph_time_us(fn: Callable[[torch.Tensor], object], weight: torch.Tensor, min_calls: int = 8,
                  replays: int = 5) -> float:
    """Median GPU microseconds per call of `fn(weight)`, measured inside a CUDA graph of back-to-back calls.

    `fn` takes the weight (a copy of `weight` with the same shape, dtype and strides) and may read any
    other tensor it closes over (activations, bias: small, so they sit in L2 as in decode). It must be
    capturable: no host syncs, and launched once eagerly here first so that Triton compiles outside the
    capture. At least `min_calls` calls go into the graph (rounded up to whole rounds of copies).
    """
    if not weight.is_cuda:
        raise ValueError(f"graph_time_us times CUDA work; got a weight on {weight.device}")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("graph_time_us cannot run inside a CUDA-graph capture; time shapes at warm-up")
    copies = weight_copies(weight.numel() * weight.element_size(), l2_bytes(weight.device))
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    calls = copies * math.ceil(max(min_calls, copies) / copies)
    try:
        return _time_graph(fn, weights, calls, replays)
    finally:
        del weights
        torch.cuda.empty_cache()  # hand the copies' and the graph pool's memory back at once


def _time_graph(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], calls: int,
                replays: int) -> float:
    # Eager warm-up on the current stream (compiles, lazy init, workspaces). No new side
    # stream per call: cuBLAS keeps a workspace per stream, which would pile up over many timings.
    for w in weights[:2]:  # a second call too: some paths set up on their first call, then run
        fn(w)
    torch.cuda.synchronize(weights[0].device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()  # the first replay uploads the graph; not timed
    times = []
    for _ in range(max(replays, 1)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second, in GB/s) timed the same way:
    the practical HBM ceiling that the GEMV figures are compared against."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t_us = graph_time_us(lambda s: dst.copy_(s), src, min_calls=4)
    return 2 * nbytes / t_us / 1e3
