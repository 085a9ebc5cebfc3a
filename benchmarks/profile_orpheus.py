"""Profile (not assert) where an Orpheus token's host time goes, beyond the LM's decode step.

Runs Orpheus through the in-process offline API (workers are threads of this process, so their
classes can be timed by wrapping methods): one request, then eight concurrent ones, each
`--tokens` tokens with `ignore_eos`. Per LM step it splits the host time into: schedule, sample
launch (`sample` call), graph launch (runner.run / launch_ahead), wait (the host sync on the
sampled ids), results (the rest of the engine step), and the worker's routing and walk (the rest
of `Worker.execute`). Per SNAC step: host time, and GPU time from CUDA events around the step.
GPU idle per LM step = LM step wall interval minus the GPU time of one decode forward measured
the same way (CUDA events around graph launches), a lower bound of the time the GPU waits on the host.

    python3 benchmarks/profile_orpheus.py                # H200, Orpheus-3B dummy weights (<= 90 s)
    python3 benchmarks/profile_orpheus.py --quick        # CPU, tiny Orpheus (smoke)
    python3 benchmarks/profile_orpheus.py --kernels 25   # also: the 25 costliest GPU kernels per LM step
    python3 benchmarks/profile_orpheus.py --no-vocoder   # the LM alone: what the vocoder's GPU work costs it
    python3 benchmarks/profile_orpheus.py --timeline     # what the GPU runs between decode forwards

With `--timeline`, each case runs once more (150 tokens per request) under torch.profiler, and the LM
stream's GPU timeline is cut into steps at the decode forward's first kernel (the embedding gather):
per step the median time, the forward's span (its first kernel's start to its last GEMV's end), and
what runs between one forward's end and the next one's start (each op's median gap before it and
duration), with the side streams' busy time per step; and the forward's kernels by name and grid (calls,
time, and "advance": how far each moves the span's end past the kernels before it, so the advances of
a step add up to its span even where Programmatic Dependent Launch overlaps the kernels).

With `--kernels N`, each case then runs once more (150 tokens per request) under torch.profiler and
lists the N kernels (inside CUDA graphs too) with the most GPU time per LM step, so the GPU time of a
step that is not the decode forward (sampling, SNAC, copies) is named.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mstar.engines.autoregressive.engine as ar  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402
from mstar.engines.autoregressive.batch_scheduler import BatchScheduler  # noqa: E402
from mstar.engines.autoregressive.runner import ModelRunner  # noqa: E402
from mstar.engines.autoregressive.step_graph import StepGraphs  # noqa: E402
from mstar.engines.sampling import SampleOutput  # noqa: E402
from mstar.engines.sampling_graph import SamplerGraphs  # noqa: E402
from mstar.engines.stateless import StatelessEngine  # noqa: E402
from mstar.worker.worker import Worker  # noqa: E402


class Recorder:
    """Host seconds per named part, per engine step; CUDA event pairs resolved at the end."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.parts: dict[str, list[float]] = defaultdict(list)
        self.events: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self.step_starts: list[float] = []
        self.active = False

    def timed(self, name: str, fn, gpu: bool = False):
        rec = self

        def wrapper(*args, **kwargs):
            if not rec.active:
                return fn(*args, **kwargs)
            start_ev = None
            if gpu and rec.cuda:
                start_ev = torch.cuda.Event(enable_timing=True)
                start_ev.record()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                rec.parts[name].append(time.perf_counter() - t0)
                if start_ev is not None:
                    end_ev = torch.cuda.Event(enable_timing=True)
                    end_ev.record()
                    rec.events[name].append((start_ev, end_ev))
        return wrapper

    def gpu_ms(self, name: str) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in self.events.get(name, [])]


