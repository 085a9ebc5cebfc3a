"""Measure (not assert) the runtime's own cost per generated token, Orpheus-shaped, on CPU.

The Orpheus graph (lane `lm`: prefill -> decode Loop over `llm`; lane `vocoder`: `snac` fed by a
sliding-window StreamEdge of the LM's tokens) runs with instant components:
- `llm` is a fake autoregressive-like engine: each step returns the next audio token of every
  pending item at once (no model, no KV cache);
- `snac` is the real stateless engine around a module that returns 4 zero samples per window.
So almost all of the time per token is the runtime around the engines: worker loop, walk
interpreter, stream buffers, conductor, offline API. `--tiny` runs the real tiny Orpheus instead.

Cases: in-process and multi-process, with the vocoder lane (a stream to a second lane) and without
(the `lm` lane alone). One request at a time; each case is run `--runs` times and the median kept.

    python3 benchmarks/runtime_per_token.py                 # -> benchmarks/results/runtime_per_token.json
    python3 benchmarks/runtime_per_token.py --profile inproc:stream   # cProfile of every thread

The fakes are installed when this file is imported, so worker processes (spawned: they import the
main script as `__mp_main__`) get them too.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import mstar.runtime.build as build
from mstar.engines.base import StepItem, StepResult
from mstar.graph import ModelGraph
from mstar.models.base import BuiltComponent
from mstar.models.orpheus.model import OrpheusModel
from mstar.models.orpheus.tokens import FRAME
from mstar.models.registry import register
from mstar.worker.worker import Worker

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 700  # generated tokens per request (100 SNAC frames)


class FakeLMEngine:
    """An autoregressive-like engine that answers every pending item in one instant step."""

    host_inputs = True

    def __init__(self, first_code: int, codebook_size: int) -> None:
        self.first_code, self.codebook_size = first_code, codebook_size
        self._pending: list[StepItem] = []
        self._made: dict[str, int] = {}
        self.last_step_items = 0

    def submit(self, item: StepItem) -> None:
        self._pending.append(item)

    def has_work(self) -> bool:
        return bool(self._pending)

    def release(self, request_id: str) -> None:
        self._pending = [i for i in self._pending if i.request_id != request_id]
        self._made.pop(request_id, None)

    def step(self) -> list[StepResult]:
        items, self._pending = self._pending, []
        self.last_step_items = len(items)
        results = []
        for item in items:
            n = self._made.get(item.request_id, 0)
            self._made[item.request_id] = n + 1
            # code 1 at frame place n % 7: every token is kept by the stream filter
            token = self.first_code + (n % FRAME) * self.codebook_size + 1
            results.append(StepResult(item.request_id, item.walk, item.node, {"token": torch.tensor([token])},
                                      iteration=item.iteration))
        return results


class FakeVocoder(torch.nn.Module):
    """A stateless `snac` stand-in: a few zero samples per window."""

    def run_batch(self, walk: str, node: str, inputs: list[dict], options: list[dict]) -> list[dict]:
        return [{"audio": torch.zeros(4)} for _ in inputs]


class FakeOrpheus(OrpheusModel):
    """The tiny Orpheus graph and processor with instant components."""

    name = "fake_orpheus"
    stream = True

    @classmethod
    def make_config(cls, tiny: bool = False, **overrides: Any):
        return super().make_config(tiny=True, **overrides)

    def graph(self) -> ModelGraph:
        g = super().graph()
        if self.stream:
            return g
        return replace(g, components={"llm": g.components["llm"]}, walks=g.walks[:2], lanes=g.lanes[:1],
                       streams=())

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        if name == "llm":
            return BuiltComponent(torch.nn.Identity(), {"fake": "llm"})
        return BuiltComponent(FakeVocoder(), {"max_batch_size": 64})


class FakeOrpheusNoStream(FakeOrpheus):
    """Only the `lm` lane: no stream, no vocoder."""

    name = "fake_orpheus_nostream"
    stream = False


def _engine(kind: str, built: Any, config: Any, device: torch.device):
    if built.engine_options.get("fake") == "llm":
        model = FakeOrpheus(FakeOrpheus.make_config())
        return FakeLMEngine(model.tokens.audio_offset, model.tokens.codebook_size)
    return _real_engine(kind, built, config, device)


def _profiled_worker_run(self) -> None:
    """Worker.run under cProfile, stats dumped to $MSTAR_BENCH_PROFILE_DIR/worker-<rank>-<pid>.prof."""
    prof = cProfile.Profile()
    try:
        prof.runcall(_real_worker_run, self)
    finally:
        prof.dump_stats(f"{os.environ[PROFILE_ENV]}/worker-{self.rank}-{os.getpid()}.prof")


PROFILE_ENV = "MSTAR_BENCH_PROFILE_DIR"  # set by --profile for multiproc cases: worker processes profile themselves
_real_engine = build._engine
build._engine = _engine
_real_worker_run = Worker.run
if os.environ.get(PROFILE_ENV):
    Worker.run = _profiled_worker_run
register("fake_orpheus", f"{__name__}:FakeOrpheus")
register("fake_orpheus_nostream", f"{__name__}:FakeOrpheusNoStream")


def _config(model: str, workers: int) -> dict:
    groups = [{"node_names": ["llm", "snac"] if model != "fake_orpheus_nostream" else ["llm"], "ranks": [0]}]
    if workers == 2:
        groups = [{"node_names": ["llm"], "ranks": [0]}, {"node_names": ["snac"], "ranks": [1]}]
    return {"model": model, "device": "cpu", "max_concurrent_requests": 4, "node_groups": groups}


def _case_model(stream: bool, tiny: bool) -> str:
    if tiny:
        return "orpheus"
    return "fake_orpheus" if stream else "fake_orpheus_nostream"


def time_case(mode: str, stream: bool, tiny: bool, runs: int, workers: int = 1) -> dict:
    """Median seconds per generated token over `runs` requests (after a warm-up request)."""
    from mstar.runtime.offline import MStar

    cfg = _config(_case_model(stream, tiny), workers)
    if tiny and not stream:
        raise SystemExit("--tiny runs Orpheus with its vocoder lane only")
    opts = {"max_tokens": TOKENS + 1, "temperature": 0.0, "ignore_eos": True} if tiny else {"max_tokens": TOKENS + 1}
    times, samples = [], 0
    with MStar(config=cfg, mode=mode, tiny=tiny) as m:
        m.generate({"text": "warm up"}, **{**opts, "max_tokens": 30})
        for _ in range(runs):
            t0 = time.perf_counter()
            result = m.generate({"text": "The quick brown fox"}, **opts)
            times.append(time.perf_counter() - t0)
            samples = sum(a.size for a in result.outputs.get("audio", []))
    med = statistics.median(times)
    return {"us_per_token": round(med / TOKENS * 1e6, 1), "runs_us_per_token": [round(t / TOKENS * 1e6, 1)
            for t in times], "audio_samples": int(samples)}


def profile_case(mode: str, stream: bool, tiny: bool, top: int = 35) -> str:
    """cProfile of every Python thread over a warm-up and 3 requests: worker threads and the conductor
    in-process; for multiproc, the worker processes' loops (each printed apart) then this process."""
    if mode == "multiproc":
        with tempfile.TemporaryDirectory() as tmp:
            os.environ[PROFILE_ENV] = tmp
            try:
                time_case(mode, stream, tiny, runs=3)
            finally:
                del os.environ[PROFILE_ENV]
            out = io.StringIO()
            for path in sorted(Path(tmp).glob("*.prof")):
                out.write(f"==== {path.name}\n")
                pstats.Stats(str(path), stream=out).sort_stats("tottime").print_stats(top)
            return out.getvalue()
    profiles: list[cProfile.Profile] = []
    original = threading.Thread.run

    def profiled_run(self):
        prof = cProfile.Profile()
        profiles.append(prof)
        prof.runcall(original, self)

    threading.Thread.run = profiled_run
    main = cProfile.Profile()
    try:
        main.enable()
        time_case(mode, stream, tiny, runs=3)
        main.disable()
    finally:
        threading.Thread.run = original
    out = io.StringIO()
    stats = pstats.Stats(main, stream=out)
    for prof in profiles:
        stats.add(prof)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


CASES = {"inproc:nostream": ("inproc", False, 1), "inproc:stream": ("inproc", True, 1),
         "multiproc:nostream": ("multiproc", False, 1), "multiproc:stream": ("multiproc", True, 1),
         "multiproc:stream:2workers": ("multiproc", True, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the real tiny Orpheus instead of instant fakes")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {list(CASES)}")
    parser.add_argument("--profile", metavar="CASE", help="print a cProfile of CASE (all threads) and exit")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/runtime_per_token.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.profile:
        mode, stream, _ = CASES[args.profile]
        sys.stdout.write(profile_case(mode, stream, args.tiny))
        return
    cases = {}
    for name in args.cases.split(","):
        mode, stream, workers = CASES[name]
        if args.tiny and not stream:
            continue
        cases[name] = time_case(mode, stream, args.tiny, args.runs, workers)
        sys.stdout.write(f"{name}: {cases[name]}\n")
    result = {"command": "python3 " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                          "torch": torch.__version__},
              "tokens_per_request": TOKENS, "components": "tiny orpheus" if args.tiny else "instant fakes",
              "cases": cases}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
