"""Where a decode step's time goes: host phases, graph replay on the GPU, and the GPU kernels by name.

Same model as benchmarks/decode_step.py (Orpheus-3B shape, bf16, dummy weights). For each batch size:
- host phases of `engine.step()` (schedule, prepare + graph launch, sample + the host sync, results),
  averaged over --steps decode steps;
- GPU time of one graph replay alone (CUDA events over 50 back-to-back replays);
and, at batch 1, the top GPU kernels of one decode step under torch.profiler (eager forward, same kernels).
The skinny-GEMM choices made are listed too. With --pdl both, everything is profiled with Programmatic Dependent Launch of the Triton kernels off,
then on (mstar/kernels/pdl.py; the skinny-GEMM choices are re-timed for each, as a fresh process with
that MSTAR_PDL would); --pdl off / on forces one; the default follows MSTAR_PDL (auto: on for sm_90+).
--speakable-span restricts the head to Orpheus' speakable span, as the served model does; with
--frame-places, each setting (1: also the frame-place windows, `OrpheusTokens.place_windows`, as served
by default; 0: the span alone) gets its own engine and graphs, in the order given.
With --attention-preload, each setting (1: each decode-attention program reads its first block of cached
keys and values before its PDL wait, `mstar/kernels/decode_attention.py` PRELOAD; 0: after) gets its own
engine and graphs, in the order given (repeat one to see the run-to-run spread).

    python3 benchmarks/profile_decode.py [--batch-sizes 1 16 64]
        [--pdl {env,off,on,both}] [--speakable-span] [--attention-preload 0 1 0 1]
        [--frame-places 0 1 0 1]
        [--out benchmarks/results/profile_decode_h200.json]

Measures, asserts nothing. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_step import ORPHEUS_3B, make_engine  # noqa: E402
from mstar.engines.autoregressive import engine as engine_module  # noqa: E402
from mstar.engines.base import LoopSpec, StepItem  # noqa: E402
from mstar.kernels.decode_attention import PRELOAD  # noqa: E402
from mstar.kernels.pdl import PDL  # noqa: E402
from mstar.layers.linear import SKINNY  # noqa: E402
from mstar.models.common.loading import fill_dummy_weights  # noqa: E402
from mstar.models.llama.config import LlamaConfig  # noqa: E402
from mstar.models.llama.model import build_model  # noqa: E402
from mstar.models.orpheus.head import SpanHeadLM  # noqa: E402
from mstar.models.orpheus.tokens import OrpheusTokens  # noqa: E402

# --pdl -> the PDL.mode values profiled one after another (None: as MSTAR_PDL sets it)
PDL_MODES = {"env": (None,), "off": (False,), "on": (True,), "both": (False, True)}


class PhaseTimer:
    """Wraps callables to add their wall time to named totals."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - t0
        return timed


def host_phases(engine, bs: int, steps: int, vocab: int) -> dict:
    options = {"temperature": 0.0, "ignore_eos": True, "max_tokens": steps + 8}
    g = torch.Generator().manual_seed(bs)
    for i in range(bs):
        engine.submit(StepItem(f"p{bs}-{i}", "gen", "llm", {"input_ids": torch.randint(0, vocab, (64,), generator=g)},
                               options, loop=LoopSpec(steps + 8)))
    results = []
    while len(results) < bs:
        results += engine.step()
    timer = PhaseTimer()
    sched, runner = engine.batch_scheduler, engine.runner
    saved = (sched.schedule, runner.run, engine_module.sample, engine._postprocess)
    sched.schedule = timer.wrap("schedule", sched.schedule)
    runner.run = timer.wrap("prepare_and_launch", runner.run)
    engine_module.sample = timer.wrap("sample_launch", engine_module.sample)
    engine._postprocess = timer.wrap("sample_sync_and_results", engine._postprocess)
    total = 0.0
    try:
        for _ in range(steps):  # each request an engine loop, as the decode walk runs: no items to submit
            t0 = time.perf_counter()
            results = engine.step()
            total += time.perf_counter() - t0
    finally:
        sched.schedule, runner.run, engine_module.sample, engine._postprocess = saved
    for r in results:
        engine.release(r.request_id)
    phases = {k: round(1e3 * v / steps, 4) for k, v in timer.totals.items()}
    phases["step_total"] = round(1e3 * total / steps, 4)
    return phases


def replay_ms(engine, bs: int) -> float:
    graphs = engine.runner.graphs
    bucket = graphs.bucket(bs)
    captured = graphs._graphs[bucket]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        captured.graph.replay()
    start.record()
    for _ in range(50):
        captured.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50


