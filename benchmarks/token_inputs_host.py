"""Host time of recording one decode step's explicit positions (`TokenInputs.add`, n = 1), as every
talker step of Qwen3-Omni does for each of its sequences: 3-row M-RoPE positions after a shifted prompt.

    python3 benchmarks/token_inputs_host.py --out benchmarks/results/token_inputs_host.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mstar.engines.autoregressive.token_inputs import ItemExtras, TokenInputs  # noqa: E402


def us_per_add(steps: int) -> float:
    inputs = TokenInputs()
    inputs.add(0, 16, ItemExtras(positions=torch.arange(16).expand(3, -1).contiguous() + 5))
    n, t0 = 16, time.perf_counter()
    for _ in range(steps):
        inputs.add(n, 1, ItemExtras(positions=torch.full((3, 1), n + 5, dtype=torch.long)))
        n += 1
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    best = min(us_per_add(args.steps) for _ in range(args.repeats))
    doc = {"command": "python3 " + " ".join(sys.argv), "cpu": platform.processor() or platform.machine(),
           "us_per_decode_add_best_of_repeats": round(best, 2), "steps": args.steps}
    print(json.dumps(doc))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
