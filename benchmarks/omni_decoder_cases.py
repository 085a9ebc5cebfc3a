"""Profile cases of Qwen3-Omni's autoregressive components (thinker, talker) through the real engine.

Each case starts `batch` sequences with a prompt, then feeds every result back as the next item, as the
worker does (host token ids; a talker item also brings its input embedding on the device and 3-row
positions on the host, as talker_input makes them), and times the decode steps:

- `submit_ms`: host time of submitting one step's items (the talker's `device_positions` case includes
  the host read of its device positions in TokenInputs._add_positions);
- `step_ms`: host time of `engine.step()` (schedule, launch, the sync on sampled ids, results);
- `wall_ms`: both, per decode step; `forward_gpu_ms`: the captured decode graph of that batch replayed
  back to back (CUDA events), so `wall_ms - forward_gpu_ms` is host time the GPU waits;
- `paths`: how the steps ran (plain graph replay, extras graph replay, the extras graph launched a step ahead,
  eager with extras, lookahead hits).
`frame_loop` runs the talker lane's loop for real: code predictor -> talker_input -> talker step per frame.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.call_timing import PeakMemory, profile_calls, sync
from mstar.engines.base import LoopSpec, StepItem, StepResult
from mstar.models.qwen3_omni.options import CODE_PREDICTOR_DEFAULTS, TALKER_DEFAULTS


def make_engine(built, device: torch.device, pages: int, sizes: list[int]):
    """The engine the server makes for an autoregressive component, with a small KV pool and graphs at `sizes`."""
    from mstar.config import CudaGraphConfig, KVCacheConfig
    from mstar.engines.autoregressive import build_autoregressive_engine

    kv = KVCacheConfig(max_num_pages=pages, page_size=16)
    # built.engine.own_stream is not applied: the engine runs alone here, beside no other
    return build_autoregressive_engine(built.module, built.engine, kv, device,
                                       CudaGraphConfig(batch_sizes=sizes))


def count_paths(engine) -> dict[str, int]:
    """Counters of the runner's decode paths, updated as the engine runs (instance-level wrappers)."""
    runner, counts = engine.runner, {"plain_graph": 0, "extras_graph": 0, "extras_ahead": 0, "eager_extras": 0}
    for attr, key in (("_replay", "plain_graph"), ("_replay_extras", "extras_graph"),
                      ("_extras_ahead", "extras_ahead"), ("_run_with_extras", "eager_extras")):
        real = getattr(runner, attr)

        def wrapped(*args, _real=real, _key=key):
            counts[_key] += 1
            return _real(*args)
        setattr(runner, attr, wrapped)
    return counts


def thinker_items(engine, batch: int, prompt_len: int, extras_layers: tuple[int, ...] | None):
    """(first items, None) of a thinker decode: text prompt, greedy, `return_hidden` when the answer is
    spoken (`extras_layers`: the layers the talker reads); each item an engine loop, as the decode walk runs."""
    options: dict[str, Any] = {"temperature": 0.0, "max_tokens": None, "ignore_eos": True}
    if extras_layers:
        options["return_hidden"] = list(extras_layers)
    prompt = torch.arange(prompt_len, dtype=torch.long) % 1000 + 100
    first = [StepItem(f"t{i}", "decode", "thinker", {"input_ids": prompt}, options, loop=LoopSpec(1 << 30))
             for i in range(batch)]
    return first, None


def talker_options() -> dict[str, Any]:
    """The talker's scoped options in a spoken answer (served defaults, never stopping)."""
    opts = {k.removeprefix("talker."): v for k, v in TALKER_DEFAULTS.items()}
    return {**opts, "max_tokens": None, "ignore_eos": True}


def talker_items(engine, batch: int, prompt_len: int, device: torch.device, device_positions: bool = False):
    """(first items, next-item function) of a talker decode fed embeddings and 3-row positions: on the host
    as talker_input hands them over, or (`device_positions`) on the device, as it used to (the engine then
    reads them back: a host sync per item)."""
    model = engine.runner.model
    h, dtype, pad = model.hidden_size, model.kv_layout.dtype, 0
    options = talker_options()
    where = device if device_positions else "cpu"
    embeds = [torch.randn(prompt_len, h, device=device, dtype=dtype) for _ in range(batch)]
    pos = torch.arange(prompt_len, device=where).expand(3, -1).contiguous()
    first = [StepItem(f"k{i}", "talk", "talker", {"input_ids": torch.full((prompt_len,), pad), "input_embeds": e,
                                                   "positions": pos}, options) for i, e in enumerate(embeds)]
    step_embed = torch.randn(1, h, device=device, dtype=dtype)

    def after(r: StepResult, step: int) -> StepItem:
        # talker_input's position: the previous one + 1 (the prompt's max + frame index)
        p = torch.full((3, 1), prompt_len - 1 + step, dtype=torch.long, device=where)
        return StepItem(r.request_id, "talk", "talker", {"input_ids": r.outputs["token"], "input_embeds": step_embed,
                                                         "positions": p}, options, iteration=step)
    return first, after


