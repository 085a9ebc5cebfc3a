"""Time (not assert) the Orpheus vocoder's CUDA graphs: one SNAC decode of a batch of 4-frame windows.

For each batch size, the graph of `OrpheusVocoder.decode_windows` (full-size SNAC 24 kHz, random
weights, float32 as served) is replayed `--replays` times between two CUDA events; the figure is
microseconds per replay, with the fused SNAC kernels (`models/orpheus/snac_ops.py`, as served) and in
PyTorch's form (`--form torch`), for a window decoding all four frames (`whole`) and one decoding only the
frame an ordinary window emits (`kept`: samples 2048:4096, each decoder block on the span they depend on, as
served); `--emit` picks. `--kernels` also counts the kernels of one replay and lists the
costliest, from torch.profiler.

    python3 benchmarks/snac_micro.py                          # H200: batches 1 4 8 16, both forms
    python3 benchmarks/snac_micro.py --batch 1 --kernels 12   # where one window's time goes
    python3 benchmarks/snac_micro.py --form fused --emit both # whole window against the kept frame
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mstar.engines.base import StepGraphs  # noqa: E402
from mstar.engines.cuda_graphs import BatchGraphs  # noqa: E402
from mstar.layers.fused import fused_kernels  # noqa: E402
from mstar.models.orpheus.snac import SnacConfig  # noqa: E402
from mstar.models.orpheus.tokens import FRAME, OrpheusTokens  # noqa: E402
from mstar.models.orpheus.vocoder import WINDOW_FRAMES, OrpheusVocoder  # noqa: E402
from mstar.models.orpheus.weights import load_snac  # noqa: E402

PLANS = {"whole": (WINDOW_FRAMES, 0, WINDOW_FRAMES), "kept": (WINDOW_FRAMES, 1, 2)}  # (frames, emit from, to)


def build(fused: bool, sizes: tuple[int, ...], device: torch.device, plans: list[tuple[int, int, int]]) -> OrpheusVocoder:
    tokens = OrpheusTokens()
    vocoder = OrpheusVocoder(load_snac(SnacConfig(), None, device), tokens).to(device)
    with fused_kernels(fused), torch.inference_mode():  # the plans asked for, as its engine captures them
        vocoder.graphs = StepGraphs({plan.key: BatchGraphs(plan.fn, sizes, plan.example, device)
                                     for plan in vocoder.capture_plans() if plan.key in plans})
    return vocoder


def window_batch(batch: int, tokens: OrpheusTokens, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random valid audio tokens of `batch` 4-frame windows, and their first frames."""
    codes = torch.randint(0, tokens.codebook_size, (batch, FRAME * WINDOW_FRAMES))
    place = torch.arange(FRAME * WINDOW_FRAMES) % FRAME
    ids = tokens.audio_offset + place * tokens.codebook_size + codes
    return ids.to(device), torch.arange(batch, device=device) * 3


def time_replays(vocoder: OrpheusVocoder, plan: tuple[int, int, int], batch: int, replays: int) -> float:
    graphs = functools.partial(vocoder.graphs.replay, plan)
    ids, first = window_batch(batch, vocoder.tokens, vocoder.noise_table.device)
    for _ in range(3):
        graphs(ids, first)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graphs(ids, first)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def kernels(vocoder: OrpheusVocoder, plan: tuple[int, int, int], batch: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    graphs = functools.partial(vocoder.graphs.replay, plan)
    ids, first = window_batch(batch, vocoder.tokens, vocoder.noise_table.device)
    graphs(ids, first)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs(ids, first)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("Memcpy"):
            totals[event.name[:160]][0] += event.time_range.elapsed_us()
            totals[event.name[:160]][1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {"launches": sum(n for _, n in totals.values()),
            "kernel_us": round(sum(us for us, _ in totals.values()), 1),
            "top": [{"kernel": k, "us": round(us, 1), "calls": n} for k, (us, n) in ranked[:top]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--form", choices=["fused", "torch", "both"], default="both")
    parser.add_argument("--emit", choices=["whole", "kept", "both"], default="both")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--kernels", type=int, default=0, metavar="N", help="also list one replay's N costliest kernels")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/snac_micro_h200.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("snac_micro.py needs a CUDA device")
    device = torch.device("cuda")
    modes = {"torch": [False], "fused": [True], "both": [False, True]}[args.form]
    sizes = tuple(sorted(set(args.batch)))
    results = {}
    emits = ["whole", "kept"] if args.emit == "both" else [args.emit]
    for fused in modes:
        started = time.perf_counter()
        vocoder = build(fused, sizes, device, [PLANS[e] for e in emits])
        for emit in emits:
            name = ("fused" if fused else "torch") + "/" + emit
            entry = {"build_s": round(time.perf_counter() - started, 1), "us_per_replay": {}}
            for b in sizes:
                entry["us_per_replay"][b] = round(time_replays(vocoder, PLANS[emit], b, args.replays), 1)
                sys.stdout.write(f"{name:12} batch {b:3}: {entry['us_per_replay'][b]:9.1f} us per 4-frame window batch\n")
            if args.kernels:
                entry["kernels"] = {b: kernels(vocoder, PLANS[emit], b, args.kernels) for b in sizes}
                for b, k in entry["kernels"].items():
                    sys.stdout.write(f"{name:12} batch {b:3}: {k['launches']} launches, {k['kernel_us']} us of kernels\n")
                    for row in k["top"]:
                        sys.stdout.write(f"    {row['us']:8.1f} us {row['calls']:4}x {row['kernel'][:110]}\n")
            results[name] = entry
        del vocoder
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"command": "python3 " + " ".join(sys.argv),
                                          "device": torch.cuda.get_device_name(),
                                          "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results},
                                         indent=2) + "\n")


if __name__ == "__main__":
    main()
