"""Decode-shape linears: F.linear (cuBLAS) vs skinny_linear (Triton), microseconds per call and GB/s.

The five projections of a 3.3B Llama (hidden 3072, FFN 8192, 24 q / 8 kv heads x 128, vocab 156,940),
bf16, at M rows in {1, 8, 16, 32, 64}. Each call is timed alone with CUDA events after the L2 cache is
flushed (decode streams every weight from HBM once per step); the median of --iters calls is kept.
GB/s counts the bytes a call must move: weight + x + output.

    python3 benchmarks/gemv_micro.py [--ms 1 8 16 32 64] [--out benchmarks/results/gemv_micro_h200.json]
    python3 benchmarks/gemv_micro.py --sweep --ms 1 8 16 [--budget-s 500]   # try configs, print TUNED

--sweep also times a grid of SkinnyConfigs per (M, shape) and prints the best as `TUNED` entries to
paste into mstar/kernels/skinny_gemm.py. Measures, asserts nothing. Needs a CUDA GPU.
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

from mstar.kernels.skinny_gemm import SkinnyConfig, m_bucket, pick_config, skinny_linear  # noqa: E402

SHAPES = {"qkv": (5120, 3072), "o_proj": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192),
          "lm_head": (156940, 3072)}


def time_us(fn, flush: torch.Tensor, iters: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return sorted(times)[len(times) // 2]


def candidates(m: int):
    bucket = m_bucket(m)
    block_ms = [bucket] if bucket <= 4 else [max(bucket, 16)]
    if bucket <= 4:
        block_ms.append(16)  # the tl.dot path with padding, for comparison
    for bm, bn, bk, split, warps in itertools.product(block_ms, (16, 32, 64), (128, 256, 512), (1, 2, 4, 8),
                                                      (4, 8)):
        if bm < 16 and bm * bn * bk > 16384 * (warps // 4):
            continue  # the broadcast product would spill registers
        if bm >= 16 and (bm + bn) * bk * 2 * 3 > 200_000:
            continue  # three pipeline stages must fit in shared memory
        yield SkinnyConfig(bm, bn, bk, split, warps, 3 if bm < 16 else 4)


def sweep(x: torch.Tensor, w: torch.Tensor, flush, iters: int, deadline: float) -> tuple[SkinnyConfig, float] | None:
    """The fastest candidate config for x @ w.T and its time, or None if the deadline passed first."""
    k, best = x.shape[1], None
    for cfg in candidates(x.shape[0]):
        if time.monotonic() > deadline:
            break
        if cfg.split_k > 1 and k // cfg.split_k < cfg.block_k:
            continue
        t = time_us(lambda cfg=cfg: skinny_linear(x, w, config=cfg), flush, iters)
        if best is None or t < best[1]:
            best = (cfg, t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop sweeping after this long")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    flush = torch.empty(2 * getattr(props, "L2_cache_size", 64 << 20) // 4, dtype=torch.float32, device="cuda")
    deadline = time.monotonic() + args.budget_s
    rows, tuned = [], []
    for name in args.shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            moved = (n * k + m * k + m * n) * 2
            t_torch = time_us(lambda x=x, w=w: F.linear(x, w), flush, args.iters)
            t_skinny = time_us(lambda x=x, w=w: skinny_linear(x, w), flush, args.iters)
            row = {"shape": name, "m": m, "n": n, "k": k, "f_linear_us": round(t_torch, 2),
                   "skinny_us": round(t_skinny, 2), "f_linear_gbps": round(moved / t_torch / 1e3, 1),
                   "skinny_gbps": round(moved / t_skinny / 1e3, 1), "config": repr(pick_config(m, n, k))}
            if args.sweep:
                best = sweep(x, w, flush, max(args.iters // 3, 5), deadline)
                if best is not None:
                    row["sweep_best_us"], row["sweep_best"] = round(best[1], 2), repr(best[0])
                    row["sweep_best_gbps"] = round(moved / best[1] / 1e3, 1)
                    tuned.append(f"    ({m_bucket(m)}, {n}, {k}): {best[0]!r},")
            rows.append(row)
            print(" ".join(f"{key}={val}" for key, val in row.items() if key != "config"), flush=True)
    if tuned:
        print("TUNED = {\n" + "\n".join(tuned) + "\n}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join(sys.argv), "device": props.name, "torch": torch.__version__}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
