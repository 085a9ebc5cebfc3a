"""What a side branch costs a CUDA graph replayed back to back, without the profiler.

The step graph (`engines/autoregressive/step_graph.py`) copies the drawn ids out on a branch forked after
the draw and joined at the end. Under torch.profiler the idle time between one replay's end and the next
replay's first kernel grew from 3.1 to 13.5 µs with the branch (docs/benchmarks.md, stop 30), while the
served figures did not get worse. This times the two shapes alone: a chain of `--kernels` small kernels,
and the same chain with a pinned-memory copy (`kernels/host_copy.copy_words`) and an external event on a
branch forked after the first third; each graph replayed `--replays` times back to back, GPU time per
replay from CUDA events around the whole run, several rounds interleaved. Measures, asserts nothing.
Needs a CUDA GPU.

    python3 benchmarks/graph_branch_gap.py [--kernels 30] [--replays 2000] [--rounds 5] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar.kernels.host_copy import copy_words  # noqa: E402


def capture(kernels: int, branch: bool) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """A chain of in-place adds on a small tensor; with `branch`, a copy out and an event on a side stream.
    The graph and what it reads (kept alive with it)."""
    x = torch.zeros(1024, device="cuda")
    ids = torch.zeros(8, dtype=torch.long, device="cuda")
    host = torch.zeros(8, dtype=torch.long).pin_memory()
    event = torch.cuda.Event(external=True)
    side = torch.cuda.Stream()
    copy_words([(ids, host)])  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        for i in range(kernels):
            x.add_(1.0)
            if i == kernels // 3:
                if branch:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        copy_words([(ids, host)])
                        event.record()
                else:
                    copy_words([(ids, host)])
                    event.record()
        if branch:
            main.wait_stream(side)
    return graph, (x, ids, host, event, side)


def time_replays(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """GPU µs per replay over `replays` back-to-back replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", type=int, default=30)
    parser.add_argument("--replays", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/graph_branch_gap_h200.json")
    args = parser.parse_args()
    graphs = {"linear": capture(args.kernels, False), "branch": capture(args.kernels, True)}
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(args.rounds):
        for name, (graph, _) in graphs.items():
            times[name].append(round(time_replays(graph, args.replays), 3))
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kernels": args.kernels,
              "us_per_replay": times,
              "median_us": {name: round(statistics.median(v), 3) for name, v in times.items()}}
    print(json.dumps(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
