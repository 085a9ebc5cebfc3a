"""Pi0.5 served to robots on one GPU, dummy weights, bf16, three cameras (asserts nothing).

- `latency`: one action chunk at concurrency 1 (p50/p99 over `--requests`) as the real `openpi_client` sees
  it over the websocket (what a robot waits), and inside the server (observation received to chunk sent).
  `cpu_ms_per_chunk` (Linux): CPU time per chunk of this process (server and benchmark clients) and of the
  worker processes together, over those requests: far above the host's work, it is threads spinning.
- `throughput`: chunks per second with `--concurrency` robots, each an openpi client sending its next
  observation when its last chunk arrives.
The server runs in --mode (default `auto`, as `mstar serve`: on CUDA a process per worker; `inproc` puts the
policy's host work in the process of the server and of the benchmark's clients, one GIL for all three).
- `baseline`: transformers' `PI0ForConditionalGeneration.sample_actions` (Pi0: the same SigLIP, Gemma prefix
  and expert shapes, 10 Euler steps) on the same GPU and dtype, at the same prefix length, batch 1.
- `--host` (CPU): what a chunk costs the host outside the networks. The policy is the tiny one's widths at the
  full robot's sizes (`RobotSizePi05`: three 224x224 cameras, 32-entry states and actions, chunks of 50), so
  the images, prompt, pages and chunk the host handles are full size and the compute is small; the calls that
  replay CUDA graphs on a GPU (the vision tower, the prefix's prefill, the flow's sample) are timed per request
  and taken out of the in-server time. The rest is split into the request (message unpacked, observation made
  tensors by the processor), the engines' host code around those calls, the response (chunk unnormalised and
  packed) and the runtime between them (conductor, walks, thread hand-offs, event loop). Writes
  benchmarks/results/pi05_bench_cpu_host.json.

    python3 benchmarks/pi05_bench.py                 # GPU: writes benchmarks/results/pi05_bench_<gpu>.json
    python3 benchmarks/pi05_bench.py --concurrency 8 32 128 --requests 100
    python3 benchmarks/pi05_bench.py --quick         # the tiny policy on CPU (smoke test)
    python3 benchmarks/pi05_bench.py --host --requests 300   # the host's cost per chunk, on CPU
    python3 benchmarks/pi05_bench.py --quick --robot-size --mode multiproc --no-baseline  # full-size host data
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from benchmarks.results_io import gpu_tag, write_results  # noqa: E402
from mstar.models.pi05.model import Pi05  # noqa: E402

TASK = "pick up the red cube and place it in the bowl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny policy on CPU (smoke test)")
    parser.add_argument("--host", action="store_true", help="the host's cost per chunk on CPU, compute taken out")
    parser.add_argument("--robot-size", action="store_true",
                        help="with --quick: serve RobotSizePi05 (tiny widths, full robot's images, states and chunks)")
    parser.add_argument("--requests", type=int, default=None, help="chunks timed per latency case (default 100)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="robots (default 8 32 128)")
    parser.add_argument("--per-robot", type=int, default=None, help="chunks each robot asks for (default 10)")
    parser.add_argument("--no-baseline", action="store_true", help="skip transformers' PI0")
    parser.add_argument("--mode", choices=["auto", "inproc", "multiproc"], default="auto",
                        help="the runtime's run mode (default auto, as `mstar serve`: a process per worker on CUDA, "
                             "so the policy's host work does not share the server's and the client's GIL)")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    if not (args.quick or args.host) and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --quick (tiny, CPU) or --host")
    if args.robot_size and not (args.quick and args.no_baseline):
        parser.error("--robot-size goes with --quick (full size has the robot's sizes already) and --no-baseline "
                     "(transformers' Pi0 has no such widths)")
    args.requests = args.requests or (3 if args.quick else 200 if args.host else 100)
    args.concurrency = args.concurrency or ([2] if args.quick else [8, 32, 128])
    args.per_robot = args.per_robot or (2 if args.quick else 10)
    return args


def percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"p50_ms": 1e3 * statistics.median(ordered), "p99_ms": 1e3 * ordered[min(len(ordered) - 1,
            round(0.99 * (len(ordered) - 1)))], "n": len(ordered)}


def observation(metadata: dict[str, Any], seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    example = metadata["example_observation"]
    return {"images": {c: rng.integers(0, 256, im.shape, dtype=np.uint8) for c, im in example["images"].items()},
            "state": rng.uniform(-1, 1, example["state"].shape).astype(np.float32), "prompt": TASK}


def serve(args: argparse.Namespace):
    """The runtime and a live server on a free port (tests/e2e/server_thread.py's)."""
    from tests.e2e.server_thread import running_server

    limit = max(args.concurrency) + 1
    model = f"{__name__}:RobotSizePi05" if args.robot_size else "pi05"
    config = {"model": model, "max_concurrent_requests": limit, "model_kwargs": {"max_robots": limit}}
    kwargs = {"tiny": True} if args.quick else {"load_format": "dummy"}
    return running_server(config, runtime_kwargs={**kwargs, "mode": args.mode})


def latency_cases(args: argparse.Namespace, base: str) -> tuple[dict[str, Any], dict[str, Any]]:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    policy = WebsocketClientPolicy(base.replace("http://", "ws://"))
    metadata = policy.get_server_metadata()
    obs = observation(metadata, 0)
    for _ in range(3):  # warm-up: first-call costs (allocations, autotuning) are not a robot's steady state
        policy.infer(obs)
    seconds, server = [], []
    cpu_before = process_cpu_seconds()
    for i in range(args.requests):
        start = time.perf_counter()
        answer = policy.infer(observation(metadata, i))
        seconds.append(time.perf_counter() - start)
        server.append(answer["server_timing"]["infer_ms"] / 1e3)
    cpu_after = process_cpu_seconds()
    doc = {"websocket": percentiles(seconds), "in_server": percentiles(server),
           "actions_shape": list(answer["actions"].shape)}
    if cpu_before is not None and cpu_after is not None:
        doc["cpu_ms_per_chunk"] = {part: round(1e3 * (cpu_after[part] - cpu_before[part]) / args.requests, 2)
                                   for part in cpu_before}
    return metadata, doc


def process_cpu_seconds() -> dict[str, float] | None:
    """CPU seconds (user and system, every thread) so far of this process (`server`: the server and the
    benchmark's clients) and of its child processes together (`workers`: worker processes, the
    multiprocessing resource tracker); None without Linux's /proc."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    try:
        children = [int(pid) for task in Path("/proc/self/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        return {"server": cpu(os.getpid()), "workers": sum(cpu(pid) for pid in children)}
    except (FileNotFoundError, ProcessLookupError):
        return None


def throughput_case(base: str, robots: int, per_robot: int) -> dict[str, Any]:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    clients = [WebsocketClientPolicy(base.replace("http://", "ws://")) for _ in range(robots)]
    metadata = clients[0].get_server_metadata()
    observations = [observation(metadata, i) for i in range(robots)]
    barrier, seconds = threading.Barrier(robots + 1), []

    def robot(index: int) -> None:
        barrier.wait()
        for _ in range(per_robot):
            start = time.perf_counter()
            clients[index].infer(observations[index])
            seconds.append(time.perf_counter() - start)

    threads = [threading.Thread(target=robot, args=(i,)) for i in range(robots)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return {"chunks_per_s": robots * per_robot / wall, "robots": robots, **percentiles(seconds)}


def baseline_case(args: argparse.Namespace, prompt_tokens: int) -> dict[str, Any]:
    """transformers' PI0 sample_actions at the same shapes (random weights), batch 1."""
    import transformers

    from mstar.models.pi05.config import PI05_BASE
    from mstar.models.pi05.tiny import tiny_config
    from tests.models.pi05_reference import pi0_config

    cfg = tiny_config() if args.quick else PI05_BASE
    device, dtype = (torch.device("cpu"), torch.float32) if args.quick else (torch.device("cuda"), torch.bfloat16)
    with torch.device(device):
        model = transformers.PI0ForConditionalGeneration(pi0_config(cfg)).to(dtype).eval()
    cameras, side, tokens = len(cfg.cameras), cfg.vision.image_size, cfg.vision.tokens
    ids = torch.cat([torch.full((cameras * tokens,), cfg.vocab_size), torch.randint(0, 1000, (prompt_tokens,))])
    inputs = {"state": torch.zeros(1, cfg.max_state_dim, dtype=dtype, device=device), "input_ids": ids[None].to(device),
              "pixel_values": torch.rand(1, cameras, 3, side, side, dtype=dtype, device=device) * 2 - 1,
              "pixel_attention_mask": torch.ones(1, cameras, dtype=torch.bool, device=device),
              "attention_mask": torch.ones(1, len(ids), dtype=torch.long, device=device)}
    seconds = []
    for i in range(args.requests + 3):
        start = time.perf_counter()
        model.sample_actions(**inputs, num_steps=cfg.num_steps)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            seconds.append(time.perf_counter() - start)
    return {"sample_actions": percentiles(seconds), "prefix_tokens": len(ids)}


def prompt_length(metadata: dict[str, Any], args: argparse.Namespace) -> int:
    """Tokens of the benchmark's prompt as the served policy tokenizes it."""
    from mstar.models.pi05.model import Pi05

    model = Pi05(Pi05.make_config(tiny=args.quick), load_format="auto" if args.quick else "dummy")
    processor = model.processor()
    request, options = processor.observation_request(observation(metadata, 0))
    return int(processor.inputs(request, options)["prompt_ids"].numel())


class RobotSizePi05(Pi05):
    """The tiny policy's widths at the full robot's sizes: three 224x224 cameras in 14-pixel patches (256
    tokens each), 32-entry states and actions, chunks of 50, prompts of up to 200 tokens."""

    @functools.cached_property
    def pi05(self):
        from mstar.models.pi05.tiny import tiny_config

        tiny = tiny_config()
        return dataclasses.replace(tiny, vision=dataclasses.replace(tiny.vision, image_size=224, patch_size=14),
                                   state_dim=32, action_dim=32, chunk_size=50, max_prompt_tokens=200)


HOST_SPANS = {  # part -> the functions whose time counts to it
    "compute": ("mstar.models.pi05.siglip:VisionTower.forward", "mstar.models.pi05.components:PolicyComponent.prefill",
                "mstar.models.pi05.components:PolicyComponent.sample"),
    "engines": ("mstar.engines.stateless:StatelessEngine.step",),
    "request": ("mstar.server.routes_openpi:unpack", "mstar.models.pi05.processor:Pi05Processor.observation_request",
                "mstar.models.pi05.processor:Pi05Processor.inputs"),
    "response": ("mstar.models.pi05.processor:Pi05Processor.decode_output", "mstar.server.routes_openpi:pack"),
}


@contextmanager
def timed_spans() -> Iterator[dict[str, float]]:
    """Within the block, every function of `HOST_SPANS` adds its seconds to its part's running total (the
    dict yielded); the functions are put back after."""
    import importlib

    totals, originals = dict.fromkeys(HOST_SPANS, 0.0), []
    for part, targets in HOST_SPANS.items():
        for target in targets:
            module_name, _, path = target.partition(":")
            owner = importlib.import_module(module_name)
            *outer, name = path.split(".")
            for attr in outer:
                owner = getattr(owner, attr)
            originals.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, _timed(getattr(owner, name), totals, part))
    try:
        yield totals
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def _timed(fn, totals: dict[str, float], part: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[part] += time.perf_counter() - start
    return wrapper


def host_case(args: argparse.Namespace) -> dict[str, Any]:
    """Per chunk at concurrency 1: the in-server time, its compute, and the host's parts (module docstring)."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from tests.e2e.server_thread import running_server

    torch.set_num_threads(1)  # the tiny networks' ops would take the second core from the server's threads
    rows: list[dict[str, float]] = []
    with timed_spans() as totals, running_server({"model": f"{__name__}:RobotSizePi05"}, tiny=True) as base:
        policy = WebsocketClientPolicy(base.replace("http://", "ws://"))
        metadata = policy.get_server_metadata()
        for i in range(args.requests + 5):
            obs = observation(metadata, i)
            before = dict(totals)
            answer = policy.infer(obs)
            spent = {part: totals[part] - before[part] for part in totals}
            if i >= 5:  # warm-up: first-call costs
                rows.append({"in_server": answer["server_timing"]["infer_ms"] / 1e3, **spent})
    return {"robot": {"cameras": list(metadata["cameras"]), "image_size": metadata["image_size"],
                      "state_dim": metadata["state_dim"], "action_shape": list(answer["actions"].shape)},
            "ms_p50": host_parts(rows), "requests": len(rows)}


def host_parts(rows: list[dict[str, float]]) -> dict[str, float]:
    """The p50 over requests of each part, in ms (p50s do not add up): `host` is the in-server time less
    compute; `request` the message unpacked and made tensors (`Pi05Processor.inputs`); `engine_host` the
    engines' steps less compute; `response` the chunk unnormalised and packed; `runtime` the rest of `host`."""
    parts: dict[str, list[float]] = {}
    for row in rows:
        host, engine_host = row["in_server"] - row["compute"], row["engines"] - row["compute"]
        derived = {"in_server": row["in_server"], "compute": row["compute"], "host": host, "request": row["request"],
                   "engine_host": engine_host, "response": row["response"],
                   "runtime": host - row["request"] - engine_host - row["response"]}
        for key, value in derived.items():
            parts.setdefault(key, []).append(value)
    return {key: round(1e3 * statistics.median(values), 3) for key, values in parts.items()}


def host_main(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    doc = {"device": "cpu", "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
           "torch": torch.__version__, "dtype": "float32", "weights": "tiny widths, full robot sizes (RobotSizePi05)",
           "command": "python3 benchmarks/pi05_bench.py " + " ".join(argv or sys.argv[1:]), **host_case(args)}
    write_results(doc, args.out, False, "pi05_bench_cpu_host")
    print(json.dumps(doc, indent=2))
    return doc


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.host:
        return host_main(args, argv)
    device = "cpu" if args.quick else torch.cuda.get_device_name()
    weights = "tiny" if args.quick else "dummy (lerobot/pi05_base shapes)"
    if args.robot_size:
        weights = "tiny widths, full robot sizes (RobotSizePi05)"
    doc: dict[str, Any] = {"device": device, "dtype": "float32" if args.quick else "bfloat16", "weights": weights,
                           "cameras": 3, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                           "mode": args.mode,
                           "command": "python3 benchmarks/pi05_bench.py " + " ".join(argv or sys.argv[1:])}
    with serve(args) as base:
        metadata, doc["latency"] = latency_cases(args, base)
        doc["throughput"] = {f"c{n}": throughput_case(base, n, args.per_robot) for n in args.concurrency}
    if not args.no_baseline:
        doc["baseline"] = baseline_case(args, prompt_length(metadata, args))
    write_results(doc, args.out, args.quick, f"pi05_bench_{gpu_tag(device)}")
    print(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