def run_decode(engine, first: list[StepItem], after: Callable[[StepResult, int], StepItem] | None, steps: int,
               warmup: int = 3) -> dict[str, Any]:
    """Prefill `first`, then `warmup` + `steps` decode steps feeding each result back (`after`; None: the
    items are engine loops, which feed themselves); per-step host times."""
    counts = count_paths(engine)
    for item in first:
        engine.submit(item)
    results = _drain(engine, len(first))
    submit, step = [], []
    with PeakMemory(engine.device) as mem:
        for k in range(warmup + steps):
            if k == warmup:
                counts.update(dict.fromkeys(counts, 0))
                engine.lookahead_steps = 0
            t0 = time.perf_counter()
            for r in results if after is not None else ():
                engine.submit(after(r, k + 1))
            t1 = time.perf_counter()
            results = engine.step()
            t2 = time.perf_counter()
            assert len(results) == len(first), f"a decode step returned {len(results)} of {len(first)} results"
            if k >= warmup:
                submit.append((t1 - t0) * 1e3)
                step.append((t2 - t1) * 1e3)
    for item in first:
        engine.release(item.request_id)
    out = {"submit_ms": _mean(submit), "step_ms": _mean(step), "wall_ms": _mean([a + b for a, b in zip(submit, step)]),
           "paths": {**counts, "lookahead_steps": engine.lookahead_steps}, "peak_gib": mem.peak_gib}
    out.update(graph_gpu(engine, len(first), extras=counts["extras_graph"] > 0))
    out["host_overhead_ms"] = (round(out["wall_ms"] - out["forward_gpu_ms"], 3)
                               if out.get("forward_gpu_ms") is not None else None)
    return out


def graph_gpu(engine, batch: int, extras: bool, replays: int = 20, kernels: bool = False) -> dict[str, Any]:
    """GPU ms of the captured decode graph that holds `batch` (replayed back to back on the last step's
    attention metadata), and optionally its kernels; nothing on CPU or when no graph holds the batch."""
    runner = engine.runner
    graphs = runner.extras_graphs.graphs if extras and runner.extras_graphs is not None else runner.graphs
    bucket = graphs.bucket(batch) if graphs is not None else None
    if bucket is None:
        return {"forward_gpu_ms": None}
    captured = graphs._graphs[bucket]  # noqa: SLF001  (a benchmark reads the captured graph directly)
    device = engine.device
    sync(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        captured.graph.replay()
    end.record()
    sync(device)
    out: dict[str, Any] = {"forward_gpu_ms": round(begin.elapsed_time(end) / replays, 3), "graph_bucket": bucket}
    if kernels:
        out["kernels"] = profile_calls(captured.graph.replay, device, 5, top=10)
    return out


def frame_loop(talker_engine, predictor, talker_input, batch: int, steps: int, device: torch.device,
               warmup: int = 3) -> dict[str, Any]:
    """The talk loop per frame, for real: code predictor -> talker_input -> talker submit -> talker step.

    Inputs travel as the worker hands them over: the talker's host token ids and talker_input's host
    loop-backs (frame index, text-ended flag, position) stay on the host (both components read host
    inputs), the embeddings on the device."""
    first, _ = talker_items(talker_engine, batch, 16, device)
    for item in first:
        talker_engine.submit(item)
    results = _drain(talker_engine, batch)
    opts = {**CODE_PREDICTOR_DEFAULTS, "voice": "Ethan"}
    t_opts = talker_options()
    ht = talker_input.config.thinker_hidden_size
    text = torch.randn(2, 1, ht, device=device, dtype=talker_input.tts_rows.dtype)
    positions = torch.arange(16, device=device).expand(3, -1).contiguous()
    no_frame = {"codec_embed_sum": torch.zeros(talker_engine.runner.model.hidden_size, device=device,
                                               dtype=talker_input.tts_rows.dtype)}  # a sampled codec EOS
    parts: dict[str, list[float]] = {"code_predictor": [], "talker_input": [], "talker_submit": [], "talker_step": []}
    loops = [{"frame_index": torch.tensor(0), "text_ended": torch.tensor(False), "talker_pos": positions.cpu()}
             for _ in results]
    for k in range(warmup + steps):
        marks = [time.perf_counter()]
        firsts = [r.outputs["token"] for r in results]
        pred = predictor.run_batch("talk", "code_predictor", [
            {"talker_hidden": r.outputs["hidden"], "first_code": f, "frame_index": loop["frame_index"]}
            for r, f, loop in zip(results, firsts, loops)], [opts] * batch)
        marks.append(time.perf_counter())
        ins = talker_input.run_batch("talk", "talker_input", [
            {"thinker_states": text, "prompt_ids": positions[0], "talker_positions": positions, "first_code": f,
             "codec_embed_sum": p["codec_embed_sum"], **loop}
            for f, loop, p in zip(firsts, loops, [p or no_frame for p in pred])], [opts] * batch)
        marks.append(time.perf_counter())
        for loop, x in zip(loops, ins):
            loop.update({key: x[key] for key in ("frame_index", "text_ended", "talker_pos")})
        for r, x in zip(results, ins):
            talker_engine.submit(StepItem(r.request_id, "talk", "talker", {
                "input_ids": x["talker_ids"], "input_embeds": x["talker_embeds"], "positions": x["talker_pos"]},
                t_opts, iteration=k + 1))
        marks.append(time.perf_counter())
        results = talker_engine.step()
        marks.append(time.perf_counter())
        if k >= warmup:
            for name, a, b in zip(parts, marks, marks[1:]):
                parts[name].append((b - a) * 1e3)
    for item in first:
        talker_engine.release(item.request_id)
    split = {name: _mean(v) for name, v in parts.items()}
    return {"frame_ms": round(sum(split.values()), 3), "host_ms_split": split}


def _drain(engine, count: int, limit: int = 64) -> list[StepResult]:
    """Step until `count` results arrived (a prefill may take several steps); errors raise."""
    results: list[StepResult] = []
    for _ in range(limit):
        for r in engine.step():
            if r.error is not None:
                raise RuntimeError(f"{r.request_id}: {r.error}")
            results.append(r)
        if len(results) >= count:
            return results
    raise RuntimeError(f"only {len(results)} of {count} prefills finished in {limit} steps")


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 3) if values else 0.0
