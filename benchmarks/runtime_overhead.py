"""Measure (not assert) the runtime's own cost on the toy model.

- microseconds per node step of a walk, in-process and across processes (1 and 3 workers), with
  the toy components' own compute measured separately and subtracted;
- control messages per streamed item (in-process, counted at the channel);
- 1 MB and 64 MB tensor hops through shared memory (pack + unpack; the cross-process figures with
  the socket included are in benchmarks/results/transport_hops.json).

    python3 benchmarks/runtime_overhead.py   # writes benchmarks/results/runtime_overhead.json
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from mstar.config import load_config
from mstar.models.toy.model import ToyModel
from mstar.runtime.offline import MStar
from mstar.transport.channels import InprocNetwork
from mstar.transport.tensors import new_session_id, pack_tensor, unpack_tensor

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 300  # loop iterations per request; each runs 3 nodes (cond, uncond, guide)


def walk_step_us(config: str, mode: str, repeats: int = 3) -> dict:
    cfg = load_config(config)
    with MStar(config=cfg, mode=mode) as m:
        m.generate({"text": "warm up"}, max_tokens=20, stop_early=False, modalities=["text"])
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            m.generate({"text": "The quick brown fox"}, max_tokens=TOKENS, stop_early=False, modalities=["text"])
            times.append(time.perf_counter() - t0)
    best = min(times)
    return {"request_s": round(best, 4), "us_per_iteration": round(best / TOKENS * 1e6, 1),
            "us_per_node_step": round(best / TOKENS / 3 * 1e6, 1)}


def compute_us_per_iteration(n: int = 2000) -> float:
    """The toy components' own work for one loop iteration (cond + uncond + guide), no runtime."""
    model = ToyModel(ToyModel.make_config())
    dec, guide = model.build_component("decoder", "cpu").module, model.build_component("guide", "cpu").module
    token, pos, ctx = torch.tensor([65]), torch.tensor([0]), torch.zeros(16, dtype=torch.float64)
    opts = [{"guidance": 2.0, "stop_early": False}]
    t0 = time.perf_counter()
    for _ in range(n):
        cond = dec.run_batch("generate", "cond", [{"token": token, "position": pos, "context": ctx}], opts)
        uncond = dec.run_batch("generate", "uncond", [{"token": token, "position": pos}], opts)
        guide.run_batch("generate", "guide", [{"cond_scores": cond[0]["scores"],
                                                "uncond_scores": uncond[0]["scores"], "position": pos}], opts)
    return (time.perf_counter() - t0) / n * 1e6


def messages_per_streamed_item() -> dict:
    counts: Counter = Counter()
    original = InprocNetwork._deliver

    def counting(self, peer, msg):
        counts[type(msg).__name__] += 1
        return original(self, peer, msg)

    InprocNetwork._deliver = counting
    try:
        with MStar(config="toy_2workers") as m:
            m.generate({"text": "The quick brown fox"}, max_tokens=TOKENS, stop_early=False)
    finally:
        InprocNetwork._deliver = original
    items = counts["StreamItem"]
    return {"streamed_items": items, "messages_by_type": dict(counts),
            "stream_messages_per_item": round(items / max(items, 1), 3),
            "all_messages_per_generated_token": round(sum(counts.values()) / TOKENS, 3)}


def shm_hop_us(nbytes: int, repeats: int) -> dict:
    session = new_session_id()
    t = torch.randn(nbytes // 4)
    hops = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = unpack_tensor(pack_tensor(t, inline_max_bytes=0, session=session))
        hops.append(time.perf_counter() - t0)
        assert out.numel() == t.numel()
    return {"p50_us": round(statistics.median(hops) * 1e6, 1), "min_us": round(min(hops) * 1e6, 1), "n": repeats}


def main() -> None:
    torch.set_num_threads(1)
    compute = compute_us_per_iteration()
    steps = {f"{mode}:{cfg}": walk_step_us(cfg, mode) for cfg, mode in [
        ("toy", "inproc"), ("toy", "multiproc"), ("toy_3workers", "multiproc")]}
    for entry in steps.values():
        entry["runtime_us_per_node_step"] = round((entry["us_per_iteration"] - compute) / 3, 1)
    result = {
        "command": "python3 benchmarks/runtime_overhead.py",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__},
        "notes": "one request at a time; toy components compute measured alone and subtracted; "
                 "toy_3workers puts the decoder on another process, so each loop iteration makes "
                 "two RunNode/NodeDone round trips",
        "toy_compute_us_per_iteration": round(compute, 1),
        "walk_steps": steps,
        "streaming": messages_per_streamed_item(),
        "shm_hop_1MB": shm_hop_us(1 << 20, 50),
        "shm_hop_64MB": shm_hop_us(64 << 20, 5),
    }
    out = ROOT / "benchmarks/results/runtime_overhead.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
