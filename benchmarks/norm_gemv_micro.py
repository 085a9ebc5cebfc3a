"""The RMSNorm folded into the decode GEMV (`skinny_norm_linear`) against the norm kernel and the GEMV.

For the two projections a Llama decoder layer's norms feed (qkv: 5,120 x 3,072; gate_up: 16,384 x 3,072
at Orpheus-3B's shape), bf16, at M rows: the (residual add +) RMSNorm kernel followed by the GEMV the
engine would pick (`skinny_linear` at its tuned config, or F.linear where that is faster), and the
folded GEMV over a grid of launch configs. (Its committed result was made with a variant of the fold,
since taken back, that summed the squares in the GEMV's loop: docs/benchmarks.md, stop 30.)
Every figure is `mstar.kernels.timing.graph_time_us` (calls captured back to back in a CUDA graph,
each reading its own weight copy), as the engine times the choice when it starts. Measures, asserts
nothing. Needs a CUDA GPU.

    python3 benchmarks/norm_gemv_micro.py [--ms 1] [--budget-s 120] [--out F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar.kernels.fused_ops import rms_norm  # noqa: E402
from mstar.kernels.skinny_gemm import SkinnyConfig, m_bucket, skinny_linear, skinny_norm_linear  # noqa: E402
from mstar.kernels.timing import graph_time_us  # noqa: E402

SHAPES = {"qkv": (5120, 3072), "gate_up": (16384, 3072)}


def configs(m: int) -> list[SkinnyConfig]:
    """The grid: wider tiles (fewer programs re-reading x, the residual and the norm weight), warps,
    stages, and a split-K config."""
    bm = m_bucket(m)
    grid = [SkinnyConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
            for bn, bk, w, s in itertools.product((2, 4, 8, 16), (1024, 512), (4, 8), (1, 2))
            if not (bk == 512 and w == 8)]
    return grid + [SkinnyConfig(block_m=bm, block_n=8, block_k=1024, split_k=2, num_warps=4, num_stages=2)]


def time_shape(m: int, n: int, k: int, gen: torch.Generator, deadline: float) -> dict:
    """One (M, N, K) row: the separate pair, the GEMV alone, and the fused configs tried before `deadline`."""
    dev = gen.device
    x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
    r = torch.randn(m, k, device=dev, generator=gen).bfloat16()
    nw = (1 + 0.1 * torch.randn(k, device=dev, generator=gen)).bfloat16()
    w = (0.02 * torch.randn(n, k, device=dev, generator=gen)).bfloat16()
    normed = rms_norm(x, nw, 1e-5, r)[0]
    separate = {"skinny_linear": graph_time_us(lambda wt: skinny_linear(rms_norm(x, nw, 1e-5, r)[0], wt), w),
                "F.linear": graph_time_us(lambda wt: F.linear(rms_norm(x, nw, 1e-5, r)[0], wt), w)}
    gemv_alone = graph_time_us(lambda wt: skinny_linear(normed, wt), w)
    fused = []
    for cfg in configs(m):
        if time.perf_counter() > deadline:
            break
        us = graph_time_us(lambda wt, c=cfg: skinny_norm_linear(x, nw, 1e-5, wt, None, r, config=c), w)
        fused.append({"config": repr(cfg), "us": round(us, 2)})
    fused.sort(key=lambda f: f["us"])
    return {"m": m, "n": n, "k": k, "gemv_alone_us": round(gemv_alone, 2),
            "separate_us": {key: round(v, 2) for key, v in separate.items()}, "fused_best": fused[:5],
            "fused_tried": len(fused)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[1])
    parser.add_argument("--budget-s", type=float, default=120.0, help="stop trying configs after this long")
    parser.add_argument("--out", default="benchmarks/results/norm_gemv_micro_h200.json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cells = list(itertools.product(args.ms, SHAPES.items()))
    start, rows = time.perf_counter(), []
    for i, (m, (name, (n, k))) in enumerate(cells):
        deadline = start + args.budget_s * (i + 1) / len(cells)  # an equal share of the budget per cell
        row = {"shape": name, **time_shape(m, n, k, gen, deadline)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(dev),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
