"""GPU time of one sampling step as the sampler CUDA graphs run it: `sampling.sample_static`, fused
(kernels/fused_sampling.py) against its PyTorch form, graph-timed (`kernels/timing.graph_time_us`).

Rows take Orpheus's defaults (temperature 0.6, top-p 0.8, repetition penalty 1.3; the `filtered`
graphs) or a mix with greedy and unfiltered rows (the `general` graphs). `--scale` sets how peaked
the logits are: randn * scale; at 0.5 the top-p nucleus of a 28,680-id row holds thousands of ids, so
both forms take their whole-vocabulary fallback.

    python3 benchmarks/sampler_micro.py --out benchmarks/results/sampler_micro_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mstar.engines.sampling as sampling  # noqa: E402
from mstar.engines.sampling import SamplingParams, SamplingRow  # noqa: E402
from mstar.engines.sampling_filters import RowTable, seen_masks  # noqa: E402
from mstar.kernels.timing import graph_time_us  # noqa: E402

ORPHEUS = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3)
MIXED = [ORPHEUS, SamplingParams(temperature=0.0), SamplingParams(top_k=50, temperature=0.7), SamplingParams()]


def case(vocab: int, batch: int, mix: str, scale: float, fused: bool) -> float:
    params = [ORPHEUS] * batch if mix == "orpheus" else [MIXED[i % len(MIXED)] for i in range(batch)]
    rows = [SamplingRow(p, list(range(i, i + 300)), 100) for i, p in enumerate(params)]
    table = RowTable.columns(rows, vocab).cuda()
    seen = seen_masks(rows, vocab, torch.device("cuda"))
    logits = torch.randn(batch, vocab, device="cuda") * scale
    sampling._FUSED_SAMPLER.usable = fused
    sampling.FUSED_MAX_VOCAB = 1 << 30  # time the fused kernel at every width asked
    return graph_time_us(lambda x: sampling.sample_static(x, table, seen, mix == "orpheus"), logits)


def kernel_configs(vocab: int, batch: int, configs: list[str]) -> dict[str, float]:
    """GPU us of `fused_sampling.sample_rows` alone (Orpheus rows, peaked logits) per SLICExWARPS config
    (ids per program of its sliced kernels, and their warps)."""
    from mstar.kernels.fused_sampling import sample_rows

    rows = [SamplingRow(ORPHEUS, list(range(i, i + 300)), 100) for i in range(batch)]
    table = RowTable.columns(rows, vocab).cuda()
    seen = seen_masks(rows, vocab, torch.device("cuda"))
    noise = torch.empty(batch, vocab, device="cuda").exponential_()
    logits = torch.randn(batch, vocab, device="cuda") * 3.0
    out = {}
    for config in configs:
        slice_, warps = (int(v) for v in config.split("x"))

        def draw(x: torch.Tensor, slice_: int = slice_, warps: int = warps) -> torch.Tensor:
            return sample_rows(x, table, seen, noise, True, slice_, warps)

        out[config] = round(graph_time_us(draw, logits), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[28_680, 151_936])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--mix", nargs="+", default=["orpheus", "mixed"], choices=["orpheus", "mixed"])
    ap.add_argument("--scale", type=float, nargs="+", default=[3.0, 0.5])
    ap.add_argument("--kernel-configs", nargs="*", default=[], metavar="SLICExWARPS",
                    help="also time sample_rows alone at these slice sizes and warp counts, e.g. 2048x4 4096x8")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results = []
    for vocab in args.vocab:
        for mix in args.mix:
            for scale in args.scale:
                for batch in args.batch:
                    us = {form: round(case(vocab, batch, mix, scale, form == "fused"), 2) for form in ("fused", "torch")}
                    row = {"vocab": vocab, "mix": mix, "scale": scale, "batch": batch, "fused_us": us["fused"],
                           "torch_us": us["torch"]}
                    print(json.dumps(row), flush=True)
                    results.append(row)
    sampling._FUSED_SAMPLER.usable = True
    kernel = []
    if args.kernel_configs:
        for vocab in args.vocab:
            for batch in args.batch:
                row = {"vocab": vocab, "batch": batch, **kernel_configs(vocab, batch, args.kernel_configs)}
                print(json.dumps(row), flush=True)
                kernel.append(row)
    out = {"command": "python3 " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "timing": "graph_time_us: back-to-back sample_static calls in one CUDA graph", "rows": results,
           "sample_rows_us_by_config": kernel}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
