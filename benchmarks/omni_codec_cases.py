"""Profile cases of Qwen3-Omni's stateless speech components: Code2Wav, the code predictor, talker_input.

Each component is called through `run_batch` with the inputs the worker hands it in a spoken answer
(host inputs stay on the host for the components that read them there: Code2Wav, talker_input, the code
predictor), so host syncs inside the call count. See profile_omni.py for the numbers each case reports.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.call_timing import PeakMemory, profile_calls, sync, time_calls
from mstar.engines.base import StepGraphs
from mstar.models.qwen3_omni.options import CODE_PREDICTOR_DEFAULTS


def measure(fn, device: torch.device, calls: int, kernels: bool = False) -> dict[str, Any]:
    """time_calls of `fn`, the peak memory it took, and (with `kernels`) its kernel profile."""
    with PeakMemory(device) as mem:
        out: dict[str, Any] = time_calls(fn, device, calls)
    out["peak_gib"] = mem.peak_gib
    if kernels:
        out["kernels"] = profile_calls(fn, device, min(max(out["calls"] // 2, 1), 5))
    return out


# -- Code2Wav --------------------------------------------------------------------------------------

def code2wav_items(module, batch: int, frames: int, new: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """`batch` chunk inputs of `frames` frames, the last `new` of them new, as the worker hands them over:
    codes on the device (the code predictor's), `codes_new` a host scalar (Code2Wav reads host inputs)."""
    cfg = module.cfg
    gen = torch.Generator(device).manual_seed(frames * 1000 + batch)
    return [{"codes": torch.randint(0, cfg.codebook_size, (frames, cfg.num_quantizers), device=device, generator=gen),
             "codes_new": torch.tensor(new)} for _ in range(batch)]


def code2wav_stages(module, codes: torch.Tensor, device: torch.device, repeats: int) -> dict[str, float]:
    """GPU ms per Code2Wav stage (CUDA events between stages; on CPU, host wall), mean over `repeats`."""
    import time

    names = ["embed+pre_transformer"] + [f"upsample{i}" for i in range(len(module.upsample))]
    names += [f"decoder{i}:{type(layer).__name__}" for i, layer in enumerate(module.decoder)]
    totals = dict.fromkeys(names, 0.0)
    with torch.no_grad():
        for _ in range(repeats):
            marks: list[Any] = []

            def mark(marks: list[Any] = marks) -> None:
                if device.type == "cuda":
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                    marks.append(ev)
                else:
                    marks.append(time.perf_counter())

            mark()
            x = module.pre_transformer(module.code_embedding(codes + module.code_offset).mean(dim=1)).transpose(1, 2)
            mark()
            for stage in module.upsample:
                x = stage(x)
                mark()
            for layer in module.decoder:
                x = layer(x)
                mark()
            sync(device)
            for name, a, b in zip(names, marks, marks[1:]):
                totals[name] += a.elapsed_time(b) if device.type == "cuda" else (b - a) * 1e3
    return {name: round(ms / repeats, 3) for name, ms in totals.items()}


# (name, float32?, cudnn.benchmark, cudnn enabled, all batches?, padded?); the first is the served setting
CODE2WAV_VARIANTS = (("bf16", False, False, True, True, False), ("bf16_padded", False, False, True, False, True),
                     ("bf16_cudnn_benchmark", False, True, True, False, False),
                     ("bf16_no_cudnn", False, False, False, False, False), ("float32", True, False, True, True, False),
                     ("float32_cudnn_benchmark", True, True, True, False, False))


def profile_code2wav(module, device: torch.device, batches: list[int], calls: int, chunk: int,
                     context: int, budget_s: float = 60.0) -> dict[str, Any]:
    """Code2Wav as served (first chunk; chunk + left context) and the variants of CODE2WAV_VARIANTS
    (chunks padded to one width, dtype, cuDNN autotuning, no cuDNN), each with first/second calls at lengths never run before (a
    request's last chunk) and a per-stage split; variants past `budget_s` are skipped."""
    import time

    deadline = time.perf_counter() + budget_s
    fresh = iter(range(context + 1, context + chunk))  # last-chunk lengths, each used once
    variants = CODE2WAV_VARIANTS if device.type == "cuda" else (("float32", True, False, True, True, False),
                                                                ("float32_padded", True, False, True, False, True))
    out: dict[str, Any] = {}
    graphs, served_pad = module.graphs, module.pad_frames
    if graphs:  # as served: padded, replayed from the graphs its engine captured
        with torch.no_grad():
            out["served_graphs"] = {f"chunk_b{b}": measure(
                lambda b=b, items=code2wav_items(module, b, chunk + context, chunk, device):
                module.run_batch("vocode", "code2wav", items, [{}] * b), device, calls) for b in batches}
    module.graphs = StepGraphs()  # the variants below run eagerly
    try:
        out.update(_code2wav_variants(module, device, batches, calls, chunk, context, variants, fresh, deadline,
                                      budget_s))
    finally:
        module.graphs, module.pad_frames = graphs, served_pad
    return out


def _code2wav_variants(module, device, batches, calls, chunk, context, variants, fresh, deadline,
                       budget_s) -> dict[str, Any]:
    import time

    out: dict[str, Any] = {}
    fp32 = None
    for name, as_fp32, bench, enabled, all_batches, padded in variants:
        if time.perf_counter() > deadline:
            out[name] = {"skipped": f"over the {budget_s} s Code2Wav budget"}
            continue
        mod = module
        if as_fp32 and module.code_embedding.weight.dtype != torch.float32:
            if fp32 is None:
                fp32 = copy.deepcopy(module).float()
            mod = fp32
        mod.pad_frames = chunk + context if padded else 0
        try:
            # cuDNN on or off, timing its algorithms per shape or not (the other flags at PyTorch's defaults)
            with torch.backends.cudnn.flags(enabled=enabled, benchmark=bench):
                out[name] = _code2wav_variant(mod, device, batches if all_batches else batches[:1], calls, chunk,
                                              context, fresh, kernels=not bench and not padded)
                if not padded:
                    out[name]["stages_chunk_b1_ms"] = code2wav_stages(mod, _codes(mod, chunk + context, device),
                                                                      device, 3)
        finally:
            mod.pad_frames = 0
    return out


def _code2wav_variant(mod, device, batches, calls, chunk, context, fresh, kernels: bool) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    with torch.no_grad():
        first = code2wav_items(mod, 1, chunk, chunk, device)
        cases["first_chunk_b1"] = measure(lambda: mod.run_batch("vocode", "code2wav", first, [{}]), device, calls)
        for b in batches:
            items = code2wav_items(mod, b, chunk + context, chunk, device)
            cases[f"chunk_b{b}"] = measure(lambda items=items, b=b: mod.run_batch("vocode", "code2wav", items, [{}] * b),
                                           device, calls, kernels=kernels and b == batches[0])
        cases["new_length_b1_ms"] = _fresh_lengths(mod, device, fresh, context, 2)
    return cases


def _fresh_lengths(mod, device, fresh: Iterator[int], context: int, count: int) -> list[dict[str, float]]:
    """Synced ms of the first and second call at lengths never run before (the last chunk of a request)."""
    import time

    out = []
    for frames in [next(fresh, None) for _ in range(count)]:
        if frames is None:
            break
        items = code2wav_items(mod, 1, frames, frames - context, device)
        row: dict[str, float] = {"frames": frames}
        for key in ("first_ms", "again_ms"):
            sync(device)
            t0 = time.perf_counter()
            mod.run_batch("vocode", "code2wav", items, [{}])
            sync(device)
            row[key] = round((time.perf_counter() - t0) * 1e3, 3)
        out.append(row)
    return out


def _codes(module, frames: int, device: torch.device) -> torch.Tensor:
    cfg = module.cfg
    return torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, frames), device=device)


