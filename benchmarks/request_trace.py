"""Where one served request's wall time goes on the GPU: busy, idle gaps, kernels, host syncs.

`trace(run)` calls `run()` under torch.profiler (CPU and CUDA activities) and returns a summary of the
device timeline: the union of kernel/copy intervals (busy), the idle time between them split by gap
size, the largest gaps with the kernels on either side (to place them in the code), kernel time per
category (call_timing.py: kernel_categories' with convolutions apart) and the kernels
with the most time, and the host's synchronizing CUDA runtime calls (stream/device/event
synchronize, copies: a device-to-host copy of a result is also a wait), which are where a host can make the
GPU wait. Measures, asserts nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from benchmarks.call_timing import CATEGORIES, categorize

GAP_BUCKETS_US = (10.0, 100.0, 1000.0)  # idle gaps counted as < 10 us, 10-100 us, 0.1-1 ms, >= 1 ms
_REQUEST = "request_trace.request"
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
              "cuStreamSynchronize", "cuCtxSynchronize")


def trace(run: Callable[[], object], chrome_trace: Path | None = None, top_gaps: int = 12, top_kernels: int = 30) -> dict:
    """Profile `run()` and summarize its device timeline (see the module doc)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(_REQUEST):
            run()
    if chrome_trace is not None:
        prof.export_chrome_trace(str(chrome_trace))
    kernels = []
    request = None
    syncs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            kernels.append((event.time_range.start, event.time_range.end, event.name))
        elif event.name == _REQUEST:
            request = event.time_range
        elif event.name in SYNC_CALLS:
            syncs[event.name][0] += event.cpu_time_total
            syncs[event.name][1] += 1
    summary = timeline_summary(kernels, top_gaps, top_kernels)
    if request is not None and kernels:  # host time before the first and after the last device interval
        summary["wall_ms"] = round((request.end - request.start) / 1e3, 3)
        summary["head_ms"] = round((min(k[0] for k in kernels) - request.start) / 1e3, 3)
        summary["tail_ms"] = round((request.end - max(k[1] for k in kernels)) / 1e3, 3)
    summary["host_syncs"] = {name: {"ms": round(us / 1e3, 3), "calls": n} for name, (us, n) in sorted(syncs.items())}
    return summary


def timeline_summary(kernels: list[tuple[float, float, str]], top_gaps: int = 12, top_kernels: int = 30) -> dict:
    """Busy / idle of (start_us, end_us, name) device intervals, gaps by size, top gaps, categories, and the
    `top_kernels` names with the most time (their total ms and count)."""
    if not kernels:
        return {"kernels": 0}
    kernels = sorted(kernels)
    first, last = kernels[0][0], max(end for _, end, _ in kernels)
    busy = 0.0
    gaps: list[tuple[float, str, str]] = []  # (idle us, kernel before, kernel after)
    run_start, run_end, run_name = kernels[0]
    for start, end, name in kernels[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append((start - run_end, run_name, name))
            run_start, run_end = start, end
        if end >= run_end:
            run_end, run_name = end, name
    busy += run_end - run_start
    buckets = [0.0] * (len(GAP_BUCKETS_US) + 1)
    counts = [0] * (len(GAP_BUCKETS_US) + 1)
    for idle, _, _ in gaps:
        i = sum(idle >= edge for edge in GAP_BUCKETS_US)
        buckets[i] += idle
        counts[i] += 1
    labels = ("lt_10us", "10_100us", "100us_1ms", "ge_1ms")
    categories = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for start, end, name in kernels:
        categories[categorize(name)] += end - start
        by_name[name][0] += end - start
        by_name[name][1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top_kernels]
    return {
        "kernels": len(kernels),
        "span_ms": round((last - first) / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((last - first - busy) / 1e3, 3),
        "idle_by_gap": {label: {"ms": round(b / 1e3, 3), "gaps": n} for label, b, n in zip(labels, buckets, counts)},
        "kernel_ms_by_category": {k: round(v / 1e3, 3) for k, v in categories.items()},
        "largest_gaps": [{"idle_ms": round(idle / 1e3, 3), "after": before[:100], "before": after[:100]}
                         for idle, before, after in sorted(gaps, reverse=True)[:top_gaps]],
        "top_kernels": [{"name": name[:160], "category": categorize(name), "ms": round(us / 1e3, 3), "count": n}
                        for name, (us, n) in ranked],
    }
