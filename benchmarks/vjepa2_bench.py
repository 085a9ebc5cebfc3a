"""V-JEPA 2 and V-JEPA 2-AC on one GPU with dummy weights (asserts nothing).

- `rollout`: latency of one rollout (concurrency 1, one context frame) at each horizon, on our KV cache,
  eagerly (`kv_cache`: `rollout.rollout`, every frame's keys and values computed once) and replaying the
  served world model's CUDA graphs (`graphs`: one per frame position of its preallocated rollout cache,
  captured by the stateless engine's `capture_step_graphs` as a server captures them), against the
  recompute loop the checkpoint authors' world model runs (every step re-runs the predictor over the whole
  growing context): cc-vjepa2's VisionTransformerPredictorAC when installed (`pip install --no-deps
  cc-vjepa2==0.0.3`), else our predictor without a cache (the same computation, parity-tested). Also the
  largest difference between our rollouts' latents and the loop's, and between graphs and eager.
- `encoder`: clips per second of the encoder on `--frames`-frame clips at its crop size, per batch size.
- `plan`: seconds per planned action of the cross-entropy search (`--samples`, `--topk`,
  `--iterations`, `--horizon`; defaults: the authors' planning demo), from one context frame, eagerly
  and on the world model's graphed plan cache (`graphs`); `capture_s` is the one-time capture.
- `profile` (with `--profile`): one plan forward (all candidates, one frame) at each frame position of the
  plan lane, replayed from its graph, under torch.profiler: the top 25 device kernels (CPU ops on CPU), the
  blocks' GEMM TFLOP and the TFLOP/s that makes over the forward's device time.
Full size: ViT-g encoder (`--encoder vitl` for ViT-L fpc64-256) and the 24-layer AC predictor, bf16.

    python3 benchmarks/vjepa2_bench.py --horizons 4 15 30   # GPU: writes benchmarks/results/vjepa2_bench_<gpu>.json

On a bare GPU machine (benchmarks/device_setup.sh; carry .whl for cc-vjepa2), with the GPU tests first:

    source benchmarks/device_setup.sh && python3 -m pytest -q -m gpu tests/gpu/test_vjepa2_gpu.py \
        tests/gpu/test_step_graph_gpu.py && python3 benchmarks/vjepa2_bench.py --horizons 4 15 30 \
        --out $OUT/vjepa2_bench_h100.json
    python3 benchmarks/vjepa2_bench.py --horizons 4 15 30 --samples 800
    python3 benchmarks/vjepa2_bench.py --quick              # tiny networks on CPU (smoke test; no graphs)
    python3 benchmarks/vjepa2_bench.py --horizons 4 --profile --out $OUT/vjepa2_bench_h100_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny networks on CPU (smoke test)")
    parser.add_argument("--horizons", type=int, nargs="+", default=None, help="rollout horizons (default 4 15 30)")
    parser.add_argument("--encoder", choices=["vitl", "vitg"], default="vitg", help="encoder of the clips/s case")
    parser.add_argument("--frames", type=int, default=None, help="frames per encoded clip (default 64)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="clips per encoder call (default 1 4)")
    parser.add_argument("--samples", type=int, default=None, help="CEM candidates (default 400)")
    parser.add_argument("--topk", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=None, help="CEM iterations (default 10)")
    parser.add_argument("--horizon", type=int, default=2, help="actions per planned sequence")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case (default 5)")
    parser.add_argument("--profile", action="store_true", help="top kernels of one graphed plan forward")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    args.device = torch.device("cpu" if args.quick else "cuda")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --quick (tiny, CPU)")
    quick = args.quick
    args.horizons = args.horizons or ([2, 4] if quick else [4, 15, 30])
    args.frames = args.frames or (4 if quick else 64)
    args.batches = args.batches or ([1, 2] if quick else [1, 4])
    args.samples = args.samples or (16 if quick else 400)
    args.iterations = args.iterations or (2 if quick else 10)
    args.topk = min(args.topk, args.samples)
    args.repeats = args.repeats or (2 if quick else 5)
    return args


def timed(repeats: int, device: torch.device, fn: Callable[..., Any], *inputs: Any) -> dict[str, float]:
    """ms of one call `fn(*inputs)`: the first alone, then the median of `repeats` (synced before and after each)."""
    def once() -> float:
        if device.type == "cuda":  # the caller's queued work (making the inputs) is not this call's
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn(*inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3

    first = once()
    runs = sorted(once() for _ in range(repeats))
    return {"first_ms": round(first, 3), "ms": round(runs[len(runs) // 2], 3)}


def networks(args: argparse.Namespace):
    """(encoder, AC predictor, its config, the encoder's shape, dtype), dummy weights as the servers build them."""
    from dataclasses import replace

    from mstar.models.vjepa2 import config, tiny
    from mstar.models.vjepa2.ac_predictor import ACPredictor
    from mstar.models.vjepa2.encoder import VJEPA2Encoder
    from mstar.models.vjepa2.weights import build

    dtype = torch.float32 if args.quick else torch.bfloat16
    if args.quick:
        vjepa2, ac = tiny.tiny_config(), tiny.tiny_ac_config()
    else:
        hf = config.VITL_FPC64_256 if args.encoder == "vitl" else config.VITG_FPC64_256
        vjepa2 = config.VJEPA2Config.from_hf(hf)
        ac = replace(config.AC_VITG, embed_dim=config.VJEPA2Config.from_hf(config.VITG_FPC64_256).encoder.vit.hidden_size)
    std = 0.3 if args.quick else 0.02
    encoder = build(lambda: VJEPA2Encoder(vjepa2.encoder), dtype, args.device, None, None, std=std)
    predictor = build(lambda: ACPredictor(ac), dtype, args.device, None, None, std=std)
    return encoder, predictor, ac, vjepa2.encoder, dtype


def recompute_reference(ac, predictor, dtype, device):
    """(name, f(latents [B, T*HW, E], actions, states) -> [B, T*HW, E]) of the recompute loop's predictor."""
    import importlib.util

    if importlib.util.find_spec("vjepa2") is None:  # cc-vjepa2 not installed: the same loop on our predictor
        return "ours_no_cache", lambda z, a, s: predictor(z.unflatten(1, (a.shape[1], -1)), a, s).flatten(1, 2)
    from tests.models.vjepa2_reference import upstream_ac_module

    module = upstream_ac_module()
    reference = module.vit_ac_predictor(
        img_size=ac.img_size, patch_size=ac.patch_size, num_frames=ac.num_frames, tubelet_size=ac.tubelet_size,
        embed_dim=ac.embed_dim, predictor_embed_dim=ac.vit.hidden_size, depth=ac.vit.num_layers,
        num_heads=ac.vit.num_heads, action_embed_dim=ac.action_dim, use_extrinsics=ac.use_extrinsics).eval()
    from mstar.models.vjepa2.weights import upstream_ac_mapper

    ours = dict(predictor.named_parameters())
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(ours[upstream_ac_mapper(name)[0]])
    reference = reference.to(device=device, dtype=dtype)
    return "cc_vjepa2", reference


def recompute_rollout(reference, latents, states, actions, tokens):
    """The authors' loop: re-run the predictor over the whole context at every step."""
    from mstar.models.vjepa2.ac_predictor import normalize_latents
    from mstar.models.vjepa2.pose import next_state

    frames, poses, out, dtype = latents, states, [], latents.dtype
    for step in range(actions.shape[1]):
        acts = actions[:, :step + 1]
        # the upstream predictor keeps its RoPE in float32: it runs bf16 under autocast, as its authors run it
        with torch.autocast(frames.device.type, dtype=dtype, enabled=dtype != torch.float32):
            predicted = reference(frames.flatten(1, 2), acts.to(dtype), poses.to(dtype))
        nxt = normalize_latents(predicted[:, -tokens:]).to(dtype)
        out.append(nxt)
        frames = torch.cat([frames, nxt[:, None]], 1)
        poses = torch.cat([poses, next_state(poses[:, -1], acts[:, -1])[:, None]], 1)
    return torch.stack(out, 1)


def world_model(args, predictor) -> tuple[Any, float]:
    """The served world model over `predictor` with its lanes sized for the cases here, its graphs
    captured on CUDA (eager on CPU), and the seconds the capture took."""
    from mstar.engines.stateless import capture_step_graphs
    from mstar.models.vjepa2.components import WorldModelComponent

    world = WorldModelComponent(predictor, rollout_frames=max(args.horizons), plan_samples=(args.samples,),
                                plan_frames=args.horizon)
    start = time.perf_counter()
    if args.device.type == "cuda":
        capture_step_graphs(world, [1], args.device)
    return world, round(time.perf_counter() - start, 2)


def graphed_rollout(world, latents, states, actions):
    """A rollout on the world model's rollout lane: its cache and graphs, as its `step` node runs them."""
    from mstar.models.vjepa2.rollout import rollout

    frames = actions.shape[1]  # context + horizon - 1: one per action
    cache, steps = world.steps("rollout", "bench", latents.shape[0], frames)
    try:
        return rollout(world.predictor, latents, states, actions, cache=cache, steps=steps)
    finally:
        world.release("bench")


def rollout_case(args, world, ac, dtype) -> dict[str, Any]:
    """Each horizon's rollout, graphed and eager, and the authors' loop on the same weights."""
    from mstar.models.vjepa2.rollout import rollout

    predictor = world.predictor
    name, reference = recompute_reference(ac, predictor, dtype, args.device)
    gen = torch.Generator(device=args.device).manual_seed(0)
    tokens = ac.tokens_per_frame
    out: dict[str, Any] = {"reference": name}
    for horizon in args.horizons:
        latents = torch.randn(1, 1, tokens, ac.embed_dim, generator=gen, device=args.device, dtype=dtype)
        states = torch.rand(1, 1, ac.action_dim, generator=gen, device=args.device)
        actions = 0.05 * torch.randn(1, horizon, ac.action_dim, generator=gen, device=args.device)
        with torch.no_grad():
            graphed = timed(args.repeats, args.device, graphed_rollout, world, latents, states, actions)
            cached = timed(args.repeats, args.device, rollout, predictor, latents, states, actions)
            again = timed(args.repeats, args.device, recompute_rollout, reference, latents, states, actions, tokens)
            ours = graphed_rollout(world, latents, states, actions)[0].float()
            diff = (ours - recompute_rollout(reference, latents, states, actions, tokens).float()).abs().max()
            eager_diff = (ours - rollout(predictor, latents, states, actions)[0].float()).abs().max()
        out[f"h{horizon}"] = {"graphs": graphed, "kv_cache": cached, "recompute": again,
                              "speedup": round(again["ms"] / graphed["ms"], 2),
                              "speedup_eager": round(again["ms"] / cached["ms"], 2),
                              "max_abs_diff": float(diff), "graphs_vs_eager_max_abs_diff": float(eager_diff)}
    return out


def encoder_case(args, encoder, shape, dtype) -> dict[str, Any]:
    out = {}
    for batch in args.batches:
        clip = torch.randn(batch, args.frames, 3, shape.crop_size, shape.crop_size, device=args.device, dtype=dtype)
        with torch.no_grad():
            t = timed(args.repeats, args.device, encoder, clip)
        out[f"b{batch}"] = {**t, "clips_per_s": round(batch * 1e3 / t["ms"], 3)}
    return out


def plan_case(args, world, ac, dtype) -> dict[str, Any]:
    from mstar.models.vjepa2.planning import CEMSearch, CEMSettings

    settings = CEMSettings(horizon=args.horizon, samples=args.samples, topk=args.topk, iterations=args.iterations)
    gen = torch.Generator(device=args.device).manual_seed(1)
    latents = torch.randn(1, ac.tokens_per_frame, ac.embed_dim, generator=gen, device=args.device, dtype=dtype)
    goal = torch.randn(ac.tokens_per_frame, ac.embed_dim, generator=gen, device=args.device, dtype=dtype)
    states = torch.rand(1, ac.action_dim, generator=gen, device=args.device)

    def plan(graphs: bool) -> torch.Tensor:
        lane = world.steps("plan", "bench", settings.samples, settings.horizon) if graphs else (None, None)
        try:
            search = CEMSearch(world.predictor, latents, states, states.new_zeros(0, ac.action_dim), goal, settings,
                               torch.Generator(device=args.device).manual_seed(2), *lane)
            for _ in range(settings.iterations):
                search.iterate()
            return search.actions()
        finally:
            world.release("bench")

    with torch.no_grad():
        graphed = timed(args.repeats, args.device, plan, True)
        eager = timed(args.repeats, args.device, plan, False)
        diff = (plan(True) - plan(False)).abs().max()
    return {"graphs": {**graphed, "s_per_action": round(graphed["ms"] / 1e3, 4)},
            "eager": {**eager, "s_per_action": round(eager["ms"] / 1e3, 4)},
            "graphs_vs_eager_max_abs_diff": float(diff), "settings": settings.__dict__}


def block_gemm_tflop(ac, rows: int) -> float:
    """TFLOP of the predictor blocks' GEMMs (qkv, attention out, MLP) for `rows` tokens."""
    width, mlp = ac.vit.hidden_size, ac.vit.mlp_size
    return 2 * rows * (3 * width * width + width * width + 2 * width * mlp) * ac.vit.num_layers / 1e12


def profile_case(args, world, ac, dtype) -> dict[str, Any]:
    """`top_ops` of one plan forward at each frame position of the plan lane (graph replays on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.pi05_stages import top_ops

    samples, device = args.samples, args.device
    gen = torch.Generator(device=device).manual_seed(3)
    latents = torch.randn(samples, 1, ac.tokens_per_frame, ac.embed_dim, generator=gen, device=device, dtype=dtype)
    actions = 0.05 * torch.randn(samples, 1, ac.action_dim, generator=gen, device=device)
    states = torch.rand(samples, 1, ac.action_dim, generator=gen, device=device)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    tflop = block_gemm_tflop(ac, samples * world.predictor.block_tokens)
    out: dict[str, Any] = {"samples": samples, "block_gemm_tflop": float(f"{tflop:.4g}")}
    with torch.no_grad():
        _, steps = world.steps("plan", "bench", samples, args.horizon)
        try:
            for position in range(args.horizon):
                steps(position, latents, actions, states)  # the first call of a shape is not the one measured
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                with profile(activities=[activity]) as prof:
                    steps(position, latents, actions, states)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                top = top_ops(prof, device)
                out[f"position{position}"] = {**top, "gemm_tflop_per_s": float(f"{tflop / top['total_us'] * 1e6:.4g}")}
        finally:
            world.release("bench")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    command = "python3 benchmarks/vjepa2_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    name = "cpu" if args.quick else gpu.lower().replace("nvidia ", "").split()[0].replace("-", "")
    encoder, predictor, ac, shape, dtype = networks(args)
    world, capture_s = world_model(args, predictor)
    doc = {"command": command, "device": gpu, "dtype": str(dtype).removeprefix("torch."),
           "encoder": "tiny" if args.quick else args.encoder, "capture_s": capture_s,
           "rollout": rollout_case(args, world, ac, dtype),
           "encoder_clips": encoder_case(args, encoder, shape, dtype),
           "plan": plan_case(args, world, ac, dtype)}
    if args.profile:
        doc["profile"] = profile_case(args, world, ac, dtype)
    return write(doc, Path(args.out) if args.out else ROOT / f"benchmarks/results/vjepa2_bench_{name}.json")


def write(doc: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write `doc` as JSON to `out`, print it and return it."""
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
