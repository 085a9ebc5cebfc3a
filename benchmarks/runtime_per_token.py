"""Measure (not assert) the runtime's own cost per generated token, Orpheus-shaped, on CPU.

The Orpheus graph (lane `lm`: prefill -> decode Loop over `llm`; lane `vocoder`: `snac` fed by a
sliding-window StreamEdge of the LM's tokens) runs with instant components:
- `llm` is a fake autoregressive-like engine: each step returns the next audio token of every
  pending item at once (no model, no KV cache);
- `snac` is the real stateless engine around a module that returns 4 zero samples per window.
So almost all of the time per token is the runtime around the engines: worker loop, walk
interpreter, stream buffers, conductor, offline API. `--model tiny` runs the real tiny Orpheus,
`--model dummy --device cuda` Orpheus-3B with dummy weights; each case also reports the engines'
own step time per token (from the workers' step timings) and the rest, the runtime's share.

Cases: in-process and multi-process, with the vocoder lane (a stream to a second lane) and without
(the `lm` lane alone); `onethread:*` drives the in-process worker and conductor from one thread
(`OneThread`: CPU time of the runtime alone, reproducible under callgrind). `--concurrency 1,8,32` runs each case with that many requests in flight at
once (submitted together, so the `llm` steps batch them all, as a serving engine's decode does);
every figure is per generated token, i.e. per sequence-step. Each case is run `--runs` times and
the median kept. `worker_cpu_us_per_token` is the CPU time of the worker loops alone (threads
in-process, processes otherwise): on a GPU host with lookahead this is the host work that must fit
in the decode step's GPU time.

    python3 benchmarks/runtime_per_token.py                 # -> benchmarks/results/runtime_per_token_cpu.json
    python3 benchmarks/runtime_per_token.py --concurrency 1,8,32 --cases multiproc:stream
    python3 benchmarks/runtime_per_token.py --profile inproc:stream --concurrency 32   # cProfile of every thread

The fakes are installed when this file is imported, so worker processes (spawned: they import the
main script as `__mp_main__`) get them too.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mstar, not whichever one is installed

import mstar.runtime.build as build  # noqa: E402
from mstar import envs  # noqa: E402
from mstar.engines.base import (  # noqa: E402
    AutoregressiveSpec,
    KVLayout,
    StatelessBase,
    StatelessSpec,
    StepItem,
    StepResult,
)
from mstar.graph import ModelGraph  # noqa: E402
from mstar.models.base import BuiltComponent  # noqa: E402
from mstar.models.orpheus.model import OrpheusModel  # noqa: E402
from mstar.models.orpheus.tokens import FRAME  # noqa: E402
from mstar.models.registry import register  # noqa: E402
from mstar.worker.stats import STATS_INTERVAL_S  # noqa: E402
from mstar.worker.worker import Worker  # noqa: E402

TOKENS = 700  # generated tokens per request by default (100 SNAC frames)


class FakeLMEngine:
    """An autoregressive-like engine that answers every pending item in one instant step; an engine-loop
    item (the decode walk's) stays pending until its last iteration, as the real engine keeps it."""

    host_inputs = True

    def __init__(self, first_code: int, codebook_size: int) -> None:
        self.first_code, self.codebook_size = first_code, codebook_size
        self._pending: list[StepItem] = []
        self._made: dict[str, int] = {}
        self._iterations: dict[str, int] = {}  # request -> iterations of its engine loop run so far
        self.last_step_items = 0

    def submit(self, item: StepItem) -> None:
        self._pending.append(item)

    def has_work(self) -> bool:
        return bool(self._pending)

    def stats(self) -> dict[str, float]:
        return {}

    def release(self, request_id: str) -> None:
        self._pending = [i for i in self._pending if i.request_id != request_id]
        self._made.pop(request_id, None)
        self._iterations.pop(request_id, None)

    def step(self) -> list[StepResult]:
        """One token per pending item; as the real engine, one host tensor per step, a view per item."""
        items, self._pending = self._pending, []
        self.last_step_items = len(items)
        tokens, more = [], []
        for item in items:
            n = self._made.get(item.request_id, 0)
            self._made[item.request_id] = n + 1
            # code 1 at frame place n % 7: every token is kept by the stream filter
            tokens.append(self.first_code + (n % FRAME) * self.codebook_size + 1)
            done = self._iterations.get(item.request_id, 0) + 1
            goes_on = item.loop is not None and done < item.loop.max_iterations
            more.append(goes_on)
            if goes_on:
                self._iterations[item.request_id] = done
                self._pending.append(item)
            else:
                self._iterations.pop(item.request_id, None)
        ids = torch.tensor(tokens)
        return [StepResult(item.request_id, item.walk, item.node, {"token": ids[i : i + 1]}, iteration=item.iteration,
                           more=more[i]) for i, item in enumerate(items)]


class FakeLM(torch.nn.Module):
    """The `llm` module the fake engine stands for: only its KV layout is read (the worker sizes pools)."""

    kv_layout = KVLayout(1, 1, 8, torch.float32)


class FakeVocoder(StatelessBase, torch.nn.Module):
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
            return BuiltComponent(FakeLM(), AutoregressiveSpec())
        return BuiltComponent(FakeVocoder(), StatelessSpec(max_batch_size=64))


class FakeOrpheusNoStream(FakeOrpheus):
    """Only the `lm` lane: no stream, no vocoder."""

    name = "fake_orpheus_nostream"
    stream = False


def _engine(built: Any, config: Any, device: torch.device, pages: int | None, tensor_parallel: bool = False):
    if isinstance(built.module, FakeLM):
        model = FakeOrpheus(FakeOrpheus.make_config())
        return FakeLMEngine(model.tokens.audio_offset, model.tokens.codebook_size)
    return _real_engine(built, config, device, pages, tensor_parallel)


def _profiled_worker_run(self) -> None:
    """Worker.run under cProfile, stats dumped to $MSTAR_BENCH_PROFILE_DIR/worker-<rank>-<pid>.prof."""
    prof = cProfile.Profile()
    try:
        prof.runcall(_real_worker_run, self)
    finally:
        prof.dump_stats(f"{envs.bench_profile_dir()}/worker-{self.rank}-{os.getpid()}.prof")


PROFILE_ENV = envs.BENCH_PROFILE_DIR.name  # set by --profile for multiproc cases: worker processes profile themselves
_real_engine = build._engine
build._engine = _engine
_real_worker_run = Worker.run
if envs.bench_profile_dir():
    Worker.run = _profiled_worker_run
register("fake_orpheus", f"{__name__}:FakeOrpheus")
register("fake_orpheus_nostream", f"{__name__}:FakeOrpheusNoStream")


def _config(model: str, workers: int, device: str, concurrency: int) -> dict:
    groups = [{"node_names": ["llm", "snac"] if model != "fake_orpheus_nostream" else ["llm"], "ranks": [0]}]
    if workers == 2:
        groups = [{"node_names": ["llm"], "ranks": [0]}, {"node_names": ["snac"], "ranks": [1]}]
    return {"model": model, "device": device, "max_concurrent_requests": max(4, concurrency), "node_groups": groups}


def _engine_seconds(m: Any) -> dict[str, float]:
    """Cumulative engine step seconds per component (all workers) as the conductor last heard them."""
    totals: dict[str, float] = {}
    for stats in m.runtime.conductor.worker_stats().values():
        for c in stats.components:
            totals[c.component] = totals.get(c.component, 0.0) + c.step_seconds_sum
    return totals


def _cpu_seconds(m: Any) -> float:
    """CPU seconds used so far by this process and the worker processes, every thread (ns clocks):
    unlike wall time, barely moved by other programs sharing the machine."""
    total = time.process_time()
    for proc in m.runtime.workers.values():
        pid = getattr(proc, "pid", None)
        if pid is not None:  # first field of schedstat: nanoseconds on a CPU, per thread
            total += sum(int(p.read_text().split()[0]) for p in Path(f"/proc/{pid}/task").glob("*/schedstat")) / 1e9
    return total


def _worker_cpu_seconds(m: Any) -> float:
    """CPU seconds of the worker loops only: their threads in-process, their processes otherwise."""
    if m.runtime.mode == "inproc":
        tids = [t.native_id for t in m.runtime._threads]
        return sum(_schedstat(Path(f"/proc/self/task/{tid}")) for tid in tids)
    return sum(_schedstat(p) for proc in m.runtime.workers.values()
               for p in Path(f"/proc/{proc.pid}/task").glob("*"))


def _schedstat(task: Path) -> float:
    return int((task / "schedstat").read_text().split()[0]) / 1e9  # first field: ns on a CPU


def _generate_many(m: Any, n: int, opts: dict) -> int:
    """`n` requests in flight at once, each consumed as `MStar.generate` does; audio samples of the last."""
    handles = [m.submit({"text": "The quick brown fox"}, **opts) for _ in range(n)]
    resolved = m.runtime.model.request_options(opts)
    samples = 0
    for handle in handles:
        decoder, samples = m.processor.output_decoder(resolved, {}), 0
        for event in handle:
            for name, value in decoder.push(event.name, event.value):
                samples += value.size if name == "audio" else 0
            if decoder.finish_reason is not None:
                handle.cancel()
                break
        samples += sum(value.size for name, value in decoder.flush() if name == "audio")
    return samples


def _settled_engine_seconds(m: Any) -> dict[str, float]:
    time.sleep(STATS_INTERVAL_S * 2.5)  # workers report engine timings every STATS_INTERVAL_S
    return _engine_seconds(m)


def time_case(mode: str, stream: bool, args: argparse.Namespace, runs: int, workers: int = 1,
              concurrency: int = 1) -> dict:
    """Median wall time per generated token over `runs` rounds of `concurrency` requests in flight at
    once (after a warm-up round of the same size), the part of it the engines' steps took (from the workers' step
    timings), and the median CPU time per token of all processes and of the worker loops alone (the
    numbers least moved by other load on the machine)."""
    from mstar.runtime.offline import MStar

    real = args.model != "fake"
    if real and not stream:
        raise SystemExit(f"--model {args.model} runs Orpheus with its vocoder lane only")
    model = "orpheus" if real else "fake_orpheus" if stream else "fake_orpheus_nostream"
    cfg = _config(model, workers, args.device, concurrency)
    opts = {"max_tokens": args.tokens + 1}
    if real:  # sampled tokens; a stop token would end the request early
        opts.update(temperature=0.0, ignore_eos=True)
    tokens = args.tokens * concurrency  # generated per round: every figure is per sequence-step
    walls, cpus, worker_cpus, engines, samples = [], [], [], [], 0
    with MStar(config=cfg, mode=mode, tiny=args.model == "tiny",
               load_format="dummy" if args.model == "dummy" else "auto") as m:
        _generate_many(m, concurrency, opts)  # a whole round: the first one runs markedly slower
        before = _settled_engine_seconds(m)
        for _ in range(runs):
            c0, w0, t0 = _cpu_seconds(m), _worker_cpu_seconds(m), time.perf_counter()
            samples = _generate_many(m, concurrency, opts)
            walls.append(time.perf_counter() - t0)
            cpus.append(_cpu_seconds(m) - c0)
            worker_cpus.append(_worker_cpu_seconds(m) - w0)
            after = _settled_engine_seconds(m)
            engines.append({k: v - before.get(k, 0.0) for k, v in after.items()})
            before = after
    order = sorted(range(runs), key=lambda i: walls[i])
    mid = order[len(order) // 2]  # the median run, engine split included
    per_token = {k: round(v / tokens * 1e6, 1) for k, v in engines[mid].items()}
    wall_us = walls[mid] / tokens * 1e6
    return {"concurrency": concurrency, "us_per_token": round(wall_us, 1), "engine_us_per_token": per_token,
            "runtime_us_per_token": round(wall_us - sum(per_token.values()), 1),
            "runs_us_per_token": [round(t / tokens * 1e6, 1) for t in walls],
            "cpu_us_per_token": round(statistics.median(cpus) / tokens * 1e6, 1),
            "worker_cpu_us_per_token": round(statistics.median(worker_cpus) / tokens * 1e6, 1),
            "audio_samples_per_request": int(samples)}


class OneThread:
    """The in-process runtime with its worker and conductor driven by the calling thread alone: no
    thread handoffs in the way, so CPU time per token is the runtime's own work (and, under
    `valgrind --tool=callgrind`, its instruction count is reproducible). The client side (events to
    sinks, no output decoding) is left out; objects built before serving are frozen out of the
    garbage collector, as in a worker process."""

    def __init__(self, cfg: dict, tiny: bool) -> None:
        from mstar.conductor.conductor import Conductor
        from mstar.config import config_from_dict
        from mstar.graph.placement import plan_placement
        from mstar.runtime.build import build_engines, build_model, worker_device
        from mstar.runtime.codecs import LocalCodec
        from mstar.transport import wire
        from mstar.transport.channels import make_network
        from mstar.transport.messages import Codec
        from mstar.worker.worker import CONDUCTOR, worker_peer

        config = config_from_dict(cfg)
        self.model = build_model(config, tiny=tiny)
        graph = self.model.graph()
        plan = plan_placement(graph, config.node_groups, config.source)
        assert plan.num_workers == 1, "one thread drives one worker"
        self.processor = self.model.processor()
        network = make_network("inproc", Codec(wire.Message))
        self.inbox, outbox, codec = network.inbox(CONDUCTOR), network.outbox(), LocalCodec()
        self.conductor = Conductor(graph, plan, lambda rank, msg: outbox.send(worker_peer(rank), msg), codec,
                                   config.max_concurrent_requests, config.max_queued_requests)
        device = worker_device(config, 0)
        engines = build_engines(self.model, config, plan.components_on(0), device)
        self.worker = Worker(0, graph, engines, network.inbox(worker_peer(0)), network.outbox(), codec, device)
        self.made = 0
        # as a worker process does before serving (runtime/process.py): otherwise a full collection
        # over everything imported lands in some round and swamps its per-token figure
        gc.collect()
        gc.freeze()

    def generate_many(self, n: int, opts: dict) -> int:
        """`n` requests at once, pumped to the end; audio samples of the last."""
        from mstar.conductor.request_state import FinishEvent

        resolved = self.model.request_options(opts)
        events: dict[str, list] = {}
        for _ in range(n):
            self.made += 1
            rid = f"r{self.made}"
            events[rid] = []
            inputs = self.processor.inputs({"text": "The quick brown fox"}, resolved)
            self.conductor.submit(rid, inputs, resolved, events[rid].append)
        while not all(e and isinstance(e[-1], FinishEvent) for e in events.values()):
            self.worker.receive(0.0)
            self.worker.execute()
            while (msg := self.inbox.recv(0.0)) is not None:
                self.conductor.handle(msg)
        last = events[f"r{self.made}"]
        assert last[-1].error is None, last[-1].error
        return sum(int(e.value.numel()) for e in last[:-1] if e.name == "audio")


def time_onethread(stream: bool, args: argparse.Namespace, runs: int, concurrency: int) -> dict:
    """CPU time per generated token of the runtime driven by one thread (see OneThread), median of `runs`
    rounds of `concurrency` requests after a warm-up round."""
    model = "fake_orpheus" if stream else "fake_orpheus_nostream"
    one = OneThread(_config(model, 1, args.device, concurrency), tiny=False)
    opts = {"max_tokens": args.tokens + 1}
    one.generate_many(concurrency, opts)
    cpus, samples = [], 0
    for _ in range(runs):
        c0 = time.thread_time()
        samples = one.generate_many(concurrency, opts)
        cpus.append(time.thread_time() - c0)
    tokens = args.tokens * concurrency
    return {"concurrency": concurrency, "cpu_us_per_token": round(statistics.median(cpus) / tokens * 1e6, 1),
            "runs_cpu_us_per_token": [round(c / tokens * 1e6, 1) for c in cpus],
            "audio_samples_per_request": samples}


def profile_case(mode: str, stream: bool, args: argparse.Namespace, concurrency: int, top: int = 35) -> str:
    """cProfile of every Python thread over a warm-up and 3 requests: worker threads and the conductor
    in-process; for multiproc, the worker processes' loops (each printed apart) then this process; for
    onethread, the one thread."""
    if mode == "onethread":
        prof = cProfile.Profile()
        prof.runcall(time_onethread, stream, args, 3, concurrency)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        return out.getvalue()
    if mode == "multiproc":
        with tempfile.TemporaryDirectory() as tmp:
            os.environ[PROFILE_ENV] = tmp
            try:
                time_case(mode, stream, args, runs=3, concurrency=concurrency)
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
        time_case(mode, stream, args, runs=3, concurrency=concurrency)
        main.disable()
    finally:
        threading.Thread.run = original
    out = io.StringIO()
    stats = pstats.Stats(main, stream=out)
    for prof in profiles:
        stats.add(prof)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


CASES = {"onethread:nostream": ("onethread", False, 1), "onethread:stream": ("onethread", True, 1),
         "inproc:nostream": ("inproc", False, 1), "inproc:stream": ("inproc", True, 1),
         "multiproc:nostream": ("multiproc", False, 1), "multiproc:stream": ("multiproc", True, 1),
         "multiproc:stream:2workers": ("multiproc", True, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", choices=("fake", "tiny", "dummy"), default="fake",
                        help="instant fakes; the real tiny Orpheus; Orpheus-3B with dummy weights (GPU)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--cases", default=",".join(c for c in CASES if not c.startswith("onethread")),
                        help=f"comma-separated, from {list(CASES)} (onethread: fakes only, not by default)")
    parser.add_argument("--concurrency", default="1",
                        help="comma-separated requests in flight at once, e.g. 1,8,32 (each case runs at each)")
    parser.add_argument("--tokens", type=int, default=TOKENS,
                        help="generated tokens per request: more makes each timed round longer and steadier")
    parser.add_argument("--profile", metavar="CASE",
                        help="print a cProfile of CASE (all threads) at the first --concurrency and exit")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/runtime_per_token_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.profile:
        mode, stream, _ = CASES[args.profile]
        sys.stdout.write(profile_case(mode, stream, args, levels[0]))
        return
    cases = {}
    for concurrency in levels:
        for name in args.cases.split(","):
            mode, stream, workers = CASES[name]
            if args.model != "fake" and (not stream or mode == "onethread"):
                continue
            key = name if concurrency == 1 else f"{name}@{concurrency}"
            if mode == "onethread":
                cases[key] = time_onethread(stream, args, args.runs, concurrency)
            else:
                cases[key] = time_case(mode, stream, args, args.runs, workers, concurrency)
            sys.stdout.write(f"{key}: {cases[key]}\n")
    result = {"command": "python3 " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                          "torch": torch.__version__},
              "tokens_per_request": args.tokens, "model": args.model, "device": args.device,
              "cases": cases}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
