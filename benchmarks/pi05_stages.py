"""Pi0.5 per stage (asserts nothing): the median time of each of vision, prefix and flow at full size (dummy
weights, bf16, three cameras), the components called directly with a synchronize after each stage, with
their CUDA graphs and eagerly, at a few batch sizes; which prefix bucket the prompt ran in; how long capturing
the graphs took and the memory it reserved. With --profile, also where one prefix call and one flow call spend
their time at the first batch size, with graphs (torch.profiler: the top 25 kernels by device time, each with
its calls and share of the call's device time; on --quick the top CPU ops of the eager calls).

    python3 benchmarks/pi05_stages.py --profile --out $OUT/pi05_stages.json
    python3 benchmarks/pi05_stages.py --quick   # the tiny policy on CPU, eager only (smoke test)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from benchmarks.results_io import gpu_tag, write_results  # noqa: E402

STAGES = ("vision", "prefix", "flow")
PROFILED = ("prefix", "flow")
TOP = 25


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny policy on CPU (smoke test)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="robots per call (default 1 4)")
    parser.add_argument("--prompt-tokens", type=int, default=80, help="task and state tokens (default 80)")
    parser.add_argument("--repeats", type=int, default=None, help="chunks timed per case (default 30)")
    parser.add_argument("--profile", action="store_true", help="top kernels of one prefix and one flow call")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --quick (tiny, CPU)")
    args.repeats = args.repeats or (3 if args.quick else 30)
    return args


def components(quick: bool):
    """The vision and policy components with random weights, the policy's pool room for 16 robots."""
    from mstar.models.pi05.components import PolicyComponent, VisionComponent
    from mstar.models.pi05.config import PI05_BASE
    from mstar.models.pi05.network import PolicyNet
    from mstar.models.pi05.prefix_kv import PrefixKVPool
    from mstar.models.pi05.siglip import VisionTower
    from mstar.models.pi05.tiny import tiny_config
    from mstar.models.pi05.weights import build

    cfg = tiny_config() if quick else PI05_BASE
    device, dtype = (torch.device("cpu"), torch.float32) if quick else (torch.device("cuda"), torch.bfloat16)
    vision = build(lambda: VisionTower(cfg.vision, cfg.llm.width), dtype, device, None, None).eval()
    net = build(lambda: PolicyNet(cfg), dtype, device, None, None).eval()
    pool = PrefixKVPool(cfg.llm.depth, cfg.llm.num_kv_heads, cfg.llm.head_dim, 16 * -(-cfg.max_prefix_tokens // 16),
                        16, dtype, device)
    return cfg, device, VisionComponent(vision), PolicyComponent(net, pool)


def chunk_times(cfg, device, vision, policy, batch: int, prompt: int, seed: int,
                profiles: dict[str, dict] | None = None) -> tuple[float, float, float]:
    """Seconds of each stage of one chunk for `batch` robots; with `profiles`, the prefix and flow calls run
    under the profiler and their `top_ops` land there."""
    from mstar.engines.base import StepItem

    gen = torch.Generator().manual_seed(seed)
    side, options = cfg.vision.image_size, {"num_steps": cfg.num_steps}
    rids = [f"r{seed}_{i}" for i in range(batch)]
    images = [(torch.rand(len(cfg.cameras), 3, side, side, generator=gen) * 2 - 1).to(device) for _ in rids]
    ids = [torch.randint(0, cfg.vocab_size, (prompt,), generator=gen).to(device) for _ in rids]
    noise = [torch.randn(cfg.chunk_size, cfg.max_action_dim, generator=gen).to(device) for _ in rids]
    marks = [_now(device)]
    with torch.no_grad():
        tokens = vision.run_items([StepItem(r, "prefix", "vision", {"images": x}) for r, x in zip(rids, images)])
        marks.append(_now(device))
        with _profiled(profiles, "prefix", device):
            policy.run_items([StepItem(r, "prefix", "prefix", {"image_tokens": t["image_tokens"], "prompt_ids": p},
                                       options) for r, t, p in zip(rids, tokens, ids)])
            marks.append(_now(device))
        with _profiled(profiles, "flow", device):
            policy.run_items([StepItem(r, "act", "flow", {"noise": n}, options) for r, n in zip(rids, noise)])
            marks.append(_now(device))
    return tuple(b - a for a, b in zip(marks, marks[1:]))


@contextmanager
def _profiled(profiles: dict[str, dict] | None, stage: str, device: torch.device) -> Iterator[None]:
    """The block under torch.profiler (device kernels on CUDA, CPU ops on CPU), its `top_ops` stored as
    profiles[stage]; nothing when `profiles` is None. The block ends with a synchronize (`_now`)."""
    if profiles is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as prof:
        yield
    profiles[stage] = top_ops(prof, device)


def top_ops(prof, device: torch.device) -> dict[str, Any]:
    """The `TOP` kernels (CPU ops on CPU) by self time: name, calls, microseconds and share of the total."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    if device.type == "cuda":  # kernels, copies and sets on the device, graph replays' included
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name][0] += event.device_time
                totals[event.name][1] += 1
    else:
        for event in prof.key_averages():
            totals[event.key] = [event.self_cpu_time_total, event.count]
    total = sum(us for us, _ in totals.values())
    rows = sorted(totals.items(), key=lambda item: -item[1][0])[:TOP]
    return {"total_us": round(total, 1), "calls": int(sum(n for _, n in totals.values())),
            "top": [{"name": name[:160], "calls": int(n), "us": round(us, 1), "share": round(us / total, 4)}
                    for name, (us, n) in rows]}


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def medians(args, cfg, device, vision, policy, batch: int) -> dict[str, float]:
    runs = [chunk_times(cfg, device, vision, policy, batch, args.prompt_tokens, seed) for seed in range(3 + args.repeats)]
    return {f"{stage}_ms": 1e3 * statistics.median(run[i] for run in runs[3:]) for i, stage in enumerate(STAGES)}


def profiled_chunk(args, cfg, device, vision, policy, mode: str) -> dict[str, Any]:
    """`top_ops` of one prefix call and one flow call of a chunk at the first batch size (after `medians`
    warmed them)."""
    batch, profiles = args.batch[0], {}
    chunk_times(cfg, device, vision, policy, batch, args.prompt_tokens, 10_000, profiles)
    for stage in PROFILED:
        top = profiles[stage]["top"]
        print(f"{mode} batch {batch} {stage}: {profiles[stage]['total_us'] / 1e3:.2f} ms {device.type}, "
              + "; ".join(f"{row['name'][:40]} {row['us']:.0f} us" for row in top[:5]), flush=True)
    return {"mode": mode, "batch": batch, **profiles}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from mstar.engines.base import StepGraphs
    from mstar.engines.stateless import capture_step_graphs

    args = parse_args(argv)
    cfg, device, vision, policy = components(args.quick)
    tokens = len(cfg.cameras) * cfg.vision.tokens + args.prompt_tokens
    doc: dict[str, Any] = {
        "device": "cpu" if args.quick else torch.cuda.get_device_name(), "prefix_tokens": tokens,
        "prefix_bucket": next(n for n in policy.buckets if n >= tokens), "command": " ".join(sys.argv), "cases": {}}
    modes = ["eager"] if args.quick else ["graphs", "eager"]
    for mode in modes:
        if mode == "graphs":
            camera_sizes = [1, *(len(cfg.cameras) * n for n in (1, 2, 4, 8))]
            reserved, started = torch.cuda.memory_reserved(device), time.perf_counter()
            capture_step_graphs(vision, camera_sizes, device)
            capture_step_graphs(policy, [1, 2, 4, 8, 16], device)
            doc["capture"] = {"seconds": time.perf_counter() - started, "graphs": len(policy.graphs.keys()) + 1,
                              "reserved_mib": (torch.cuda.memory_reserved(device) - reserved) / 2**20}
            print(f"captured: {doc['capture']}", flush=True)
        else:
            vision.graphs = policy.graphs = StepGraphs()
        for batch in args.batch:
            doc["cases"][f"{mode}_b{batch}"] = case = medians(args, cfg, device, vision, policy, batch)
            print(f"{mode} batch {batch}: " + ", ".join(f"{k} {v:.2f}" for k, v in case.items()), flush=True)
        if args.profile and mode == modes[0]:
            doc["profile"] = profiled_chunk(args, cfg, device, vision, policy, mode)
    write_results(doc, args.out, args.quick, f"pi05_stages_{gpu_tag(doc['device'])}")
    return doc


if __name__ == "__main__":
    main()
