"""Qwen3-Omni's Code2Wav per chunk, as served and the ways it used to run (one GPU, < 2 minutes; asserts nothing).

The component is built as the server builds it (`builders.build_component`: the full-size config with
dummy bf16 weights; on CUDA chunks padded to chunk + left context frames and CUDA graphs captured per
batch size), then a call of `batch` steady chunks (25 new frames + 25 of left context) is timed at each
batch:

- `graphs`: run_batch as served (one graph replay);
- `engine`: the same through the stateless engine on its side stream, until the audio is on the host
  (pinned copies included), as the worker gets it (wall time only);
- `eager`: the padded width without graphs (the kernels one by one);
- `new_width`: eager calls at chunk lengths not run before (the unpadded server's last chunks, and every
  new batch size: cuDNN plans built while serving): first and second call.
Per case: ms per call (`wall_ms`, synced back-to-back calls; `gpu_ms`, CUDA events; `host_ms`), ms per
chunk, and audio seconds per second of the call (`audio_s_per_s`: batch * 25 frames * 80 ms / wall).
Also: build and capture time, the graphs' memory, GPU ms per stage (eager, batch 1).

    python3 benchmarks/code2wav_bench.py                    # H200 (writes benchmarks/results/code2wav_bench_h200.json)
    python3 benchmarks/code2wav_bench.py --batches 1 8 32 --calls 20
    python3 benchmarks/code2wav_bench.py --quick            # tiny config on CPU (smoke test)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from benchmarks.call_timing import PeakMemory, sync, time_calls  # noqa: E402
from benchmarks.omni_codec_cases import code2wav_items, code2wav_stages  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402
from mstar.engines.base import StepGraphs  # noqa: E402

logger = logging.getLogger(__name__)
DEFAULT_OUT = ROOT / "benchmarks/results/code2wav_bench_h200.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny config on CPU (smoke test)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="chunks per call")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per case (fewer when slow)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["engine", "eager", "new_width"],
                        help="cases to leave out")
    parser.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT.relative_to(ROOT)}; "
                                                    "--quick: none)")
    args = parser.parse_args(argv)
    args.device = torch.device("cpu" if args.quick else "cuda")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --quick (tiny, CPU)")
    if min(args.batches) < 1:
        parser.error(f"--batches {args.batches}: batch sizes must be >= 1")
    return args


def build(quick: bool, device: torch.device, batches: list[int]) -> tuple[Any, Any, dict[str, Any]]:
    """(serve config, Code2Wav as the server builds it, build info); graphs reach the largest batch."""
    from dataclasses import replace

    from mstar.engines.stateless import capture_step_graphs
    from mstar.models.qwen3_omni.builders import build_component
    from mstar.models.qwen3_omni.checkpoint import OmniCheckpoint
    from mstar.models.qwen3_omni.model import Qwen3Omni

    cfg = Qwen3Omni.make_config(tiny=quick)
    ckpt = OmniCheckpoint.open(cfg, None, "dummy")
    t0 = time.perf_counter()
    with PeakMemory(device) as mem:  # as with YAML `engines: {code2wav: {max_batch_size: max(batches)}}`
        built = build_component(ckpt, cfg, "code2wav", device,
                                lambda name, spec: replace(spec, max_batch_size=max(batches)))
        module = built.module
        if device.type == "cuda":  # as its stateless engine does when the server makes it
            capture_step_graphs(module, built.engine.graph_sizes(), device)
        sync(device)
    info = {"build_s": round(time.perf_counter() - t0, 2), "build_held_gib": mem.held_gib,
            "build_peak_gib": mem.peak_gib, "pad_frames": module.pad_frames,
            "graph_sizes": module.graphs.sizes("decode") if module.graphs else None,
            "dtype": str(module.code_embedding.weight.dtype)}
    return cfg, module, info


def per_call(timing: dict[str, Any], batch: int, new: int, frame_s: float) -> dict[str, Any]:
    """`timing` plus ms per chunk and audio seconds per second at its wall time."""
    wall = timing["wall_ms"]
    return {**timing, "ms_per_chunk": round(wall / batch, 3),
            "audio_s_per_s": round(batch * new * frame_s / (wall / 1e3), 2) if wall > 0 else None}


def engine_call(module, items: list[dict[str, torch.Tensor]]):
    """A function that runs `items` through a stateless engine (side stream on CUDA) until every result
    is out, as the worker's loop polls it."""
    from mstar.engines.base import StatelessSpec, StepItem
    from mstar.engines.stateless import StatelessEngine

    engine = StatelessEngine(module, StatelessSpec(max_batch_size=len(items)))

    def call() -> None:
        for i, x in enumerate(items):
            engine.submit(StepItem(f"r{i}", "vocode", "code2wav", x))
        done = 0
        while engine.has_work():
            done += len(engine.step())
        assert done == len(items)
    return call