def install(rec: Recorder) -> None:
    """Wrap the hot-path methods (threads of this process share the patched classes)."""
    ar.AutoregressiveEngine.step = rec.timed("llm_step", ar.AutoregressiveEngine.step)
    StatelessEngine.step = rec.timed("snac_step", StatelessEngine.step, gpu=True)
    BatchScheduler.schedule = rec.timed("llm_schedule", BatchScheduler.schedule)
    ar.sample = rec.timed("llm_sample_launch", ar.sample)
    SamplerGraphs.__call__ = rec.timed("llm_sample_launch", SamplerGraphs.__call__)  # sampling graphs
    ModelRunner.run = rec.timed("llm_graph_launch", ModelRunner.run, gpu=True)
    ModelRunner.launch_ahead = rec.timed("llm_graph_launch", ModelRunner.launch_ahead, gpu=True)
    StepGraphs.launch = rec.timed("llm_graph_launch", StepGraphs.launch, gpu=True)  # the draw and the forward
    StepGraphs.drawn = rec.timed("llm_wait", StepGraphs.drawn)
    Worker.execute = rec.timed("worker_execute", Worker.execute)
    real_async = SampleOutput.to_host_async

    def to_host_async(out, copied):
        host, event = real_async(out, copied)
        if event is not None and "synchronize" not in vars(event):  # the engine reuses one event
            event.synchronize = rec.timed("llm_wait", event.synchronize)
        return host, event
    SampleOutput.to_host_async = to_host_async
    SampleOutput.to_host = rec.timed("llm_wait", SampleOutput.to_host)


def _ms(values: list[float], scale: float = 1e3) -> float:
    return round(statistics.mean(values) * scale, 3) if values else 0.0


def summarize(rec: Recorder, wall_s: float, tokens: int) -> dict:
    p = rec.parts
    steps = len(p["llm_step"])
    llm = sum(p["llm_step"])
    snac = sum(p["snac_step"])
    split = {name: round(sum(p[name]) / max(steps, 1) * 1e3, 3) for name in
             ("llm_schedule", "llm_sample_launch", "llm_graph_launch", "llm_wait")}
    split["llm_results"] = round(llm / max(steps, 1) * 1e3 - sum(split.values()), 3)
    split["worker_routing_and_walk"] = round((sum(p["worker_execute"]) - llm - snac) / max(steps, 1) * 1e3, 3)
    forward_gpu = rec.gpu_ms("llm_graph_launch")
    snac_gpu = rec.gpu_ms("snac_step")
    step_interval = wall_s / max(steps, 1) * 1e3
    return {
        "wall_s": round(wall_s, 3), "tokens": tokens, "ms_per_token": round(wall_s / max(tokens, 1) * 1e3, 3),
        "llm_steps": steps, "llm_step_interval_ms": round(step_interval, 3),
        "llm_host_ms_per_step": split,
        "llm_forward_gpu_ms": round(statistics.median(forward_gpu), 3) if forward_gpu else None,
        "gpu_idle_ms_per_step_lower_bound": (round(step_interval - statistics.median(forward_gpu), 3)
                                             if forward_gpu else None),
        "snac_steps": len(p["snac_step"]), "snac_host_ms": _ms(p["snac_step"]),
        "snac_gpu_ms": round(statistics.mean(snac_gpu), 3) if snac_gpu else None,
    }


