"""The fused sampler (`mstar/kernels/fused_sampling.py`) against the same file at an earlier git revision:
the same draws on the same rows (ids compared over many seeds), then GPU microseconds per
`sample_rows` call of each, graph-timed (`mstar.kernels.timing.graph_time_us`).

Cases: Orpheus's head width (28,680 ids) with only a 4,096-id window finite (the frame-place head) and
whole, Qwen's 151,936 ids; logits randn * scale (1.1: as flat as Orpheus-3B's dummy weights give, hundreds
of candidates; 3.0: peaked; 0.5: the whole-vocabulary fallback); Orpheus's sampling rows (the `filtered`
variant) or a mix with greedy, top-k, min-p and unfiltered rows.

    python3 benchmarks/sampler_ab.py --baseline ecbba5a --out benchmarks/results/sampler_ab_h200.json

The baseline revision's `sample_rows` must take (logits, table, seen, noise, filtered) and call the
current `mstar.kernels.nucleus` as it did then. Measures, asserts nothing. Needs a CUDA GPU and git.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mstar.kernels.fused_sampling as current  # noqa: E402
from mstar.engines.sampling import SamplingParams, SamplingRow  # noqa: E402
from mstar.engines.sampling_filters import RowTable, seen_masks  # noqa: E402
from mstar.kernels.timing import graph_time_us  # noqa: E402

ORPHEUS = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3)
MIXED = [ORPHEUS, SamplingParams(temperature=0.0), SamplingParams(top_k=50, temperature=0.7), SamplingParams(),
         SamplingParams(top_k=12, top_p=0.9), SamplingParams(min_p=0.1, temperature=1.3)]


def baseline_module(revision: str) -> types.ModuleType:
    """`mstar/kernels/fused_sampling.py` as it was at `revision`, imported from a temporary file (Triton
    reads the kernels' source from it)."""
    source = subprocess.run(["git", "show", f"{revision}:mstar/kernels/fused_sampling.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"fused_sampling_{revision}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case(base: types.ModuleType, vocab: int, live: int | None, scale: float, batch: int, mix: str,
         seeds: int) -> tuple[dict, int]:
    """One case's row of timings, and how many of its `seeds` x `batch` drawn ids differ."""
    params = [ORPHEUS] * batch if mix == "orpheus" else [MIXED[i % len(MIXED)] for i in range(batch)]
    filtered = mix == "orpheus"
    rows = [SamplingRow(p, list(range(i, i + 300)), 100) for i, p in enumerate(params)]
    table = RowTable.columns(rows, vocab).cuda()
    seen = seen_masks(rows, vocab, torch.device("cuda"))
    differing = 0
    for seed in range(seeds):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        logits = torch.randn(batch, vocab, device="cuda", generator=gen) * scale
        if live:
            logits[:, live:] = -float("inf")
        noise = torch.empty(batch, vocab, device="cuda").exponential_(generator=gen)
        a = base.sample_rows(logits, table, seen, noise, filtered)
        differing += int((a != current.sample_rows(logits, table, seen, noise, filtered)).sum())
    row = {"vocab": vocab, "live": live, "scale": scale, "batch": batch, "mix": mix}
    for name, module in (("baseline", base), ("current", current)):
        row[name + "_us"] = round(graph_time_us(
            lambda x, m=module: m.sample_rows(x, table, seen, noise, filtered), logits), 2)
    return row, differing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="git revision of the kernel file to compare against")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seeds", type=int, default=20, help="draws compared per case")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    base = baseline_module(args.baseline)
    out = {"command": "python3 " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": [], "mismatches": 0, "checked": 0}
    for vocab, live in ((28_680, 4_096), (28_680, None), (151_936, None)):
        for scale in (1.1, 3.0, 0.5):
            for batch in args.batch:
                for mix in ("orpheus", "mixed"):
                    row, differing = case(base, vocab, live, scale, batch, mix, args.seeds)
                    out["checked"] += args.seeds * batch
                    out["mismatches"] += differing
                    print(json.dumps(row), flush=True)
                    out["rows"].append(row)
    print(f"ids differing: {out['mismatches']} of {out['checked']}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