def run(args) -> dict[str, Any]:
    device, skip = args.device, set(args.skip)
    cfg, module, info = build(args.quick, device, args.batches)
    chunk, context = cfg.code2wav_chunk, cfg.code2wav_left_context
    frame_s = module.cfg.samples_per_frame / 24000
    graphs = module.graphs
    cases: dict[str, Any] = {}
    for b in args.batches:
        items = code2wav_items(module, b, chunk + context, chunk, device)

        def call(items=items, b=b) -> None:
            module.run_batch("vocode", "code2wav", items, [{}] * b)
        row: dict[str, Any] = {}
        if graphs:
            row["graphs"] = per_call(time_calls(call, device, args.calls), b, chunk, frame_s)
        if "engine" not in skip:  # its kernels run on the engine's own stream: no default-stream GPU time
            timing = time_calls(engine_call(module, items), device, args.calls)
            row["engine"] = per_call({**timing, "gpu_ms": None}, b, chunk, frame_s)
        if "eager" not in skip:
            module.graphs = StepGraphs()
            try:
                row["eager"] = per_call(time_calls(call, device, args.calls), b, chunk, frame_s)
            finally:
                module.graphs = graphs
        cases[f"b{b}"] = row
    if "new_width" not in skip:
        cases["new_width"] = _new_widths(module, device, context, chunk)
    module.graphs = StepGraphs()
    cases["stages_b1_ms"] = code2wav_stages(module, torch.zeros(1, module.cfg.num_quantizers, chunk + context,
                                                                dtype=torch.long, device=device), device, 3)
    module.graphs = graphs
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
            "quick": args.quick, "chunk": chunk, "left_context": context, "build": info, "cases": cases}


def _new_widths(module, device: torch.device, context: int, chunk: int) -> list[dict[str, Any]]:
    """Synced ms of the first and second eager call at widths (and batch sizes) never run before."""
    graphs, pad = module.graphs, module.pad_frames
    module.graphs, module.pad_frames = StepGraphs(), 0
    out = []
    try:
        for frames, batch in ((context + 3, 1), (context + 5, 1), (context + chunk, 3)):
            items = code2wav_items(module, batch, frames, frames - context, device)
            row: dict[str, Any] = {"frames": frames, "batch": batch}
            for key in ("first_ms", "again_ms"):
                sync(device)
                t0 = time.perf_counter()
                module.run_batch("vocode", "code2wav", items, [{}] * batch)
                sync(device)
                row[key] = round((time.perf_counter() - t0) * 1e3, 3)
            out.append(row)
    finally:
        module.graphs, module.pad_frames = graphs, pad
    return out


def print_table(doc: dict[str, Any]) -> None:
    """One line per case and batch: wall / GPU / host ms per call, ms per chunk, audio s per s."""
    print(f"Code2Wav on {doc['device']} ({doc['build']['dtype']}), chunks of {doc['chunk']} new + "
          f"{doc['left_context']} context frames, build {doc['build']['build_s']} s")
    rows = [(f"{name} b{b[1:]}", case) for b, cases in doc["cases"].items() if b.startswith("b") and b[1:].isdigit()
            for name, case in cases.items()]
    print(f"{'case':<16}{'wall ms':>10}{'gpu ms':>10}{'host ms':>10}{'ms/chunk':>10}{'audio s/s':>11}")
    for name, c in rows:
        print(f"{name:<16}{c['wall_ms']:>10}{c['gpu_ms']!s:>10}{c['host_ms']:>10}{c['ms_per_chunk']:>10}"
              f"{c['audio_s_per_s']!s:>11}")
    for row in doc["cases"].get("new_width", []):
        print(f"new width {row['frames']} frames b{row['batch']}: first {row['first_ms']} ms, again {row['again_ms']} ms")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    t0 = time.perf_counter()
    doc = run(args)
    doc["total_s"] = round(time.perf_counter() - t0, 1)
    doc["command"] = "python3 benchmarks/code2wav_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    doc["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print_table(doc)
    out = write_results(doc, args.out, args.quick, DEFAULT_OUT.stem)
    logger.info("wrote %s (%.1f s in all)", out or "no file (--quick)", doc["total_s"])
    return doc


if __name__ == "__main__":
    main()
