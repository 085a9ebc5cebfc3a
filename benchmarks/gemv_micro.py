"""Decode-shape linears: F.linear (cuBLAS) vs skinny_linear (Triton), GPU microseconds per call and GB/s.

The five projections of a 3.3B Llama (hidden 3072, FFN 8192, 24 q / 8 kv heads x 128, vocab 156,940),
bf16, at M rows in {1, 2, 4, 8, 16}, plus the down projection with SiLU-and-mul fused into it
(`skinny_silu_and_mul_linear`) against the SiLU kernel followed by F.linear / skinny_linear.

Every figure comes from `mstar.kernels.timing.graph_time_us`: back-to-back calls captured in a CUDA
graph, each reading a different copy of the weight (>= 2 x L2 in all, so weights come from HBM), the
replay time divided by the calls. That is what a call costs inside a decode graph; timing one launch
between two events measures the host's launch latency instead. GB/s counts the bytes a call must
move (weight + x + output); `pct_copy` compares it with a device-to-device copy timed the same way.

    python3 benchmarks/gemv_micro.py [--ms 1 2 4 8 16] [--out benchmarks/results/gemv_micro_h200.json]
    python3 benchmarks/gemv_micro.py --sweep [--budget-s 150]   # also try configs, print TUNED
    python3 benchmarks/gemv_micro.py --fp8 --ms 1 2 4 8 16 64   # also the FP8 kernels (kernels/fp8_gemv.py)

--fp8 adds, per cell, the FP8 GEMV on the same weight quantized to E4M3 with per-channel scales
(`fp8_us`) and with 128x128 block scales (`fp8_block_us`), beside it the skinny GEMM's tl.dot kernel on
those E4M3 weights at the bf16 configs (`fp8_skinny_dot_us`, `fp8_block_skinny_dot_us`:
`fp8_gemv.fp8_skinny_linear`) and, from 16 rows where its alignment allows, `torch._scaled_mm` with the
activations quantized per token (`fp8_scaled_mm_us`): the candidates `layers.linear` times per shape. For
the down projection: the FP8 GEMV with SiLU-and-mul fused in (`fp8_fused_us`) against the SiLU kernel +
FP8 GEMV (`fp8_silu_us`) and SiLU + the tl.dot kernel (`fp8_silu_skinny_dot_us`). Their GB/s count one
byte a weight element plus the scales (and the bf16 activations, not their quantized copy).

--sweep searches a grid of SkinnyConfigs per (M, shape) greedily from the heuristic's pick
(benchmarks/gemv_sweep.py; at M <= 4 the GEMV kernel's configs and, unless --no-dot-small, the tl.dot
kernel's, whose 16-row tiles are mostly padding there but may stream the weight better) until the share of --budget-s left to that cell runs out (Triton compiles
dominate the time; they run in --compile-threads threads), then prints the best as
`TUNED = {...}` and `TUNED_SILU_DOWN = {...}` ready to paste into mstar/kernels/skinny_gemm.py, and
writes them to the JSON. Measures, asserts nothing. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar.kernels.fp8_gemv import MAX_M as FP8_MAX_M  # noqa: E402
from mstar.kernels.fp8_gemv import fp8_gemv, fp8_skinny_linear  # noqa: E402
from mstar.kernels.fused_ops import silu_and_mul  # noqa: E402
from mstar.kernels.skinny_gemm import (  # noqa: E402
    m_bucket,
    pick_config,
    pick_silu_down_config,
    skinny_linear,
    skinny_silu_and_mul_linear,
)
from mstar.kernels.timing import copy_bandwidth_gbps, graph_time_us  # noqa: E402
from mstar.layers.fp8 import SCALED_MM_MIN_ROWS, quantize_blocks, quantize_per_channel, scaled_mm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_sweep import Sweep, dot_grid, gemv_grid  # noqa: E402

SHAPES = {"qkv": (5120, 3072), "o_proj": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192),
          "lm_head": (156940, 3072), "lm_head_span": (28680, 3072)}  # span: Orpheus speakable rows


def sweep(run, w: torch.Tensor, m: int, args, deadline: float, gated: bool = False):
    """The swept best (config, us) for one cell (None if nothing ran) and how many configs were timed."""
    n, k = w.shape
    bucket = m_bucket(m)
    starts = [pick_silu_down_config(m, n, k, args.sms) if gated else pick_config(m, n, k, args.sms)]
    grid = gemv_grid(bucket, n, k, args.sms) if bucket <= 4 else dot_grid(bucket, n, k, args.sms)
    if bucket <= 4 and args.dot_small and not gated:  # the tl.dot kernel, its 16-row tiles mostly padding
        grid |= dot_grid(bucket, n, k, args.sms)
    search = Sweep(run, w, grid, deadline, args.replays, args.compile_threads)
    return search.best(starts), search.tried


def rate(nbytes: int, us: float, copy_gbps: float) -> tuple[float, float]:
    gbps = nbytes / us / 1e3
    return round(gbps, 1), round(100 * gbps / copy_gbps, 1)


def _silu_then(kernel, gate_up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    return kernel(silu_and_mul(gate_up), weight, scale, None, block)


def fp8_cells(w: torch.Tensor, m: int, x: torch.Tensor, gated: bool, args, copy_gbps: float) -> dict:
    """FP8 kernel timings of `w` quantized per channel and in 128x128 blocks (`--fp8`), as row fields."""
    if not args.fp8 or m > FP8_MAX_M or (gated and m > 4):
        return {}
    n, k = w.shape
    row = {}
    for key, block in (("fp8", None), ("fp8_block", (128, 128))):
        q, scale = quantize_per_channel(w) if block is None else quantize_blocks(w, block)
        moved = n * k + scale.numel() * 4 + (x.numel() + m * n) * 2
        if gated:
            fns = {f"{key}_fused": partial(fp8_gemv, x, scale=scale, bias=None, block=block, gated=True),
                   f"{key}_silu": partial(_silu_then, fp8_gemv, x, scale=scale, block=block),
                   f"{key}_silu_skinny_dot": partial(_silu_then, fp8_skinny_linear, x, scale=scale, block=block)}
        else:
            fns = {key: partial(fp8_gemv, x, scale=scale, bias=None, block=block),
                   f"{key}_skinny_dot": partial(fp8_skinny_linear, x, scale=scale, bias=None, block=block)}
            if block is None and m >= SCALED_MM_MIN_ROWS and n % 16 == 0 and k % 16 == 0:  # as scaled_mm_serves
                fns[f"{key}_scaled_mm"] = partial(scaled_mm, x, weight_scale=scale, bias=None)
        for name, fn in fns.items():
            us = graph_time_us(fn, q, replays=args.replays)
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_gbps"], row[f"{name}_pct_copy"] = rate(moved, us, copy_gbps)
    return row


def linear_row(name: str, m: int, w: torch.Tensor, args, copy_gbps: float, deadline: float | None) -> dict:
    """One (shape, M) cell: F.linear and skinny_linear (heuristic config, and swept when `deadline`)."""
    n, k = w.shape
    x = torch.randn(m, k, device="cuda", dtype=w.dtype)
    moved = (n * k + m * k + m * n) * w.element_size()
    row = {"shape": name, "m": m, "n": n, "k": k}
    timings = {"f_linear": graph_time_us(lambda w_: F.linear(x, w_), w, replays=args.replays),
               "skinny": graph_time_us(lambda w_: skinny_linear(x, w_), w, replays=args.replays)}
    row["config"] = repr(pick_config(m, n, k))
    if deadline is not None:
        best, tried = sweep(lambda w_, cfg: skinny_linear(x, w_, config=cfg), w, m, args, deadline)
        row["sweep_tried"] = tried
        if best is not None and best[1] < timings["skinny"]:
            timings["sweep_best"], row["sweep_best"] = best[1], repr(best[0])
    for key, us in timings.items():
        row[f"{key}_us"] = round(us, 2)
        row[f"{key}_gbps"], row[f"{key}_pct_copy"] = rate(moved, us, copy_gbps)
    return row | fp8_cells(w, m, x, False, args, copy_gbps)


def silu_down_row(m: int, w: torch.Tensor, args, copy_gbps: float, deadline: float | None) -> dict:
    """The down projection fed by gate_up [M, 2I]: fused GEMV vs silu_and_mul + F.linear / skinny_linear."""
    n, k = w.shape
    gate_up = torch.randn(m, 2 * k, device="cuda", dtype=w.dtype)
    moved = (n * k + 2 * m * k + m * n) * w.element_size()
    row = {"shape": "silu_down", "m": m, "n": n, "k": k, "config": repr(pick_silu_down_config(m, n, k))}
    timings = {
        "silu_f_linear": graph_time_us(lambda w_: F.linear(silu_and_mul(gate_up), w_), w, replays=args.replays),
        "silu_skinny": graph_time_us(lambda w_: skinny_linear(silu_and_mul(gate_up), w_), w, replays=args.replays),
        "fused": graph_time_us(lambda w_: skinny_silu_and_mul_linear(gate_up, w_), w, replays=args.replays),
    }
    if deadline is not None:
        best, tried = sweep(lambda w_, cfg: skinny_silu_and_mul_linear(gate_up, w_, config=cfg), w, m, args,
                            deadline, gated=True)
        row["sweep_tried"] = tried
        if best is not None and best[1] < timings["fused"]:
            timings["sweep_best"], row["sweep_best"] = best[1], repr(best[0])
    for key, us in timings.items():
        row[f"{key}_us"] = round(us, 2)
        row[f"{key}_gbps"], row[f"{key}_pct_copy"] = rate(moved, us, copy_gbps)
    return row | fp8_cells(w, m, gate_up, True, args, copy_gbps)


def tuned_literal(name: str, rows: list[dict], shapes: set[str]) -> str:
    """A `NAME = {...}` dict literal of the swept winners among `rows` of the given shapes."""
    lines = [f"    ({m_bucket(r['m'])}, {r['n']}, {r['k']}): {r['sweep_best']},"
             for r in rows if r["shape"] in shapes and "sweep_best" in r]
    return f"{name} = {{\n" + "\n".join(lines) + "\n}"


def cells(args) -> list[tuple[str, int]]:
    out = [(name, m) for name in args.shapes for m in args.ms]
    if "down" in args.shapes:
        out += [("silu_down", m) for m in args.ms if m <= 4]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--replays", type=int, default=5, help="timed replays per graph (median kept)")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--no-dot-small", dest="dot_small", action="store_false",
                        help="--sweep at M <= 4: GEMV-kernel configs only")
    parser.add_argument("--budget-s", type=float, default=150.0, help="total time the sweep may take")
    parser.add_argument("--compile-threads", type=int, default=8, help="parallel Triton compiles in --sweep")
    parser.add_argument("--fp8", action="store_true", help="also time the FP8 kernels (per-channel and block scales)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    args.sms = props.multi_processor_count
    copy_gbps = copy_bandwidth_gbps(torch.device("cuda"))
    print(f"{props.name}: device-to-device copy {copy_gbps:.0f} GB/s", flush=True)
    weights = {name: torch.randn(*SHAPES[name], device="cuda", dtype=torch.bfloat16) / SHAPES[name][1] ** 0.5
               for name in args.shapes}
    todo, rows, end = cells(args), [], time.monotonic() + args.budget_s
    for i, (name, m) in enumerate(todo):
        # Each cell may use an equal share of what is left of the budget.
        deadline = time.monotonic() + max(end - time.monotonic(), 0) / (len(todo) - i) if args.sweep else None
        if name == "silu_down":
            row = silu_down_row(m, weights["down"], args, copy_gbps, deadline)
        else:
            row = linear_row(name, m, weights[name], args, copy_gbps, deadline)
        rows.append(row)
        print(" ".join(f"{key}={val}" for key, val in row.items() if "config" not in key), flush=True)
    tuned = {"TUNED": tuned_literal("TUNED", rows, set(SHAPES)),
             "TUNED_SILU_DOWN": tuned_literal("TUNED_SILU_DOWN", rows, {"silu_down"})}
    if args.sweep:
        print("\n".join(tuned.values()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join(sys.argv), "device": props.name, "torch": torch.__version__,
                "copy_gbps": round(copy_gbps, 1), "timing": "graph_time_us (CUDA graph, weights from HBM)"}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows, "tuned": tuned}, indent=1) + "\n")


if __name__ == "__main__":
    main()