# -- code predictor --------------------------------------------------------------------------------

def predictor_items(module, batch: int, device: torch.device, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """One frame per request: the talker's final state, the frame's first code, its index."""
    cfg = module.cfg
    return [{"talker_hidden": torch.randn(cfg.hidden_size, device=device, dtype=dtype),
             "first_code": torch.tensor([i % cfg.vocab_size]),  # the talker's sampled id: on the host
             "frame_index": torch.tensor(i)} for i in range(batch)]  # talker_input's, on the host


def profile_code_predictor(module, device: torch.device, batches: list[int], calls: int) -> dict[str, Any]:
    """run_batch at each batch: captured graphs (as served) vs eager, sampled (served default) and greedy."""
    dtype = module.norm.weight.dtype
    sampled = {k: v for k, v in CODE_PREDICTOR_DEFAULTS.items()}
    greedy = {**sampled, "code_predictor.temperature": 0.0}
    graphs = module.graphs
    out: dict[str, Any] = {"graph_sizes": graphs.sizes(False) if graphs else []}
    for b in batches:
        items = predictor_items(module, b, device, dtype)
        modes = [("graph_sampled", graphs, sampled), ("eager_sampled", StepGraphs(), sampled), ("graph_greedy", graphs, greedy)]
        for mode, use, opts in modes:
            if mode.startswith("graph") and not graphs:
                continue  # CPU: nothing captured
            module.graphs = use
            try:
                out[f"{mode}_b{b}"] = measure(
                    lambda items=items, opts=opts, b=b: module.run_batch("talk", "code_predictor", items, [opts] * b),
                    device, calls, kernels=b == batches[0] and mode != "graph_greedy")
            finally:
                module.graphs = graphs
    out["sampling_tensors_b1"] = _sampling_tensors_cost(module, device, calls)
    return out


def _sampling_tensors_cost(module, device: torch.device, calls: int) -> dict[str, float]:
    """Host cost of building the sampling tensors from Python lists (each a blocking host->device copy)."""
    from mstar.models.qwen3_omni.code_predictor_sampling import CodePredictorSampling, build_sampling_tensors

    params = [CodePredictorSampling.from_options(CODE_PREDICTOR_DEFAULTS)]
    cfg = module.cfg
    return time_calls(lambda: build_sampling_tensors(params, [0], cfg.num_residual, cfg.vocab_size, device),
                      device, calls)


# -- talker_input ----------------------------------------------------------------------------------

def talker_input_items(module, batch: int, device: torch.device, prompt: bool) -> list[dict[str, torch.Tensor]]:
    """Inputs of iteration 0 (`prompt`: the talker prompt from the thinker's prompt states) or of a
    later iteration (one thinker text row plus the previous frame)."""
    ids_map, cfg = module.token_ids, module.config
    dtype = module.tts_rows.dtype
    ht, h = cfg.thinker_hidden_size, cfg.text.hidden_size
    ids = torch.tensor([ids_map["im_start"], ids_map["user"], 11, 12, 13, ids_map["im_end"], 198,
                        ids_map["im_start"], ids_map["assistant"], 198], device=device)
    rows = 7 + 9  # the user turn's tokens, then the 9 assistant rows of the talker prompt
    positions = torch.arange(rows, device=device).expand(3, -1).contiguous()
    items = []
    for i in range(batch):
        x = {"prompt_ids": ids, "talker_positions": positions,
             "thinker_states": torch.randn(2, ids.numel() + 1 if prompt else 1, ht, device=device, dtype=dtype)}
        if not prompt:  # loop-backs as the walk carries them: host values but the predictor's embedding sum
            x |= {"frame_index": torch.tensor(i), "first_code": torch.tensor([i]),
                  "codec_embed_sum": torch.randn(h, device=device, dtype=dtype),
                  "text_ended": torch.tensor(False), "talker_pos": torch.full((3, 1), rows - 1 + i)}
        items.append(x)
    return items


def profile_talker_input(module, device: torch.device, batches: list[int], calls: int) -> dict[str, Any]:
    """run_batch of a decode iteration at each batch, and of the prompt iteration at batch 1."""
    out: dict[str, Any] = {}
    opts = {"voice": "Ethan"}
    for b in batches:
        items = talker_input_items(module, b, device, prompt=False)
        out[f"step_b{b}"] = measure(lambda items=items, b=b: module.run_batch("talk", "talker_input", items, [opts] * b),
                                    device, calls, kernels=b == batches[0])
    prompt = talker_input_items(module, 1, device, prompt=True)
    out["prompt_b1"] = measure(lambda: module.run_batch("talk", "talker_input", prompt, [opts]), device,
                               max(calls // 4, 2))
    return out
