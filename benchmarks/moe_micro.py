"""GPU time of one sparse MoE block at decode batch sizes, against the bytes it must read (profiles, asserts nothing).

A decode step of an MoE model reads the weights of every expert some token of the batch routed to: at
batch 1 the thinker of Qwen3-Omni reads 8 of 128 experts a layer, at batch 16 most of them. So the
floor of a step is (distinct experts x expert bytes) / HBM bandwidth, and this measures how close each
path of `SparseMoE.forward` (`--paths`, set through `force_path`: "small", the two Triton GEMV launches
of `mstar/kernels/moe_small.py`; "tiled", `mstar/kernels/moe_tiled.py`'s per-expert tensor-core tiles;
"grouped", `experts_grouped`'s two `torch._grouped_mm`) comes, one row per block, path and batch:

- `us`: GPU microseconds per block inside a CUDA graph of back-to-back calls, each on its own input
  (so routings differ) and, in turn, its own copy of the block's weights (the copies add up to more
  than L2, so every call streams from HBM as in a decode step);
- `experts`: distinct experts the batch routed to (mean over the inputs), `gb_per_s`: those experts'
  bytes plus the router's over `us`, `pct_copy`: that rate against a plain device copy's;
- `top`: the block's kernels at batch 1 and 16 under torch.profiler (eager).

With `--sweep B...`, first the tiled kernels' tile sizes (`TiledMoEConfig`) are searched at those batches,
timing the experts alone (router outputs made beforehand, same graphs): gate_up's candidates with the
default down, then down's with the best gate_up; rows with "sweep": true, the experts-alone times of the
small path beside them, and per block the config with the least total time over the swept batches,
which then serves the block rows ("tiled_config" in the report).

With `--eager`, each row also has `eager_host_us` (host time to issue one call without a graph, as a
prefill runs the block) and `eager_us` (wall time per call over 48 calls in a row, then a sync).

    python3 benchmarks/moe_micro.py [--batches 1 4 8 16 32 64] [--paths small tiled grouped]
        [--sweep 16 32 64] [--eager] [--out benchmarks/results/moe_micro_h200.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from benchmarks.call_timing import profile_calls  # noqa: E402
from mstar.kernels import moe_tiled  # noqa: E402
from mstar.kernels.moe_small import experts_small  # noqa: E402
from mstar.kernels.moe_tiled import TiledMoEConfig, experts_tiled  # noqa: E402
from mstar.layers.moe import MoESpec, SparseMoE, route  # noqa: E402
from mstar.models.qwen3_omni.config import FULL_SIZES  # noqa: E402

INPUTS = 8  # different inputs (routings) per graph
CAPTURABLE = ["small", "tiled", "grouped"]  # the paths a CUDA graph can hold (the loop syncs the host)
# (block_n, block_k, warps, stages) candidates of each tiled kernel
GATE_UP_CANDIDATES = [(64, 128, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (64, 256, 4, 3), (64, 128, 4, 4),
                      (64, 64, 4, 5), (128, 128, 8, 3), (128, 64, 4, 4), (16, 256, 4, 3)]
DOWN_CANDIDATES = [(64, 128, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (64, 256, 4, 2), (128, 128, 8, 3),
                   (128, 64, 4, 4), (16, 256, 4, 3)]


def specs() -> dict[str, MoESpec]:
    """The thinker's and the talker's MoE block at full size."""
    out = {}
    for name in ("thinker", "talker"):
        s = FULL_SIZES[name]
        out[name] = MoESpec(s["hidden_size"], s["num_experts"], s["top_k"], s["moe_intermediate_size"],
                            shared_intermediate_size=s.get("shared_expert_intermediate_size", 0))
    return out


def build(spec: MoESpec, device: torch.device, seed: int) -> SparseMoE:
    torch.manual_seed(seed)
    block = SparseMoE(spec).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def expert_bytes(spec: MoESpec) -> int:
    return 2 * (2 * spec.intermediate_size * spec.hidden_size + spec.hidden_size * spec.intermediate_size)


def copy_gbps(device: torch.device) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    return src.numel() * 5 / (start.elapsed_time(end) / 1e3) / 1e9  # bytes read (as gemv_micro counts)


def time_block(blocks: list[SparseMoE], xs: list[torch.Tensor], replays: int = 5) -> float:
    """Median GPU us per call of a graph calling blocks[i % len] on xs[i % len]."""
    n = max(len(blocks), len(xs))
    return time_calls([lambda i=i: blocks[i % len(blocks)](xs[i % len(xs)]) for i in range(n)], replays)


def time_calls(fns: list, replays: int = 5) -> float:
    """Median GPU us per call of a graph calling each of `fns` twice in turn."""
    calls = len(fns) * 2
    with torch.inference_mode():
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def time_eager(blocks: list[SparseMoE], xs: list[torch.Tensor], calls: int = 48) -> tuple[float, float]:
    """(host us to issue one eager call, wall us per call for `calls` calls in a row then a sync)."""
    with torch.inference_mode():
        for b, x in zip(blocks, xs):
            b(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(calls):
            blocks[i % len(blocks)](xs[i % len(xs)])
        issued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
    return round((issued - start) / calls * 1e6, 1), round((done - start) / calls * 1e6, 1)


def sweep_tiled(name: str, spec: MoESpec, blocks: list[SparseMoE], batches: list[int], rows: list) -> TiledMoEConfig:
    """Coordinate search of the tiled kernels' tiles at `batches` (experts alone); returns the config with the
    least summed time."""
    device = blocks[0].experts.gate_up_proj.device
    cases = {}
    for batch in batches:
        gen = torch.Generator(device=device).manual_seed(1000 + batch)
        xs = [torch.randn(batch, spec.hidden_size, device=device, dtype=torch.bfloat16, generator=gen)
              for _ in range(INPUTS)]
        with torch.inference_mode():
            routes = [route(blocks[0].gate(x), spec.top_k, True) for x in xs]
        cases[batch] = (xs, routes)

    def fns(run, batch):
        xs, routes = cases[batch]
        out = []
        for i, (x, (w, ids)) in enumerate(zip(xs, routes)):
            b = blocks[i % len(blocks)]
            out.append(lambda x=x, w=w, ids=ids, b=b: run(x, b.experts.gate_up_proj, b.experts.down_proj, ids, w))
        return out

    for batch in batches:
        us = time_calls(fns(experts_small, batch))
        rows.append({"sweep": True, "block": name, "path": "small", "batch": batch, "us": round(us, 2)})
        print(f"sweep {name} small batch={batch} us={us:.2f}", flush=True)

    def total(cfg: TiledMoEConfig) -> float:
        spent = 0.0
        for batch in batches:
            us = time_calls(fns(lambda *a, cfg=cfg: experts_tiled(*a, config=cfg), batch))
            spent += us
            rows.append({"sweep": True, "block": name, "path": "tiled", "batch": batch, "us": round(us, 2),
                         "config": asdict(cfg)})
            print(f"sweep {name} tiled batch={batch} us={us:.2f} {cfg}", flush=True)
        return spent

    base = moe_tiled.tiled_config(spec.hidden_size, spec.intermediate_size)
    scored = []
    for n, k, warps, stages in GATE_UP_CANDIDATES:
        cfg = replace(base, gate_up_block_n=n, gate_up_block_k=k, gate_up_warps=warps, gate_up_stages=stages)
        scored.append((total(cfg), cfg))
    best = min(scored, key=lambda s: s[0])[1]
    for n, k, warps, stages in DOWN_CANDIDATES:
        cfg = replace(best, down_block_n=n, down_block_k=k, down_warps=warps, down_stages=stages)
        if cfg != best:
            scored.append((total(cfg), cfg))
    return min(scored, key=lambda s: s[0])[1]


def distinct_experts(block: SparseMoE, xs: list[torch.Tensor]) -> float:
    with torch.inference_mode():
        counts = []
        for x in xs:
            ids = torch.topk(torch.softmax(block.gate(x).float(), -1), block.spec.top_k, dim=-1).indices
            counts.append(ids.unique().numel())
    return sum(counts) / len(counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--paths", nargs="+", default=["small", "tiled", "grouped"], choices=CAPTURABLE,
                        help="SparseMoE.force_path values to time, each its own row")
    parser.add_argument("--copies", type=int, default=3, help="weight copies per block (L2 misses)")
    parser.add_argument("--sweep", type=int, nargs="*", default=[],
                        help="batches at which to search the tiled kernels' tiles first (none: the defaults)")
    parser.add_argument("--eager", action="store_true",
                        help="also time eager calls, as a prefill runs them: host us to launch one, wall us per call")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_micro needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    peak = copy_gbps(device)
    rows, tops, picked = [], {}, {}
    t0 = time.monotonic()
    default = moe_tiled.DEFAULT
    for name, spec in specs().items():
        blocks = [build(spec, device, seed) for seed in range(args.copies)]
        moe_tiled.DEFAULT = default
        if args.sweep:
            # the block rows below then run the best tiles (tiled_config reads DEFAULT)
            moe_tiled.DEFAULT = sweep_tiled(name, spec, blocks, args.sweep, rows)
        picked[name] = asdict(moe_tiled.tiled_config(spec.hidden_size, spec.intermediate_size))
        print(name, "tiled config", picked[name], flush=True)
        for batch in args.batches:
            gen = torch.Generator(device=device).manual_seed(batch)
            xs = [torch.randn(batch, spec.hidden_size, device=device, dtype=torch.bfloat16, generator=gen)
                  for _ in range(INPUTS)]
            experts = distinct_experts(blocks[0], xs)
            moved = experts * expert_bytes(spec) + 2 * spec.hidden_size * spec.num_experts
            if spec.shared_intermediate_size:
                moved += 2 * 3 * spec.hidden_size * spec.shared_intermediate_size
            for path in args.paths:
                for b in blocks:
                    b.force_path = path
                us = time_block(blocks, xs)
                gbps = moved / (us / 1e6) / 1e9
                row = {"block": name, "path": path, "batch": batch, "us": round(us, 2), "experts": round(experts, 1),
                       "mb_read": round(moved / 1e6, 1), "gb_per_s": round(gbps, 1),
                       "pct_copy": round(100 * gbps / peak, 1)}
                if args.eager:
                    row["eager_host_us"], row["eager_us"] = time_eager(blocks, xs)
                rows.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                if batch in (1, 16, 32):
                    with torch.inference_mode():
                        tops[f"{name}_{path}_b{batch}"] = profile_calls(lambda b=blocks[0], x=xs[0]: b(x), device,
                                                                        calls=10, top=10)
        del blocks
        torch.cuda.empty_cache()
    report = {"command": "python3 benchmarks/moe_micro.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "host": platform.node(), "copy_gbps": round(peak, 1), "tiled_config": picked, "rows": rows,
              "kernels": tops,
              "seconds": round(time.monotonic() - t0, 1)}
    for key, prof in tops.items():
        print(key, prof["kernel_ms"], "ms", [(t["name"][:60], t["ms"], t["count"]) for t in prof["top"][:6]])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