def profiled_run(m, concurrency: int, tokens: int):
    """`concurrency` requests of `tokens` tokens each, all done, under torch.profiler (CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    opts = {"max_tokens": tokens, "ignore_eos": True}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        handles = [m.submit({"text": f"Hello number {i}, this is a profile run."}, **opts) for i in range(concurrency)]
        for h in handles:
            h.result()
        torch.cuda.synchronize()
    return prof


def kernel_table(m, rec: Recorder, concurrency: int, top: int, tokens: int = 150) -> list[dict]:
    """The `top` kernels by GPU time per LM step over one profiled run of `concurrency` requests."""
    rec.parts.clear()
    rec.events.clear()
    rec.active = True  # counts the LM steps of the profiled run
    prof = profiled_run(m, concurrency, tokens)
    rec.active = False
    steps = max(len(rec.parts["llm_step"]), 1)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name[:400]]  # templated names: long enough to tell kernels apart
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    all_us = sum(v[0] for v in totals.values())
    rows = [{"kernel": name, "us_per_step": round(us / steps, 2), "calls_per_step": round(n / steps, 2)}
            for name, (us, n) in ranked[:top]]
    sys.stdout.write(f"concurrency {concurrency}: {steps} LM steps, GPU kernel time {all_us / steps:.1f} us per step\n")
    for r in rows:
        sys.stdout.write(f"  {r['us_per_step']:9.2f} us {r['calls_per_step']:6.2f}x  {r['kernel'][:150]}\n")
    return [{"all_kernels_us_per_step": round(all_us / steps, 2), "llm_steps": steps}] + rows


FORWARD_FIRST = ("indexSelect", "BFloat16")  # the embedding gather: every decode forward's first kernel


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2) if values else 0.0


def step_timeline(m, rec: Recorder, concurrency: int, tokens: int = 150) -> dict:
    """GPU timeline of the LM stream between decode forwards, from one profiled run (see the docstring)."""
    import tempfile

    rec.active = False
    prof = profiled_run(m, concurrency, tokens)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    out = analyze_timeline(events)
    sys.stdout.write(f"concurrency {concurrency} timeline: "
                     f"{json.dumps({k: v for k, v in out.items() if k not in ('between_ops', 'forward_ops')})}\n")
    for op in out["between_ops"]:
        sys.stdout.write(f"  gap {op['gap_us']:7.2f} us  dur {op['dur_us']:7.2f} us  {op['name']}\n")
    sys.stdout.write("  forward kernels per step (advance = what each adds to the span past the kernels before it):\n")
    for op in out["forward_ops"]:
        sys.stdout.write(f"  advance {op['advance_us']:8.2f} us  dur {op['dur_us']:8.2f} us  {op['calls']:6.2f}x  "
                         f"{op['kernel']}\n")
    return out


def analyze_timeline(events: list[dict]) -> dict:
    """`step_timeline`'s numbers from a chrome trace's events (torch.profiler's export)."""
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    streams: dict[int, list[dict]] = defaultdict(list)
    for e in gpu:
        streams[e.get("args", {}).get("stream", e.get("tid"))].append(e)
    lm = max(streams, key=lambda s: sum(e["name"] == "_gemv_kernel" for e in streams[s]))
    ops = sorted(streams[lm], key=lambda e: e["ts"])
    others = sorted((e for s, es in streams.items() if s != lm for e in es), key=lambda e: e["ts"])
    starts = [i for i, e in enumerate(ops) if all(part in e["name"] for part in FORWARD_FIRST)]
    steps, spans, betweens, side, sequences = [], [], [], [], defaultdict(list)
    forward: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # kernel -> calls, dur, advance
    for a, b in zip(starts, starts[1:]):
        window = ops[a:b]
        t0, t1 = window[0]["ts"], ops[b]["ts"]
        gemvs = [i for i, e in enumerate(window) if e["name"] == "_gemv_kernel"]
        if not gemvs:
            continue
        last = gemvs[-1]
        end = window[last]["ts"] + window[last]["dur"]
        steps.append(t1 - t0)
        spans.append(end - t0)
        betweens.append(t1 - end)
        side.append(sum(min(e["ts"] + e["dur"], t1) - max(e["ts"], t0) for e in others
                        if e["ts"] < t1 and e["ts"] + e["dur"] > t0))
        prev = t0
        for e in window[:last + 1]:  # what each forward kernel adds to the span past the ones before it
            entry = forward[f"{e['name'][:60]} grid {e.get('args', {}).get('grid')}"]
            entry[0] += 1
            entry[1] += e["dur"]
            entry[2] += max(0.0, e["ts"] + e["dur"] - prev)
            prev = max(prev, e["ts"] + e["dur"])
        tail, prev = [], end
        for e in window[last + 1:]:
            tail.append((e["name"][:70], e["ts"] - prev, e["dur"]))
            prev = max(prev, e["ts"] + e["dur"])
        tail.append(("(next forward)", t1 - prev, 0.0))
        sequences[tuple(name for name, _, _ in tail)].append(tail)
    common = max(sequences.values(), key=len) if sequences else []
    between_ops = [{"name": name, "gap_us": _median([t[i][1] for t in common]), "dur_us": _median([t[i][2] for t in common])}
                   for i, (name, _, _) in enumerate(common[0])] if common else []
    n = max(len(steps), 1)
    forward_ops = [{"kernel": name, "calls": round(calls / n, 2), "dur_us": round(dur / n, 2),
                    "advance_us": round(advance / n, 2)}
                   for name, (calls, dur, advance) in sorted(forward.items(), key=lambda kv: -kv[1][2])]
    return {"steps": len(steps), "step_us_p50": _median(steps), "forward_span_us_p50": _median(spans),
           "between_us_p50": _median(betweens), "side_streams_busy_us_per_step_p50": _median(side),
           "steps_with_the_common_sequence": len(common), "between_ops": between_ops,
           "forward_ops": forward_ops}


def run_case(m, rec: Recorder, concurrency: int, tokens: int) -> dict:
    opts = {"max_tokens": tokens, "ignore_eos": True}
    rec.parts.clear()
    rec.events.clear()
    rec.active = True
    t0 = time.perf_counter()
    handles = [m.submit({"text": f"Hello number {i}, this is a profile run."}, **opts) for i in range(concurrency)]
    results = [h.result() for h in handles]
    wall = time.perf_counter() - t0
    rec.active = False
    made = sum(r.usage.get("completion_tokens", tokens) if isinstance(getattr(r, "usage", None), dict) else tokens
               for r in results)
    return summarize(rec, wall, made)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny Orpheus, short requests (smoke test)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per request (600; 40 with --quick)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also list the N costliest GPU kernels per LM step (torch.profiler, CUDA only)")
    parser.add_argument("--timeline", action="store_true",
                        help="also the LM stream's GPU timeline between decode forwards (torch.profiler, CUDA only)")
    parser.add_argument("--model-kwargs", type=json.loads, default={}, metavar="JSON",
                        help='Orpheus model_kwargs, e.g. \'{"audio_logits_only": false}\'')
    parser.add_argument("--no-vocoder", action="store_true",
                        help="the vocoder emits nothing and runs no SNAC decode: the LM's step without it")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/profile_orpheus*.json)")
    args = parser.parse_args()
    from mstar.runtime.offline import MStar

    device = "cpu" if args.quick else "cuda"
    tokens = args.tokens or (40 if args.quick else 600)
    rec = Recorder(cuda=device == "cuda")
    install(rec)
    if args.no_vocoder:
        from mstar.models.orpheus.vocoder import OrpheusVocoder

        OrpheusVocoder.run_batch = lambda self, walk, node, inputs, options: [{} for _ in inputs]
    cfg = {"model": "orpheus", "device": device, "max_concurrent_requests": max(args.concurrency),
           "node_groups": [{"node_names": ["llm", "snac"], "ranks": [0]}], "model_kwargs": args.model_kwargs}
    cases = {}
    with MStar(config=cfg, mode="inproc", tiny=args.quick, load_format="auto" if args.quick else "dummy") as m:
        m.generate({"text": "warm up"}, max_tokens=30, ignore_eos=True)
        llm = m.runtime.workers[0].engines["llm"]
        for c in args.concurrency:
            ahead = llm.lookahead_steps
            cases[f"c{c}"] = run_case(m, rec, c, tokens)
            cases[f"c{c}"]["lookahead_steps"] = llm.lookahead_steps - ahead
            sys.stdout.write(f"concurrency {c}: {json.dumps(cases[f'c{c}'])}\n")
        if args.timeline and device == "cuda":
            for c in args.concurrency:
                cases[f"c{c}"]["timeline"] = step_timeline(m, rec, c)
        if args.kernels and device == "cuda":
            for c in args.concurrency:
                cases[f"c{c}"]["kernels"] = kernel_table(m, rec, c, args.kernels)
    _print_table(cases)
    write_results({"command": "python3 " + " ".join(sys.argv), "device": device,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cases": cases}, args.out, args.quick, "profile_orpheus")


def _print_table(cases: dict) -> None:
    keys = ["ms_per_token", "llm_step_interval_ms", "llm_forward_gpu_ms", "gpu_idle_ms_per_step_lower_bound",
            "snac_host_ms", "snac_gpu_ms"]
    split = ["llm_schedule", "llm_sample_launch", "llm_graph_launch", "llm_wait", "llm_results",
             "worker_routing_and_walk"]
    sys.stdout.write(f"{'':34}" + "".join(f"{c:>12}" for c in cases) + "\n")
    for k in keys:
        sys.stdout.write(f"{k:34}" + "".join(f"{str(v[k]):>12}" for v in cases.values()) + "\n")
    for k in split:
        sys.stdout.write(f"{'host ms/step ' + k:34}" + "".join(f"{v['llm_host_ms_per_step'][k]:>12}"
                                                             for v in cases.values()) + "\n")


if __name__ == "__main__":
    main()
