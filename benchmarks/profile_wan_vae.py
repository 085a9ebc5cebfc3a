"""Where the Wan2.2 VAE decode of one benchmark video spends its time, per variant.

Full-size Wan2.2-TI2V-5B VAE with seeded dummy weights, latents [1, 48, 9, 30, 52] (832x480, 33 frames,
the wan_bench shape). Variants (each: one warm-up decode, `--repeats` timed ones, one under torch.profiler):

- `float32`: the NCDHW decoder (`vae_dtype: float32`, one latent frame per decoder call), as served until
  the channels-last one;
- `float32_cl`: the channels-last decoder with folded conv biases (`models/common/wan_vae/vae_channels_last.py`), TF32
  convolutions (`vae_conv_dtype: float32`), as served until float16 ones; `float32_cl_autotune`: the same with cuDNN timing its algorithms per
  convolution shape (`cudnn_autotune`; the served model option was deleted: no gain); `float32_cl_chunk3`: channels-last, three latent
  frames per decoder call;
- `float32_chunk3`: three latent frames per decoder call (NCDHW);
- `float32_no_tf32`: cuDNN's TF32 off, to show whether the convolutions use TF32 tensor cores at all (NCDHW);
- `bfloat16`, `bfloat16_cl`: the VAE in bf16, NCDHW and channels-last;
- `float32_cl_fp16conv`: the float32 VAE channels-last with its convolutions alone in float16
  (`model_kwargs.vae_conv_dtype`'s default; the residual stream and sums stay float32), as served on CUDA.

`--accuracy` also decodes the latents once in float32 with TF32 off (NCDHW, the exact reference) and
records each variant's difference from it: mean and max on the [-1, 1] scale, and in uint8 levels.

For each: wall seconds per decode (host clock around synchronised decodes), kernel milliseconds by category, the top kernels, the
convolution kernels' total (by name), cuDNN's layout conversions (time and launches), and the cuDNN TF32 flag.
Measures, asserts nothing.

    python3 benchmarks/profile_wan_vae.py [--variants float32 bfloat16] [--out FILE]
    python3 benchmarks/profile_wan_vae.py --quick    # tiny VAE on CPU (< 30 s): checks the script
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from benchmarks.profile_wan import summarize_kernels  # noqa: E402
from mstar.models.common.wan_vae.vae_weights import load_vae  # noqa: E402

LATENT = (9, 30, 52)
TINY_LATENT = (3, 4, 6)
# name -> (dtype, chunk_frames, cuDNN TF32 allowed, channels-last decoder, cuDNN algorithm search, conv dtype)
VARIANTS = {
    "float32": (torch.float32, 1, True, False, False, None),
    "float32_cl": (torch.float32, 1, True, True, False, None),
    "float32_cl_autotune": (torch.float32, 1, True, True, True, None),
    "float32_cl_chunk3": (torch.float32, 3, True, True, False, None),
    "float32_chunk3": (torch.float32, 3, True, False, False, None),
    "float32_no_tf32": (torch.float32, 1, False, False, False, None),
    "bfloat16": (torch.bfloat16, 1, True, False, False, None),
    "bfloat16_cl": (torch.bfloat16, 1, True, True, False, None),
    "float32_cl_fp16conv": (torch.float32, 1, True, True, False, torch.float16),
}


def cudnn_flags(allow_tf32: bool, benchmark: bool = False):
    """cuDNN's TF32 switch and algorithm search (`benchmark`, what `cudnn_autotune` turns on) set
    inside the block, its other flags as they are."""
    cudnn = torch.backends.cudnn
    return cudnn.flags(enabled=cudnn.enabled, benchmark=benchmark, deterministic=cudnn.deterministic,
                       allow_tf32=allow_tf32)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_seconds(vae, latents: torch.Tensor, chunk: int, repeats: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(repeats):
            vae.decode(latents, chunk_frames=chunk)
    _sync(device)
    return (time.perf_counter() - start) / repeats


def profile_decode(vae, latents: torch.Tensor, chunk: int, device: torch.device) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    want = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    _sync(device)
    with profile(activities=activities) as prof, torch.no_grad():
        vae.decode(latents, chunk_frames=chunk)
        _sync(device)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type != want or (want == DeviceType.CPU and event.cpu_parent is not None):
            continue
        us = event.time_range.elapsed_us() if want == DeviceType.CUDA else event.cpu_time_total
        totals[event.name][0] += us
        totals[event.name][1] += 1
    summary = summarize_kernels(totals, 1, top=15)
    # kernel_categories files cuDNN's `..._fprop_...` names under attention; here they are convolutions
    summary["convolution_ms"] = round(sum(us for name, (us, _) in totals.items() if _is_conv(name)) / 1e3, 3)
    # cuDNN's NCDHW <-> NDHWC conversions around convolutions: what the channels-last decoder removes
    layout = [(us, n) for name, (us, n) in totals.items() if "nchwToNhwc" in name or "nhwcToNchw" in name]
    summary["layout_conversion_ms"] = round(sum(us for us, _ in layout) / 1e3, 3)
    summary["layout_conversions"] = sum(n for _, n in layout)
    return summary


def _is_conv(name: str) -> bool:
    lowered = name.lower()
    return any(key in lowered for key in ("conv", "implicit_gemm", "fprop", "dgrad", "wgrad", "winograd"))


def _latents(vae, latent: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    z = torch.randn(1, vae.config.z_dim, *latent, generator=torch.Generator().manual_seed(0))
    return z.to(device, vae.post_quant_conv.weight.dtype)


def exact_decode(config, latent: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """The float32 NCDHW decode with TF32 off (cuDNN's and matmuls'): the reference of `--accuracy`."""
    vae = load_vae(load_format="dummy", config=config, dtype=torch.float32, device=device)
    vae.channels_last = False
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with cudnn_flags(False), torch.no_grad():
            return vae.decode(_latents(vae, latent, device))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def difference(video: torch.Tensor, exact: torch.Tensor) -> dict:
    """video against the exact decode: |diff| mean and max in [-1, 1] units, and in uint8 levels."""
    from mstar.models.common.wan_vae.vae import frames_to_uint8

    diff = (video.float() - exact).abs()
    levels = (frames_to_uint8(video).int() - frames_to_uint8(exact).int()).abs()
    return {"mean_abs": float(diff.mean()), "max_abs": float(diff.max()),
            "mean_levels": round(float(levels.float().mean()), 4), "max_levels": int(levels.max()),
            "share_off_by_more_than_1_level": float((levels > 1).float().mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny VAE on CPU")
    parser.add_argument("--accuracy", action="store_true", help="each variant's difference from an exact "
                        "float32 decode (TF32 off) of the same latents")
    parser.add_argument("--out", default=None, help="default benchmarks/results/profile_wan_vae_h200.json "
                        "(--quick: print only)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    config = None
    if args.quick:
        from mstar.models.common.wan_vae.vae_config import tiny_vae_config

        config = tiny_vae_config()
    latent = TINY_LATENT if args.quick else LATENT
    rows = []
    exact = exact_decode(config, latent, device) if args.accuracy else None
    if device.type == "cuda":  # the reference decode's peak is not the first variant's
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for name in args.variants:
        dtype, chunk, tf32, channels_last, autotune, conv_dtype = VARIANTS[name]
        vae = load_vae(load_format="dummy", config=config, dtype=dtype, device=device)
        vae.channels_last, vae.conv_dtype = channels_last, conv_dtype
        latents = _latents(vae, latent, device)
        with cudnn_flags(tf32, autotune):
            decode_seconds(vae, latents, chunk, 1, device)  # warm-up: cuDNN plans (and search), allocator
            seconds = decode_seconds(vae, latents, chunk, args.repeats, device)
            kernels = profile_decode(vae, latents, chunk, device)
            if exact is not None:
                with torch.no_grad():
                    kernels["accuracy"] = difference(vae.decode(latents, chunk_frames=chunk), exact)
        row = {"variant": name, "dtype": str(dtype).removeprefix("torch."), "chunk_frames": chunk,
               "cudnn_allow_tf32": tf32, "channels_last": channels_last, "cudnn_autotune": autotune,
               "conv_dtype": str(conv_dtype or dtype).removeprefix("torch."), "decode_s": round(seconds, 4),
               **kernels}
        if device.type == "cuda":
            row["peak_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            torch.cuda.reset_peak_memory_stats(device)
        rows.append(row)
        shown = ("variant", "decode_s", "kernel_ms_per_step", "kernels_per_step", "convolution_ms",
                 "layout_conversion_ms", "categories_ms", "accuracy")
        print(json.dumps({k: row[k] for k in shown if k in row}), flush=True)
        del vae
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {"benchmark": "profile_wan_vae", "command": "python3 " + " ".join(sys.argv),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "torch": torch.__version__, "latent": list(latent), "rows": rows}
    out = args.out or (None if args.quick else "benchmarks/results/profile_wan_vae_h200.json")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
