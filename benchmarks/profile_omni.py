"""Where a Qwen3-Omni spoken answer spends its time, per component, at full size (profiles, asserts nothing).

Every component is built as the server builds it (`builders.build_component`, the full 30B-A3B config of
full.py with dummy bf16 weights; the thinker and talker inside the server's autoregressive engine with a
small KV pool and decode graphs at the measured batch sizes), then timed alone at each batch:

- code2wav: run_batch as served (padded, CUDA graphs: `served_graphs`), then eagerly: the first chunk (25
  frames, no context) and a steady chunk (25 new + 25 left context frames); variants: chunks padded to one
  width, bf16 / float32, cudnn.benchmark on, cuDNN off (benchmarks/code2wav_bench.py is the short one);
  first and second call at lengths never run before (a request's last chunk); the builder's warm-up time
  (`components.code2wav.warm_up_s`: the one-off cost a first request paid before); GPU ms per stage;
  top kernels and categories;
- code_predictor: run_batch through its captured graphs (as served) vs eager, sampled and greedy; top kernels;
  the host cost of its sampling tensors;
- talker_input: run_batch of a decode iteration (and of the prompt iteration);
- talker: decode steps with extras (input embedding, 3-row positions on the host as talker_input hands them,
  final hidden state), and with the positions on the device (the cost of TokenInputs._add_positions reading
  them back, as the talker did before);
  `frame_loop`: code predictor -> talker_input -> talker step per frame, as the talk walk runs them;
- thinker: plain decode steps and spoken-answer ones (return_hidden: extras graph).
Per case: host ms per call, GPU ms (CUDA events, back to back), wall ms, first call, peak memory above the
component's weights; build time and weight size per component. See call_timing.py, omni_codec_cases.py,
omni_decoder_cases.py for the exact definitions.

    python3 benchmarks/profile_omni.py                       # H200, full size (<= 240 s)
    python3 benchmarks/profile_omni.py --components code2wav code_predictor
    python3 benchmarks/profile_omni.py --quick               # CPU, tiny config (smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from benchmarks import omni_codec_cases as codec  # noqa: E402
from benchmarks import omni_decoder_cases as dec  # noqa: E402
from benchmarks.call_timing import PeakMemory, module_gib  # noqa: E402
from benchmarks.profile_omni_report import print_table  # noqa: E402
from benchmarks.results_io import write_results  # noqa: E402

logger = logging.getLogger(__name__)

COMPONENTS = ("code2wav", "code_predictor", "talker_input", "talker", "thinker")  # code2wav first: cold start
DEFAULT_OUT = ROOT / "benchmarks/results/profile_omni_h200.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny config on CPU (smoke test)")
    parser.add_argument("--components", nargs="+", default=list(COMPONENTS), metavar="NAME",
                        help=f"subset to profile, from {list(COMPONENTS)} (frame_loop needs talker, "
                             "code_predictor and talker_input)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (1 8 16; --quick: 1 2)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps per case (20; --quick: 3)")
    parser.add_argument("--calls", type=int, default=None, help="calls per stateless case (10; --quick: 2)")
    parser.add_argument("--prompt-len", type=int, default=32, help="thinker prompt tokens per sequence")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu (--quick: cpu)")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also run N frames of the talk loop at the largest batch under cProfile: the "
                             "host functions by own and by cumulative time go into the JSON (frame_loop_cprofile)")
    parser.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT.relative_to(ROOT)}; "
                                                    "--quick: none)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.components) - set(COMPONENTS))
    if unknown:
        parser.error(f"unknown --components {unknown}; choose from {list(COMPONENTS)}")
    quick = args.quick
    args.batches = sorted(set(args.batches or ([1, 2] if quick else [1, 8, 16])))
    if args.batches[0] < 1:
        parser.error(f"--batches {args.batches}: batch sizes must be >= 1")
    args.steps = args.steps or (3 if quick else 20)
    args.calls = args.calls or (2 if quick else 10)
    args.device = torch.device(args.device or ("cpu" if quick else "cuda"))
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --quick (tiny, CPU) or --device cpu")
    return args


def open_model(quick: bool):
    """(serve config, checkpoint) of the tiny model, or of the full-size one with dummy weights."""
    from mstar.models.qwen3_omni.checkpoint import OmniCheckpoint
    from mstar.models.qwen3_omni.model import Qwen3Omni

    cfg = Qwen3Omni.make_config(tiny=quick)
    return cfg, OmniCheckpoint.open(cfg, None, "dummy")


def build(ckpt, cfg, name: str, device: torch.device, info: dict[str, Any]):
    """`build_component` of `name`, its build time, weight size and build peak recorded in `info`."""
    from mstar.engines.base import StatelessSpec
    from mstar.engines.stateless import capture_step_graphs
    from mstar.models.qwen3_omni.builders import build_component

    t0 = time.perf_counter()
    with PeakMemory(device) as mem, _timed_warm_up() as warm:
        built = build_component(ckpt, cfg, name, device)
        if device.type == "cuda" and isinstance(built.engine, StatelessSpec):  # as its engine captures them
            t1 = time.perf_counter()
            capture_step_graphs(built.module, built.engine.graph_sizes(), device)
            codec.sync(device)
            warm.append(time.perf_counter() - t1)
    info[name] = {"build_s": round(time.perf_counter() - t0, 2), "weights_gib": module_gib(built.module),
                  "build_peak_gib": mem.peak_gib}
    if warm:  # warm-up or graph capture: one-off costs paid before the server is ready
        info[name]["warm_up_s"] = round(sum(warm), 3)
    return built


@contextlib.contextmanager
def _timed_warm_up() -> Iterator[list[float]]:
    """Seconds of each `Code2Wav.warm_up` call (synced) inside the block."""
    from mstar.models.qwen3_omni.code2wav import Code2Wav

    spent: list[float] = []
    reals = {"warm_up": Code2Wav.warm_up}

    def timer(real):
        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            real(self, *args, **kwargs)
            codec.sync(self.code_offset.device)
            spent.append(time.perf_counter() - t0)
        return timed
    for name, real in reals.items():
        setattr(Code2Wav, name, timer(real))
    try:
        yield spent
    finally:
        for name, real in reals.items():
            setattr(Code2Wav, name, real)


def make_engine(built, name: str, device: torch.device, args, info: dict[str, Any]):
    """The component's autoregressive engine (graphs captured, warmed up); time and memory recorded."""
    pages = max(args.batches) * -(-(args.prompt_len + 3 * args.steps + 64) // 16) + 64
    t0 = time.perf_counter()
    with PeakMemory(device) as mem:
        engine = dec.make_engine(built, device, pages, args.batches)
    info[name].update(engine_s=round(time.perf_counter() - t0, 2), engine_held_gib=mem.held_gib, kv_pages=pages)
    return engine


def run(args) -> dict[str, Any]:
    """Every requested component's cases; the JSON document (without the command line)."""
    device = args.device
    cfg, ckpt = open_model(args.quick)
    wanted = [c for c in COMPONENTS if c in args.components]
    built: dict[str, Any] = {}
    info: dict[str, Any] = {}
    cases: dict[str, Any] = {}
    phases: dict[str, float] = {}
    if device.type == "cuda":  # cuBLAS is up in a server before Code2Wav's first call: leave it out of cold
        torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)
    for name in wanted:
        t0 = time.perf_counter()
        try:
            cases[name] = _profile_one(name, ckpt, cfg, device, args, built, info)
        except Exception as e:  # one component's failure must not lose the others' numbers
            logger.exception("profiling %s failed", name)
            cases[name] = {"error": f"{type(e).__name__}: {e}"}
        phases[name] = round(time.perf_counter() - t0, 2)
        logger.info("%s done in %.1f s", name, phases[name])
    if {"talker", "code_predictor", "talker_input"} <= set(built):
        t0 = time.perf_counter()
        cases["frame_loop"] = _frame_loop(built, device, args)
        if args.cprofile:
            cases["frame_loop_cprofile"] = _frame_loop_cprofile(built, device, args)
        phases["frame_loop"] = round(time.perf_counter() - t0, 2)
    return {"device": _device_name(device), "torch": torch.__version__, "quick": args.quick,
            "batches": args.batches, "components": info, "cases": cases, "phase_s": phases,
            "cuda_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None}


def _profile_one(name: str, ckpt, cfg, device, args, built: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    component = build(ckpt, cfg, name, device, info)
    module, b, n = component.module, args.batches, args.calls
    if name == "code2wav":  # the builder warmed it up on CUDA (info: warm_up_s): the first call should be warm
        first = codec.code2wav_items(module, 1, cfg.code2wav_chunk, cfg.code2wav_chunk, device)
        codec.sync(device)  # making the inputs is not the call's
        t0 = time.perf_counter()
        module.run_batch("vocode", "code2wav", first, [{}])
        codec.sync(device)
        out = {"first_call_after_build_ms": round((time.perf_counter() - t0) * 1e3, 3)}
        return out | codec.profile_code2wav(module, device, b, n, cfg.code2wav_chunk, cfg.code2wav_left_context)
    if name == "code_predictor":
        built[name] = module
        return codec.profile_code_predictor(module, device, b, n)
    if name == "talker_input":
        built[name] = module
        return codec.profile_talker_input(module, device, b, n)
    engine = make_engine(component, name, device, args, info)
    del component
    if name == "talker":
        out = _talker_cases(engine, device, args)
        built[name] = engine
        return out
    out = _thinker_cases(engine, ckpt, device, args)
    del engine
    gc.collect()
    return out


def _frame_loop(built: dict[str, Any], device, args) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in args.batches:
        try:
            out[f"b{b}"] = dec.frame_loop(built["talker"], built["code_predictor"], built["talker_input"], b,
                                          args.steps, device)
        except Exception as e:  # keep the other numbers
            logger.exception("frame loop at batch %d failed", b)
            out[f"b{b}"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _frame_loop_cprofile(built: dict[str, Any], device, args, top: int = 45) -> dict[str, Any]:
    """The talk loop at the largest batch under cProfile (its host hot spots; times inflated by the profiler)."""
    import cProfile
    import io
    import pstats

    batch, prof = max(args.batches), cProfile.Profile()
    prof.enable()
    dec.frame_loop(built["talker"], built["code_predictor"], built["talker_input"], batch, args.cprofile, device,
                   warmup=0)
    prof.disable()
    out: dict[str, Any] = {"batch": batch, "frames": args.cprofile}
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(top)
        out[f"by_{key}"] = [line for line in text.getvalue().splitlines() if line.strip()][-top - 1:]
    return out


def _talker_cases(engine, device, args) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in args.batches:
        out[f"extras_b{b}"] = dec.run_decode(engine, *dec.talker_items(engine, b, 16, device), args.steps)
        out[f"extras_device_positions_b{b}"] = dec.run_decode(
            engine, *dec.talker_items(engine, b, 16, device, device_positions=True), args.steps)
    out["graph_kernels_b1"] = dec.graph_gpu(engine, 1, extras=True, kernels=True).get("kernels")
    return out


def _thinker_cases(engine, ckpt, device, args) -> dict[str, Any]:
    layers = (0, ckpt.omni.talker.accept_hidden_layer) if ckpt.omni.talker is not None else None
    out: dict[str, Any] = {}
    for b in args.batches:
        out[f"plain_b{b}"] = dec.run_decode(engine, *dec.thinker_items(engine, b, args.prompt_len, None), args.steps)
        out[f"extras_b{b}"] = dec.run_decode(engine, *dec.thinker_items(engine, b, args.prompt_len, layers),
                                             args.steps)
    out["graph_kernels_b1"] = dec.graph_gpu(engine, 1, extras=False, kernels=True).get("kernels")
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the table, write the JSON; returns the document."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    t0 = time.perf_counter()
    doc = run(args)
    doc["total_s"] = round(time.perf_counter() - t0, 1)
    doc["command"] = "python3 benchmarks/profile_omni.py " + " ".join(sys.argv[1:] if argv is None else argv)
    doc["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print_table(doc, sys.stdout)
    out = write_results(doc, args.out, args.quick, DEFAULT_OUT.stem)
    logger.info("wrote %s (%.1f s in all)", out or "no file (--quick)", doc["total_s"])
    return doc


if __name__ == "__main__":
    main()