def kernel_table(engine, model, top: int = 25) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    ids = torch.zeros(1, dtype=torch.long, device="cuda")
    pos = torch.full((1,), 100, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            model.compute_logits(model.forward(ids, pos, engine.runner.attn), ids)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.compute_logits(model.forward(ids, pos, engine.runner.attn), ids)
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += event.device_time
            totals[event.name][1] += 1
    rows = sorted(({"kernel": k[:90], "us": round(v[0], 1), "count": v[1]} for k, v in totals.items()),
                  key=lambda r: -r["us"])
    return [{"kernel": "ALL", "us": round(sum(r["us"] for r in rows), 1), "count": sum(r["count"] for r in rows)}] + \
        rows[:top]


def set_pdl(mode: bool | None) -> None:
    """PDL on (True) or off (False) for the next engine built; None keeps MSTAR_PDL's choice. A change
    drops the skinny-GEMM choices so that they are timed again under the new launch mode."""
    if mode is not None and mode != PDL.mode:
        PDL.mode = mode
        SKINNY.decisions.clear()


def profile_engine(model, config, args) -> dict:
    """Host phases and graph replay per batch size, then the batch-1 kernel table, of a fresh engine."""
    max_len = args.max_model_len or 64 + args.steps + 16  # sets max_pages_per_seq, hence the KV splits
    engine = make_engine(model, torch.device("cuda"), max(args.batch_sizes), max_len, "auto", True)
    rows = []
    for bs in args.batch_sizes:
        row = {"batch": bs, "host_ms": host_phases(engine, bs, args.steps, config.vocab_size),
               "graph_replay_gpu_ms": round(replay_ms(engine, bs), 4)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    engine.runner.attn.prepare(_decode_meta(1))
    kernels = kernel_table(engine, model)
    for k in kernels:
        print(json.dumps(k))
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return {"pdl": PDL.enabled(torch.device("cuda")), "rows": rows,
            "kernels_batch1_eager": kernels}


def skinny_choices() -> list[dict]:
    """Every skinny-GEMM decision taken so far: (kind, M bucket, N, K) -> the Triton kernel or not."""
    return [{"shape": [str(part) for part in key[:-1]], "triton": chosen} for key, chosen in SKINNY.decisions.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pdl", choices=sorted(PDL_MODES), default="env",
                        help="Programmatic Dependent Launch: as MSTAR_PDL sets it (env), off, on, or both in turn")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="engine context limit (default: just what the run needs); decode splits KV by it")
    parser.add_argument("--speakable-span", action="store_true",
                        help="the head reads Orpheus' speakable span only, as served (model_kwargs.audio_logits_only)")
    parser.add_argument("--frame-places", type=int, nargs="+", choices=(0, 1), default=None,
                        help="with --speakable-span: the head without (0) and with (1) Orpheus' frame-place windows "
                             "(model_kwargs.frame_place_logits), one engine each")
    parser.add_argument("--attention-preload", type=int, nargs="+", choices=(0, 1), default=None,
                        help="decode-attention preload settings to compare (0 off, 1 on), one engine each")
    parser.add_argument("--out", default="benchmarks/results/profile_decode_h200.json")
    args = parser.parse_args()
    config = LlamaConfig.from_hf(ORPHEUS_3B)
    lm = build_model(config, torch.bfloat16, torch.device("cuda"))
    fill_dummy_weights(lm, seed=0)
    tokens = OrpheusTokens()
    model = lm
    if args.speakable_span:
        model = SpanHeadLM(lm, tokens.speakable_span, blocked=tokens.span_markers)
    elif args.frame_places:
        parser.error("--frame-places needs --speakable-span")
    result = {"benchmark": "profile_decode", "command": "python3 " + " ".join(sys.argv),
              "device": torch.cuda.get_device_name()}
    modes = PDL_MODES[args.pdl]
    if args.frame_places:
        set_pdl(modes[0])
        result["variants"] = {}
        for on in args.frame_places:
            windows = tokens.place_windows(config.vocab_size) if on else None
            model = SpanHeadLM(lm, tokens.speakable_span, blocked=tokens.span_markers, windows=windows)
            label = f"frame_places={on}"
            runs = sum(key.startswith(label) for key in result["variants"])
            label += f" (run {runs + 1})" if runs else ""
            print(json.dumps({"variant": label}), flush=True)
            result["variants"][label] = profile_engine(model, config, args)
    elif args.attention_preload:
        set_pdl(modes[0])
        result["variants"] = {}
        for on in args.attention_preload:
            PRELOAD.on = bool(on)
            label = f"attention_preload={on}"
            runs = sum(key.startswith(label) for key in result["variants"])
            label += f" (run {runs + 1})" if runs else ""
            print(json.dumps({"variant": label}), flush=True)
            result["variants"][label] = profile_engine(model, config, args)
    elif len(modes) == 1:
        set_pdl(modes[0])
        result.update(profile_engine(model, config, args))
        result["skinny_choices"] = skinny_choices()
    else:
        result["variants"] = {}
        for pdl in modes:
            set_pdl(pdl)
            label = f"pdl={'on' if pdl else 'off'}"
            print(json.dumps({"variant": label}), flush=True)
            result["variants"][label] = profile_engine(model, config, args)
            result["variants"][label]["skinny_choices"] = skinny_choices()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _decode_meta(bs: int):
    from mstar.engines.attention.base import AttentionMetadata

    return AttentionMetadata([1] * bs, [101] * bs, torch.full((bs,), -1, dtype=torch.long),
                             torch.arange(7, dtype=torch.int32).repeat(bs, 1))


if __name__ == "__main__":
    main()
