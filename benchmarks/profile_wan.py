"""Where one Wan2.2-TI2V-5B denoising step spends its time: the full DiT forward under torch.profiler.

Full-size DiT (30 layers, hidden 3072), dummy bf16 weights, the benchmark shape (832x480, 33 frames ->
9x30x52 latents -> 3,510 tokens, 512 text tokens, per-frame timesteps with frame 0 at 0). "Step" = one
DiT forward of `batch` rows: batch 2 is one guidance step of one request (cond + uncond batched), batch
1 one branch. Guidance/UniPC math around the DiT is left out (a few tiny kernels). For every variant
(eager; eager with cuDNN attention first; eager with the text K/V computed once, as served) and batch it
reports:

- wall_ms_per_step: CUDA-event time of back-to-back forwards (what a serving loop sees);
- kernel_ms_per_step: sum of kernel durations in the profiler trace (GPU busy time); wall - kernel = idle;
- host_ms_per_step: wall time of the same forward at a tiny video (1x2x2 latent, 1 token): same kernel
  count and Python path, negligible GPU work, so it is the host's launch cost; kernels_per_step;
- the top 25 kernels by GPU time, a sum per category (GEMM, attention, norm, elementwise/copy, other) and
  the SDPA backends seen (from kernel names);
plus an SDPA micro-benchmark of the self- and cross-attention shapes on each backend and a bf16 GEMM probe.

    python3 benchmarks/profile_wan.py [--batch 2 1] [--steps 5] [--trace-dir DIR] [--out FILE]
    python3 benchmarks/profile_wan.py --quick    # tiny config on CPU (CPU ops instead of kernels)

Measures, asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from benchmarks.kernel_categories import CATEGORIES, categorize, sdpa_backends  # noqa: E402
from mstar.models.wan22 import denoise  # noqa: E402
from mstar.models.wan22.config import TEXT_LENGTH, WanTransformerConfig  # noqa: E402

LATENT = (9, 30, 52)  # 33 frames at 832x480 after the VAE (4x temporal, 16x spatial)
TINY_LATENT = (3, 4, 6)


def build(quick: bool, device: torch.device) -> torch.nn.Module:
    """The DiT with seeded dummy weights: full size in bf16 on the GPU, or the tiny config on CPU."""
    from mstar.models.common.loading import fill_dummy_weights
    from mstar.models.wan22.tiny import tiny_config
    from mstar.models.wan22.transformer import build_transformer

    config = tiny_config().transformer if quick else WanTransformerConfig()
    model = build_transformer(config, torch.float32 if quick else torch.bfloat16, device)
    fill_dummy_weights(model)
    return model


def inputs(model: torch.nn.Module, batch: int, latent: tuple[int, int, int], text_length: int) -> tuple:
    """(latents, per-frame timesteps with frame 0 conditioned, text embeddings) for `batch` rows."""
    cfg: WanTransformerConfig = model.config
    device, dtype = model.proj_out.weight.device, model.proj_out.weight.dtype
    gen = torch.Generator(device).manual_seed(0)
    latents = torch.randn(batch, cfg.in_channels, *latent, device=device, dtype=dtype, generator=gen)
    text = torch.randn(batch, text_length, cfg.text_dim, device=device, dtype=dtype, generator=gen)
    ts = torch.stack([denoise.frame_timesteps((999.0, 500.0)[i % 2], latent[0], True, device) for i in range(batch)])
    return latents, ts, text


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forwards(model, args: tuple, steps: int, device: torch.device) -> float:
    """Mean milliseconds per forward over `steps` back-to-back forwards (after the caller's warm-up)."""
    _sync(device)
    start = time.perf_counter()
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    with torch.no_grad():
        for _ in range(steps):
            model(*args)
    if device.type == "cuda":
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / steps
    return (time.perf_counter() - start) * 1e3 / steps


def profile_forwards(model, args: tuple, steps: int, device: torch.device, trace: Path | None) -> dict:
    """Kernel (CUDA) or op (CPU) times per step from torch.profiler over `steps` forwards."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof, torch.no_grad():
        for _ in range(steps):
            model(*args)
        _sync(device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    want = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    for event in prof.events():
        if event.device_type != want:
            continue
        if want == DeviceType.CPU and event.cpu_parent is not None:
            continue  # CPU mode: top-level ops only, so nested ops are not counted twice
        us = event.time_range.elapsed_us() if want == DeviceType.CUDA else event.cpu_time_total
        totals[event.name][0] += us
        totals[event.name][1] += 1
    return summarize_kernels(totals, steps)


def summarize_kernels(totals: dict[str, list[float]], steps: int, top: int = 25) -> dict:
    """Per-step kernel count and milliseconds, top `top` names, sums (time and launches) per category, SDPA
    backends."""
    per_step = {name: (us / 1e3 / steps, count / steps) for name, (us, count) in totals.items()}
    total_ms = sum(ms for ms, _ in per_step.values())
    categories, calls = dict.fromkeys(CATEGORIES, 0.0), dict.fromkeys(CATEGORIES, 0.0)
    for name, (ms, n) in per_step.items():
        categories[categorize(name)] += ms
        calls[categorize(name)] += n
    ranked = sorted(per_step.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "kernel_ms_per_step": round(total_ms, 3),
        "kernels_per_step": round(sum(n for _, n in per_step.values()), 1),
        "categories_ms": {k: round(v, 3) for k, v in categories.items()},
        "categories_pct": {k: round(100 * v / total_ms, 1) if total_ms else 0.0 for k, v in categories.items()},
        "categories_calls": {k: round(v, 2) for k, v in calls.items()},  # kernel launches per step
        "sdpa_backends": sdpa_backends(per_step),
        "top_kernels": [{"name": name[:160], "category": categorize(name), "ms_per_step": round(ms, 4),
                         "calls_per_step": round(n, 2), "pct": round(100 * ms / total_ms, 2) if total_ms else 0.0}
                        for name, (ms, n) in ranked],
    }


class CachedText:
    """The forward as served: the text's cross-attention K/V computed once (as `TextKVCache` keeps them)."""

    def __init__(self, model) -> None:
        self.model = model
        self._kv: dict[int, tuple] = {}

    def __call__(self, latents: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        key = id(text)
        if key not in self._kv:
            self._kv[key] = (text, self.model.text_states(text))  # holds text: ids stay unique
        kv = self._kv[key][1]
        return self.model(latents, timesteps, None, text_kv=kv)


def measure(model, batch: int, opts: argparse.Namespace, device: torch.device, label: str,
            host_proxy: bool = True) -> dict:
    """Warm-up, wall time, profile and (unless `host_proxy` is False: it would compile another shape)
    the host-cost proxy of one (variant, batch). `model` is any callable (latents, timesteps, text)."""
    text_length = 16 if opts.quick else TEXT_LENGTH
    args = inputs(_transformer(model), batch, TINY_LATENT if opts.quick else LATENT, text_length)
    t0 = time.perf_counter()
    time_forwards(model, args, 2, device)  # warm-up (and compile, for the compiled variant)
    warmup_s = time.perf_counter() - t0
    wall = time_forwards(model, args, opts.steps, device)
    trace = Path(opts.trace_dir) / f"wan_{label}_b{batch}.json" if opts.trace_dir else None
    kernels = profile_forwards(model, args, opts.profile_steps, device, trace)
    host = None
    if host_proxy:
        small = inputs(_transformer(model), batch, (1, 2, 2), text_length)  # one token: same kernels, ~no work
        time_forwards(model, small, 2, device)
        host = round(time_forwards(model, small, opts.steps, device), 3)
    row = {"variant": label, "batch": batch, "warmup_s": round(warmup_s, 2), "wall_ms_per_step": round(wall, 3),
           "host_ms_per_step": host, **kernels}
    row["idle_ms_per_step"] = round(wall - kernels["kernel_ms_per_step"], 3) if device.type == "cuda" else None
    return row


def _transformer(model):
    return model.model if isinstance(model, CachedText) else model


def variants(opts: argparse.Namespace, device: torch.device) -> list[tuple[str, contextlib.AbstractContextManager, str]]:
    """(label, context, forward) triples to run: forward "plain" computes the text K/V every forward,
    "cached" computes them once (as served); the cuDNN-first one only on CUDA."""
    out: list[tuple[str, contextlib.AbstractContextManager, str]] = [("eager", contextlib.nullcontext(), "plain")]
    if device.type == "cuda":
        out.append(("eager_cudnn_first", _backend_first("CUDNN_ATTENTION"), "plain"))
    out.append(("eager_text_cached", contextlib.nullcontext(), "cached"))
    return out


def _backend_first(name: str) -> contextlib.AbstractContextManager:
    """SDPA tries backend `name` first, then its usual order (flash, efficient, math)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [getattr(SDPBackend, name)] + [getattr(SDPBackend, n) for n in
                                           ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH") if n != name]
    return sdpa_kernel(order, set_priority=True)


def sdpa_microbench(batch: int, device: torch.device, iters: int = 10) -> dict:
    """ms and TFLOP/s of the DiT's attention shapes (q, k, v as the model passes them: [B, L, H, d]
    storage seen as [B, H, L, d]) on each SDPA backend; "unsupported" where a backend refuses."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, dim, length = 24, 128, LATENT[0] * LATENT[1] * LATENT[2] // 4
    shapes = {"self": (length, length), "cross": (length, TEXT_LENGTH)}
    out: dict[str, dict] = {}
    for kind, (lq, lk) in shapes.items():
        q = torch.randn(batch, lq, heads, dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(batch, lk, heads, dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))
        flop = 4 * batch * heads * lq * lk * dim
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
            try:
                with sdpa_kernel([getattr(SDPBackend, backend)]):
                    ms = time_forwards(F.scaled_dot_product_attention, (q, k, v), iters, device)
            except RuntimeError as exc:  # the backend does not take this shape / build
                out[f"{kind}_{backend.lower()}"] = {"unsupported": str(exc).splitlines()[0][:120]}
                continue
            out[f"{kind}_{backend.lower()}"] = {"ms": round(ms, 3), "tflops": round(flop / ms / 1e9, 1)}
    return out


def gemm_probe(batch: int, device: torch.device, iters: int = 10) -> dict:
    """TFLOP/s of an 8192^3 bf16 matmul and of the DiT's own projection shapes at `batch` rows."""
    cfg = WanTransformerConfig()
    tokens = batch * LATENT[0] * LATENT[1] * LATENT[2] // 4
    shapes = {"probe_8192": (8192, 8192, 8192), "qkv": (tokens, cfg.dim, 3 * cfg.dim),
              "attn_out": (tokens, cfg.dim, cfg.dim), "ffn_in": (tokens, cfg.dim, cfg.ffn_dim),
              "ffn_out": (tokens, cfg.ffn_dim, cfg.dim), "cross_kv_text": (batch * TEXT_LENGTH, cfg.dim, 2 * cfg.dim)}
    out = {}
    for name, (m, k, n) in shapes.items():
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        bias = torch.randn(n, device=device, dtype=torch.bfloat16)
        time_forwards(torch.nn.functional.linear, (a, w, bias), 3, device)
        ms = time_forwards(torch.nn.functional.linear, (a, w, bias), iters, device)
        out[name] = {"mnk": [m, k, n], "ms": round(ms, 3), "tflops": round(2 * m * k * n / ms / 1e9, 1)}
    return out


def report(rows: list[dict]) -> None:
    """Human-readable summary on stdout (the JSON holds everything)."""
    for row in rows:
        print(f"\n== {row['variant']} batch {row['batch']}: wall {row['wall_ms_per_step']:.2f} ms/step, kernels "
              f"{row['kernel_ms_per_step']:.2f} ms ({row['kernels_per_step']:.0f} kernels; CPU: top-level ops), host "
              f"proxy {row['host_ms_per_step']} ms, SDPA {row['sdpa_backends']}")
        print("   " + ", ".join(f"{k} {v:.2f} ms ({row['categories_pct'][k]}%)" for k, v in row["categories_ms"].items()))
        for kernel in row["top_kernels"]:
            print(f"   {kernel['ms_per_step']:8.3f} ms {kernel['calls_per_step']:6.1f}x {kernel['category']:16s} "
                  f"{kernel['name'][:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--steps", type=int, default=5, help="timed forwards per measurement")
    parser.add_argument("--profile-steps", type=int, default=2, help="forwards under the profiler")
    parser.add_argument("--trace-dir", default=None, help="write a Chrome trace per (variant, batch) here")
    parser.add_argument("--quick", action="store_true", help="tiny config on CPU (tests / CI)")
    parser.add_argument("--out", default=None, help="JSON path; default benchmarks/results/profile_wan_h200.json "
                        "(quick: none)")
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not opts.quick else "cpu")
    if device.type == "cpu" and not opts.quick:
        raise SystemExit("profile_wan.py needs a CUDA GPU for the full model; use --quick on CPU")
    if opts.trace_dir:
        Path(opts.trace_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = build(opts.quick, device)
    result = {"benchmark": "profile_wan", "command": "python3 " + " ".join(sys.argv), **_versions(device),
              "latent": TINY_LATENT if opts.quick else LATENT, "build_s": round(time.perf_counter() - t0, 1)}
    rows = []
    for label, ctx, forward in variants(opts, device):
        fn = model if forward == "plain" else CachedText(model)
        with ctx:
            rows += [measure(fn, b, opts, device, label) for b in opts.batch]
        del fn
    if device.type == "cuda":
        result["sdpa_microbench"] = sdpa_microbench(max(opts.batch), device)
        result["gemm_probe"] = gemm_probe(max(opts.batch), device)
    result["rows"] = rows
    result["total_s"] = round(time.perf_counter() - t0, 1)
    report(rows)
    print(json.dumps({k: result[k] for k in ("sdpa_microbench", "gemm_probe") if k in result}, indent=1))
    out = opts.out or (None if opts.quick else "benchmarks/results/profile_wan_h200.json")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out} ({result['total_s']} s)")


def _versions(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__, "python": platform.python_version()}


if __name__ == "__main__":
    main()
