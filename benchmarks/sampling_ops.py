"""Count (not assert) the operators one `sample()` call runs, Orpheus-shaped, with torch.profiler.

Rows: temperature 0.6, top_p 0.8, repetition_penalty 1.3 over a 156,940-token vocabulary, each with
a 64-token prompt and `--generated` output tokens (the serving case of Orpheus). On CPU the count of
top-level aten operators stands for the kernels a GPU would launch; `--device cuda` also counts the
CUDA kernels and the host->device copies that synchronise (`torch.tensor(..., device=cuda)`).

    python3 benchmarks/sampling_ops.py --batch 1 8 --out benchmarks/results/sampling_ops.json
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

from mstar.engines.sampling import SamplingParams, SamplingRow, sample  # noqa: E402

VOCAB = 156_940
# operators that allocate or re-view on the host and launch no kernel on a GPU
_HOST_ONLY = {"aten::empty", "aten::empty_like", "aten::detach_", "aten::lift_fresh", "aten::unsqueeze", "aten::view",
              "aten::slice", "aten::select", "aten::reshape", "aten::expand", "aten::as_strided", "aten::pin_memory",
              "aten::_to_copy", "aten::alias", "aten::narrow", "aten::t", "aten::empty_strided"}
ORPHEUS = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3)


def _rows(batch: int, generated: int, caches: list[dict]) -> list[SamplingRow]:
    gen = torch.Generator().manual_seed(0)
    return [SamplingRow(ORPHEUS, torch.randint(0, VOCAB, (64 + generated,), generator=gen).tolist(), 64,
                        cache=caches[i]) for i in range(batch)]


def count(batch: int, generated: int, device: str) -> dict:
    """Operators of one steady-state call (the rows' caches warmed by two earlier calls)."""
    from torch.profiler import ProfilerActivity, profile

    logits = torch.randn(batch, VOCAB, device=device) * 3
    caches: list[dict] = [{} for _ in range(batch)]
    for extra in (0, 1):  # warm the per-row caches as a running decode would
        sample(logits, _rows(batch, generated + extra, caches))
    rows = _rows(batch, generated + 2, caches)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        sample(logits, rows)
    events = prof.events()
    top = [e for e in events if e.name.startswith("aten::") and e.cpu_parent is None]
    names: dict[str, int] = {}
    for e in top:
        names[e.name] = names.get(e.name, 0) + 1
    launches = sum(n for k, n in names.items() if k not in _HOST_ONLY)
    out = {"batch": batch, "top_level_aten_ops": len(top), "device_ops": launches, "ops": dict(sorted(names.items()))}
    if device == "cuda":
        out["cuda_kernels"] = sum(1 for e in events if e.device_type.name == "CUDA")
        out["stream_syncs"] = sum(1 for e in events if "Synchronize" in e.name)
    t0 = time.perf_counter()
    for _ in range(5):
        sample(logits, rows)
    if device == "cuda":
        torch.cuda.synchronize()
    out["ms_per_call"] = round((time.perf_counter() - t0) / 5 * 1e3, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--generated", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [count(b, args.generated, args.device) for b in args.batch]
    for r in results:
        sys.stdout.write(f"batch {r['batch']}: {r['top_level_aten_ops']} top-level ops ({r['device_ops']} device ops), {r['ms_per_call']} ms/call"
                         + (f", {r['cuda_kernels']} CUDA kernels, {r['stream_syncs']} syncs" if "cuda_kernels" in r
                            else "") + f"\n  {r['ops']}\n")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python3 " + " ".join(sys.argv), "device": args.device,
                                              "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
