"""Timing one callable the way a serving loop calls it: host time, GPU time, kernels, peak memory.

Shared by the component profilers (profile_omni.py). Every number is per call:

- `host_ms`: host time of the call (launches, Python, and any host sync inside it);
- `gpu_ms`: CUDA-event time of back-to-back calls (what a loop of them takes; >= GPU busy time);
- `wall_ms`: wall time of the same back-to-back calls, synced at the end;
- `first_ms`: the first call alone, synced (one-off costs: lazy init, cuDNN plans, autotuning);
- `kernel_ms` / `kernels`: summed kernel durations and kernel count from torch.profiler (on CPU: top-level
  ops), with the top kernels, a sum per category (kernel_categories.py plus `conv`) and the SDPA backends seen.
On CPU there are no events: `gpu_ms` is the wall time.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.kernel_categories import CATEGORIES as BASE_CATEGORIES
from benchmarks.kernel_categories import categorize as base_categorize
from benchmarks.kernel_categories import sdpa_backends

CATEGORIES = ("conv",) + BASE_CATEGORIES
# cuDNN / native convolution kernels (transposed convs run as dgrad; the native fallback as im2col/col2im)
_CONV = ("conv", "implicit_gemm", "dgrad", "convolve", "im2col", "col2im", "fprop")
_ATTENTION = ("sdpa", "fmha", "flash", "attn", "attention")


def categorize(name: str) -> str:
    """One of CATEGORIES: `conv` for convolution kernels (kernel_categories.py has none: its `fprop`
    rule is for cuDNN attention, whose names also say sdpa/flash), else kernel_categories' category."""
    lowered = name.lower()
    if any(k in lowered for k in _CONV) and not any(k in lowered for k in _ATTENTION):
        return "conv"
    return base_categorize(name)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, calls: int, warmup: int = 2,
               budget_s: float = 3.0) -> dict[str, float]:
    """first_ms, host_ms (mean and median), gpu_ms, wall_ms of `fn()` over `calls` calls after `warmup`.

    A slow `fn` gets fewer warm-up and timed calls (at least one of each) so the case stays near
    `budget_s`; `calls` in the result says how many were timed."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    first_ms = (time.perf_counter() - start) * 1e3
    per_call_ms = first_ms
    for _ in range(max(warmup - 1, 0)):
        t0 = time.perf_counter()
        fn()
        sync(device)
        per_call_ms = (time.perf_counter() - t0) * 1e3  # a warm call: the estimate for the budget
        if per_call_ms * calls > budget_s * 1e3:
            break
    calls = max(1, min(calls, int(budget_s * 1e3 / max(per_call_ms, 1e-3))))
    host: list[float] = []
    begin = end = None
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    wall_start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    if end is not None:
        end.record()
    sync(device)
    wall_ms = (time.perf_counter() - wall_start) * 1e3 / calls
    gpu_ms = begin.elapsed_time(end) / calls if begin is not None and end is not None else wall_ms
    return {"first_ms": _r(first_ms), "host_ms": _r(statistics.mean(host)),
            "host_ms_median": _r(statistics.median(host)), "gpu_ms": _r(gpu_ms), "wall_ms": _r(wall_ms),
            "calls": calls}


def profile_calls(fn: Callable[[], Any], device: torch.device, calls: int, top: int = 15) -> dict[str, Any]:
    """Kernels (CUDA) or top-level ops (CPU) of `calls` calls of `fn()` under torch.profiler, per call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    want = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type != want or (want == DeviceType.CPU and event.cpu_parent is not None):
            continue  # on CPU only top-level ops, so nested ones are not counted twice
        us = event.time_range.elapsed_us() if want == DeviceType.CUDA else event.cpu_time_total
        totals[event.name][0] += us
        totals[event.name][1] += 1
    return summarize_kernels(totals, calls, top)


def summarize_kernels(totals: dict[str, list[float]], calls: int, top: int) -> dict[str, Any]:
    """Per call: kernel count and ms, the `top` names by time, ms per category, SDPA backends."""
    per_call = {name: (us / 1e3 / calls, count / calls) for name, (us, count) in totals.items()}
    ranked = sorted(per_call.items(), key=lambda kv: -kv[1][0])
    categories = dict.fromkeys(CATEGORIES, 0.0)
    for name, (ms, _count) in per_call.items():
        categories[categorize(name)] += ms
    return {
        "kernel_ms": _r(sum(ms for ms, _ in per_call.values())),
        "kernels": _r(sum(count for _, count in per_call.values()), 1),
        "categories_ms": {k: _r(v) for k, v in categories.items()},
        "sdpa_backends": sdpa_backends(per_call),
        "top": [{"name": name[:120], "ms": _r(ms), "count": _r(count, 1), "category": categorize(name)}
                for name, (ms, count) in ranked[:top]],
    }


class PeakMemory:
    """Peak allocated device memory inside a `with` block, above what was allocated when it began (GiB).

    `peak_gib` and `held_gib` (still allocated at the end, above the start) are None on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_gib: float | None = None
        self.held_gib: float | None = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            self.peak_gib = _r((torch.cuda.max_memory_allocated(self.device) - self._start) / 2**30)
            self.held_gib = _r((torch.cuda.memory_allocated(self.device) - self._start) / 2**30)


def peak_gb(device: torch.device) -> float | None:
    """GiB the CUDA allocator held at its peak since the last reset (None on CPU)."""
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    """Collect garbage, hand cached CUDA blocks back and reset the peak, so the next case starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def module_gib(module: torch.nn.Module) -> float:
    """Bytes of a module's parameters and buffers, in GiB."""
    tensors = list(module.parameters()) + list(module.buffers())
    return _r(sum(t.numel() * t.element_size() for t in tensors) / 2**30)


def _r(value: float, digits: int = 3) -> float:
    return round(float(value), digits)
