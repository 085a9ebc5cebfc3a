"""Wan2.2-TI2V-5B text-to-video speed on one GPU: mstar against diffusers' WanPipeline, and the DiT floor.

Both sides use seeded random (dummy) weights at full size: DiT 5B and UMT5-xxl in bf16, the VAE in
--vae-dtype (float32 by default, as Wan's own examples load it), the tiny offline tokenizer (prompts are
padded to 512 tokens either way, so ids do not change the speed). Each run: 832x480, 33 frames,
guidance 5 (both branches every step), for every --steps and --concurrency; c requests start together.

- mstar: `MStar(config=<one worker: text_encoder, dit, scheduler, vae on rank 0>, load_format="dummy")`;
  c requests submitted at once (their DiT rows batch). Per request: end-to-end seconds (submit -> last
  event); t[step] is when a denoising step ended: s/step =
  (t[last step] - t[first step]) / (steps - 1); text encode ~ t[first step] - start - s/step (includes
  noise preparation); decode = end - t[last step]. The walk never waits for the GPU (its per-step
  progress event arrives once the host has launched the step), so on CUDA t[step] is a CUDA event
  recorded after the step's scheduler update, put on the host clock by an event recorded at the start
  (on CPU, the progress event's arrival); the end is exact (the video reaches the host only after every
  kernel before it).
- diffusers: one `WanPipeline.__call__` with the c prompts as a batch (each branch its own DiT forward,
  as diffusers runs them), output_type "pt"; the same split from a step-end callback that synchronizes.
- --quantization none fp8: our deployment once per setting (the DiT's block linears in FP8 for fp8:
  `quantization: {dit: fp8}`, W8A8 through torch._scaled_mm on CUDA), one after the other in the same run;
  each row says its setting. Every FP8 row also reports, per request of the same seed and prompt, the
  frame PSNR of its decoded uint8 video against the first setting's (mean and worst frame, dB) and its
  end-to-end time over that row's (`mstar.vs_first_setting`). With dummy weights the frames are not natural
  images: the PSNR measures how far FP8 moves the output, not how it looks.
- floor: the issue's ~4.4 s of DiT compute for 50 steps (one request) on one H200, and our own estimate:
  DiT FLOPs per forward (matmuls and attention, from the config) x 2 branches x c / the bf16 matmul
  TFLOP/s of an 8192^3 torch.matmul probe in the same run.

    python3 benchmarks/wan_bench.py [--steps 20 50] [--concurrency 1 2] [--skip-diffusers] \
        [--quantization none fp8] [--out benchmarks/results/wan_bench_h200.json]
    python3 benchmarks/wan_bench.py --quick     # tiny shapes on CPU (< 60 s): checks the script end to end

--trace-steps N adds one profiled request (concurrency 1, N steps) after the grid: where its wall time
goes on the GPU (busy, idle gaps by size and the largest with their neighbouring kernels, host syncs).

diffusers is not on the GPU machine; carry its pure-python wheel (6 MB; /.whl/ is git-ignored). Here:

    python3 -m pip download --no-deps --only-binary=:all: -d .whl diffusers==0.42.1

then run with carry [".whl"] and the command

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1 python3 benchmarks/wan_bench.py

(its other needs, transformers, huggingface_hub, regex, requests, filelock, safetensors, are there).
Measures, asserts nothing. Our models are freed before the baseline is built (one copy at a time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from benchmarks import wan_baseline  # noqa: E402
from benchmarks.call_timing import free_memory, peak_gb  # noqa: E402
from mstar.models.wan22.config import UMT5Config, Wan22Config, WanTransformerConfig  # noqa: E402
from mstar.runtime.offline import MStar  # noqa: E402

ISSUE_FLOOR_S_50_STEPS = 4.4  # issue #8: DiT compute of 50 steps at 832x480x33, one request, one H200
PROMPTS = ("a red fox runs through fresh snow at dawn, cinematic", "waves crash on a rocky shore at sunset")
COMPONENTS = ["text_encoder", "dit", "scheduler", "vae"]


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype, iters: int = 10) -> float:
    """TFLOP/s of an n x n x n torch.matmul on random data (mean of `iters` after 3 warm-ups)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def _tokens(config: WanTransformerConfig, latent_shape: tuple[int, int, int]) -> int:
    pf, ph, pw = config.patch_size
    return (latent_shape[0] // pf) * (latent_shape[1] // ph) * (latent_shape[2] // pw)


def dit_attention_flops(config: WanTransformerConfig, latent_shape: tuple[int, int, int], text_length: int) -> float:
    """FLOPs of attention's two products (q k^T, p v) in one DiT forward of one row: self and cross."""
    n, d = _tokens(config, latent_shape), config.dim
    return config.num_layers * (4 * n * n * d + 4 * n * text_length * d)


def dit_flops(config: WanTransformerConfig, latent_shape: tuple[int, int, int], text_length: int) -> float:
    """FLOPs of one DiT forward of one row: every projection (2 per multiply-add) plus attention's products.

    The per-frame timestep MLPs are left out (under 0.1% at full size)."""
    n, d, f, t = _tokens(config, latent_shape), config.dim, config.ffn_dim, text_length
    per_layer = (2 * n * 4 * d * d          # self-attention q, k, v, o
                 + 2 * n * 2 * d * d        # cross-attention q, o
                 + 2 * t * 2 * d * d        # cross-attention k, v of the text
                 + 2 * n * 2 * d * f)       # feed-forward
    patch = config.in_channels * math.prod(config.patch_size)
    edges = 2 * n * patch * d + 2 * n * d * config.out_channels * math.prod(config.patch_size) \
        + 2 * t * (config.text_dim + d) * d  # patch embedding, output head, text embedder
    return config.num_layers * per_layer + edges + dit_attention_flops(config, latent_shape, text_length)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _step_events(device: torch.device) -> Iterator[dict[str, list] | None]:
    """On CUDA, per request id the CUDA events recorded after each of its denoising steps (the scheduler's
    `combine`, in the worker's thread, on the stream the step ran on); None on CPU, where host time is GPU
    time."""
    if device.type != "cuda":
        yield None
        return
    from mstar.models.wan22.combine import GuidanceScheduler

    events: dict[str, list] = defaultdict(list)
    real = GuidanceScheduler._combine

    def combine(self, item):
        out = real(self, item)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        events[item.request_id.rpartition("#")[0]].append(event)  # the conductor's wire id: `<id>#<admission>`
        return out

    GuidanceScheduler._combine = combine
    try:
        yield events
    finally:
        GuidanceScheduler._combine = real


def _timeline(handle, start: float, out: dict, errors: list) -> None:
    """Consume one request's events as they arrive, stamping progress events (one per denoising step) and
    keeping its decoded video (uint8 [F, H, W, 3])."""
    steps: list[float] = []
    try:
        for event in handle:
            if event.name == "progress" and float(event.value) < 1.0:  # 1.0 is the decode walk's report
                steps.append(time.perf_counter())
            elif event.name == "video":
                out["video"] = event.value
        out.update(start=start, steps=steps, end=time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - re-raised by the caller
        errors.append(exc)


def run_ours(m: MStar, prompts: list[str], shape: dict, steps: int, guidance: float, device: torch.device) -> list:
    """Submit one request per prompt at once; their timelines (start, step ends, end) in seconds."""
    timelines: list[dict] = [{} for _ in prompts]
    errors: list[Exception] = []
    rids = [uuid.uuid4().hex for _ in prompts]
    with _step_events(device) as events:
        _sync(device)
        start = time.perf_counter()
        origin = None
        if events is not None:  # the idle stream reaches it at `start`
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
        readers = []
        for i, prompt in enumerate(prompts):
            handle = m.submit({"text": prompt}, request_id=rids[i], seed=i, num_inference_steps=steps,
                              guidance_scale=guidance, report_progress=True, **shape)
            readers.append(threading.Thread(target=_timeline, args=(handle, start, timelines[i], errors)))
            readers[-1].start()
        for reader in readers:
            reader.join()
        if errors:
            raise errors[0]
        _sync(device)
        wall_end = time.perf_counter()
    for t, rid in zip(timelines, rids, strict=True):
        t["wall_end"] = wall_end
        if origin is not None:  # the steps' ends on the GPU, in place of the progress events' arrivals
            t["steps"] = [start + origin.elapsed_time(event) / 1e3 for event in events[rid]]
    return timelines


def summarize(timelines: list[dict], steps: int) -> dict:
    """Per-request means of end-to-end, s/step, text encode, denoise and decode seconds; batch wall time."""
    rows = []
    for t in timelines:
        marks = t["steps"]
        per_step = (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else float("nan")
        if len(marks) != steps:
            raise RuntimeError(f"expected {steps} step timestamps, got {len(marks)}")
        first = marks[0] - t["start"]
        rows.append({"e2e_s": t["end"] - t["start"], "s_per_step": per_step,
                     "text_encode_s": first - per_step if len(marks) > 1 else float("nan"),
                     "denoise_s": marks[-1] - marks[0] + per_step, "decode_s": t["end"] - marks[-1]})
    out = {k: round(statistics.mean(r[k] for r in rows), 4) for k in rows[0]}
    out["wall_s"] = round(max(t.get("wall_end", t["end"]) for t in timelines) - timelines[0]["start"], 4)
    return out


def _ours_config(quick: bool, vae_dtype: str, vae_chunk_frames: int = 1, vae_conv_dtype: str | None = None,
                 quantization: str = "none") -> dict:
    kwargs = {"vae_dtype": vae_dtype} if quick else {"dtype": "bfloat16", "vae_dtype": vae_dtype}
    if vae_conv_dtype:
        kwargs["vae_conv_dtype"] = vae_conv_dtype
    kwargs["vae_chunk_frames"] = vae_chunk_frames
    return {"model": "wan22", "max_concurrent_requests": 8, "model_kwargs": kwargs, "device": "cpu" if quick else "auto",
            "node_groups": [{"node_names": COMPONENTS, "ranks": [0]}],
            "quantization": {} if quantization == "none" else {"dit": quantization}}


def frame_psnr(video, reference) -> tuple[float, float]:
    """(mean, worst) over frames of the PSNR in dB of uint8 `video` [F, H, W, 3] (array or CPU tensor)
    against `reference` (inf for identical frames)."""
    err = (np.asarray(video, dtype=np.float64) - np.asarray(reference, dtype=np.float64)) ** 2
    mse = err.reshape(err.shape[0], -1).mean(axis=1)
    with np.errstate(divide="ignore"):
        psnr = 10 * np.log10(255.0**2 / mse)
    return float(psnr.mean()), float(psnr.min())


def bench_ours(args, shape: dict, device: torch.device, quantization: str = "none",
               videos: dict | None = None) -> tuple[list[dict], dict]:
    """Build our deployment with `quantization` ("none" or a method for the DiT), warm it at every
    concurrency, then time every (steps, concurrency). `videos` maps (steps, concurrency) to each request's
    video: filled on the first setting, compared against (frame PSNR) on the others."""
    rows = []
    t0 = time.perf_counter()
    config = _ours_config(args.quick, args.vae_dtype, args.vae_chunk_frames, args.vae_conv_dtype, quantization)
    with MStar(config=config, tiny=args.quick,
               load_format="auto" if args.quick else "dummy") as m:
        info = {"build_s": round(time.perf_counter() - t0, 1)}
        for c in args.concurrency:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
            w0 = time.perf_counter()
            run_ours(m, prompts, shape, 2, args.guidance, device)  # warm-up at this concurrency
            info[f"warmup_s_c{c}"] = round(time.perf_counter() - w0, 1)
            for steps in args.steps:
                timelines = run_ours(m, prompts, shape, steps, args.guidance, device)
                row = {"impl": "mstar", "quantization": quantization, "steps": steps, "concurrency": c,
                       **summarize(timelines, steps), **_against(videos, (steps, c), timelines)}
                print(json.dumps(row), flush=True)
                rows.append(row)
        if args.trace_steps:
            from benchmarks.request_trace import trace

            def one_request() -> None:
                run_ours(m, [PROMPTS[0]], shape, args.trace_steps, args.guidance, device)

            info["trace"] = {"steps": args.trace_steps, "concurrency": 1,
                             **trace(one_request, Path(args.trace_chrome) if args.trace_chrome else None)}
            print(json.dumps(info["trace"]), flush=True)
    return rows, info


def _against(videos: dict | None, key: tuple[int, int], timelines: list[dict]) -> dict:
    """Keep the videos of the first setting's run; for later settings, their frame PSNR against those."""
    if videos is None:
        return {}
    if key not in videos:
        videos[key] = [t["video"] for t in timelines]
        return {}
    psnr = [frame_psnr(t["video"], ref) for t, ref in zip(timelines, videos[key], strict=True)]
    return {"psnr_db_mean": round(statistics.mean(p[0] for p in psnr), 2), "psnr_db_worst_frame": round(min(p[1] for p in psnr), 2)}


def bench_diffusers(args, shape: dict, device: torch.device, text_length: int) -> tuple[list[dict], dict]:
    """Build the diffusers pipeline (after ours is freed) and time the same grid, c prompts per call."""
    from mstar.models.common.wan_vae.vae_config import WAN22_TI2V_5B_VAE, tiny_vae_config
    from mstar.models.wan22 import tiny

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    dit, encoder = (tiny.TINY_TRANSFORMER, tiny.TINY_TEXT_ENCODER) if args.quick else (
        wan_baseline.WAN22_TRANSFORMER, wan_baseline.UMT5_XXL)
    vae = (tiny_vae_config(dit["in_channels"]) if args.quick else WAN22_TI2V_5B_VAE).to_hf()
    t0 = time.perf_counter()
    pipe = wan_baseline.build_pipeline(dit, encoder, vae, tiny.SCHEDULER, str(tiny.tiny_tokenizer_folder()),
                                       torch.float32 if args.quick else torch.bfloat16, dtypes[args.vae_dtype],
                                       device)
    info = {"build_s": round(time.perf_counter() - t0, 1)}
    rows = []
    for c in args.concurrency:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
        wan_baseline.run_pipeline(pipe, prompts, shape, 2, args.guidance, text_length, device)  # warm-up
        for steps in args.steps:
            timeline = wan_baseline.run_pipeline(pipe, prompts, shape, steps, args.guidance, text_length, device)
            row = {"impl": "diffusers", "steps": steps, "concurrency": c, **summarize([timeline], steps)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows, info




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=None, help="default 20 50 (quick: 3)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--vae-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--vae-conv-dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="wan22 vae_conv_dtype: the channels-last VAE decode's convolutions in this dtype "
                        "(default: the deployment's default)")
    parser.add_argument("--skip-diffusers", action="store_true")
    parser.add_argument("--vae-chunk-frames", type=int, default=1, help="wan22 vae_chunk_frames: latent frames "
                        "the VAE decodes at once (more: faster, more memory)")
    parser.add_argument("--trace-steps", type=int, default=0, help="after the grid, one request of this many "
                        "steps (concurrency 1) under torch.profiler: GPU busy/idle, gaps, host syncs "
                        "(benchmarks/request_trace.py), written as mstar.trace")
    parser.add_argument("--trace-chrome", default=None, help="with --trace-steps: also write its Chrome trace here")
    parser.add_argument("--quick", action="store_true", help="tiny random models and shapes, on CPU")
    parser.add_argument("--quantization", nargs="+", choices=["none", "fp8", "fp8_block"], default=["none"],
                        help="our deployment once per setting, the DiT's block linears in FP8 for fp8/fp8_block; "
                        "later settings report frame PSNR and e2e time against the first")
    parser.add_argument("--out", default=None, help="default benchmarks/results/wan_bench_h200.json (quick: none)")
    args = parser.parse_args()
    args.steps = args.steps or ([3] if args.quick else [20, 50])
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if args.quick:
        torch.set_num_threads(1)  # tiny convolutions are slower with threads on shared cores
    shape = {"width": 64, "height": 64, "num_frames": 5} if args.quick else {"width": 832, "height": 480,
                                                                            "num_frames": 33}
    floor = floor_info(args, shape, device)
    print(json.dumps(floor), flush=True)
    free_memory(device)
    rows, info, videos = [], {}, {}
    for quantization in args.quantization:
        free_memory(device)
        q_rows, q_info = bench_ours(args, shape, device, quantization, videos)
        q_info["peak_gb"] = peak_gb(device)
        rows += q_rows
        info[quantization] = q_info
    if len(args.quantization) > 1:
        info["vs_first_setting"] = _ratios(rows, args.quantization[0])
    result = {"benchmark": "wan_bench", "command": "python3 " + " ".join(sys.argv), **_versions(device),
              "model": "Wan2.2-TI2V-5B shapes, dummy weights" if not args.quick else "wan22 tiny (quick)",
              **shape, "guidance_scale": args.guidance, "vae_dtype": args.vae_dtype,
              "vae_conv_dtype": args.vae_conv_dtype,
              "vae_chunk_frames": args.vae_chunk_frames,
              "floor": floor,
              "mstar": info, "rows": rows}
    if not args.skip_diffusers:
        free_memory(device)
        if device.type == "cuda":  # what our deployment left behind (should be ~0)
            result["mstar"]["left_allocated_gb"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
        drows, dinfo = bench_diffusers(args, shape, device, floor["text_length"])
        dinfo["peak_gb"] = peak_gb(device)
        result.update(diffusers=dinfo, rows=rows + drows)
    for row in result["rows"]:  # the DiT-compute floor of the row's denoising, all its requests
        row["floor_denoise_s"] = round(row["steps"] * row["concurrency"] * floor["estimate_s_per_step_c1"], 4)
    default_out = "benchmarks/results/wan_bench_h200.json"
    out = args.out or (None if args.quick else default_out)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")


def _ratios(rows: list[dict], base: str) -> list[dict]:
    """Per (setting, steps, concurrency): end-to-end seconds over the `base` setting's, with the PSNR."""
    ref = {(r["steps"], r["concurrency"]): r for r in rows if r["quantization"] == base}
    return [{"quantization": r["quantization"], "steps": r["steps"], "concurrency": r["concurrency"],
             "e2e_ratio": round(r["e2e_s"] / ref[(r["steps"], r["concurrency"])]["e2e_s"], 3),
             "psnr_db_mean": r.get("psnr_db_mean"), "psnr_db_worst_frame": r.get("psnr_db_worst_frame")}
            for r in rows if r["quantization"] != base]


def floor_info(args, shape: dict, device: torch.device) -> dict:
    """The DiT-compute floor: measured matmul TFLOP/s, FLOPs per forward, seconds per step and per run."""
    from mstar.models.wan22.tiny import TINY_TEXT_LENGTH, tiny_config

    components = tiny_config() if args.quick else Wan22Config()
    if not args.quick and (WanTransformerConfig.from_hf(wan_baseline.WAN22_TRANSFORMER) != components.transformer
                           or UMT5Config.from_hf(wan_baseline.UMT5_XXL) != components.text_encoder):
        raise RuntimeError("the baseline's configs differ from our default Wan2.2 configs; fix wan_baseline's dicts")
    text_length = TINY_TEXT_LENGTH if args.quick else components.text_length
    latent = (1 + (shape["num_frames"] - 1) // 4, shape["height"] // 16, shape["width"] // 16)
    flops = dit_flops(components.transformer, latent, text_length)
    tflops = matmul_tflops(device, 512 if device.type == "cpu" else 8192,
                           torch.float32 if device.type == "cpu" else torch.bfloat16)
    step_s = 2 * flops / (tflops * 1e12)  # both guidance branches, one request
    return {"text_length": text_length, "latent_frames_h_w": latent, "dit_tflop_per_forward": round(flops / 1e12, 6),
            "matmul_tflops": round(tflops, 3), "estimate_s_per_step_c1": round(step_s, 6),
            "estimate_s": {f"{s}_steps": round(s * step_s, 3) for s in args.steps},
            "issue_s": None if args.quick else {f"{s}_steps": round(ISSUE_FLOOR_S_50_STEPS * s / 50, 3)
                                                for s in args.steps}}


def _versions(device: torch.device) -> dict:
    try:
        import diffusers
        version = diffusers.__version__
    except ImportError:
        version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__, "diffusers_version": version, "python": platform.python_version()}


if __name__ == "__main__":
    main()
