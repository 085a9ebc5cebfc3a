"""Count (not assert) the instructions the host runs per generated token, with valgrind's callgrind:
reproducible to a fraction of a percent where CPU timings on a shared machine move by tens of percent.

Two parts, each the difference of two runs that differ only in how much they decode (start-up,
imports, warm-up and prefill cancel out):
- runtime: `runtime_per_token.OneThread` on the fake Orpheus (worker and conductor pumped by one
  thread, instant components, vocoder lane on): one more round of `--concurrency` requests of 700
  tokens; instructions per generated token (per sequence-step);
- engine: `ar_engine_host` (the AR engine's host path of a CUDA decode step, GPU work faked) at batch
  `--concurrency`: 200 more decode steps; instructions per sequence-step.

    python3 benchmarks/host_instructions.py --out benchmarks/results/host_instructions.json   # ~15 min

Needs `valgrind` on the PATH; runs two callgrind children at a time.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_STEPS = (50, 250)


def child(part: str, amount: int, concurrency: int) -> None:
    """The measured program: build, warm up, then `amount` rounds (runtime) or decode steps (engine)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    torch.set_num_threads(1)
    if part == "runtime":
        import runtime_per_token as rpt

        one = rpt.OneThread(rpt._config("fake_orpheus", 1, "cpu", concurrency), tiny=False)
        opts = {"max_tokens": rpt.TOKENS + 1}
        one.generate_many(concurrency, opts)  # warm-up round
        for _ in range(amount):
            one.generate_many(concurrency, opts)
    else:
        import ar_engine_host as aeh

        torch.Tensor.pin_memory = lambda self, *a, **k: self  # no accelerator here (see ar_engine_host)
        engine = aeh.make_engine(concurrency)
        aeh.decode(engine, concurrency, 40, 0)  # warm-up
        aeh.decode(engine, concurrency, amount, 0)


def count(part: str, amount: int, concurrency: int) -> int:
    """Instructions callgrind counts for one child run."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
           "--child", part, str(amount), "--concurrency", str(concurrency)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    match = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if match is None:
        raise RuntimeError(f"no instruction count from {' '.join(cmd)}:\n{done.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight / decode batch")
    parser.add_argument("--child", nargs=2, metavar=("PART", "AMOUNT"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/host_instructions.json"))
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.concurrency)
        return
    runs = [("runtime", 0), ("runtime", 1), ("engine", ENGINE_STEPS[0]), ("engine", ENGINE_STEPS[1])]
    with ThreadPoolExecutor(2) as pool:
        counts = dict(zip(runs, pool.map(lambda r: count(*r, args.concurrency), runs)))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from runtime_per_token import TOKENS

    c = args.concurrency
    runtime = (counts[("runtime", 1)] - counts[("runtime", 0)]) / (TOKENS * c)
    engine = (counts[("engine", ENGINE_STEPS[1])] - counts[("engine", ENGINE_STEPS[0])]) / (
        (ENGINE_STEPS[1] - ENGINE_STEPS[0]) * c)
    result = {"command": "python3 " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
              "concurrency": c, "runtime_instructions_per_token": round(runtime),
              "engine_instructions_per_seq_step": round(engine),
              "counts": {f"{part} {amount}": n for (part, amount), n in counts.items()}}
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
