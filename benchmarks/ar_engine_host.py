"""Measure (not assert) the autoregressive engine's own host cost per sequence-step of decode, on CPU.

The engine runs the whole host path of a CUDA decode step, Orpheus-shaped, while everything the GPU
would do is an instant fake:
- decode replays the runner's "CUDA graphs" (`runner._stage`: ids, positions, slots, block tables;
  `TritonBackend.prepare`; copies into static inputs) and the graph returns fixed logits;
- sampling is `SamplerGraphs` (`RowTable.columns`, the seen-token masks of the repetition penalty,
  copies into static inputs) whose graph returns new audio token ids each step (rows of a table made
  once, so that the fake costs the host one indexing);
- lookahead is on (`_continuing`, `launch_ahead`), as on CUDA;
- prefill's eager forward returns zeros; the KV pool is tiny (the model never reads it).
Each request is one engine loop, as the decode walk runs it: the engine appends its samples, the
caller submits nothing per step. Per sequence-step it reports the CPU time of `step()` (schedule,
stage, sample prep, postprocess, lookahead) and of what the caller does with the results (`submit_us`:
nothing now; before engine loops, feeding each token back as the next item) over `--steps` decode steps
at each `--batch`, the median of `--runs` runs.

    python3 benchmarks/ar_engine_host.py --batch 1 8 16 32 --out benchmarks/results/ar_engine_host_cpu.json
    python3 benchmarks/ar_engine_host.py --batch 32 --profile     # cProfile of the decode steps

Pinned memory needs an accelerator that this machine lacks: `Tensor.pin_memory` returns the tensor
itself here (on a GPU host each step pins one small table).
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
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mstar, not whichever one is installed
os.environ.setdefault("TRITON_INTERPRET", "1")  # lets TritonBackend (its host half only) live on the CPU

from mstar.engines import sampling_graph  # noqa: E402
from mstar.engines.autoregressive import AutoregressiveEngine  # noqa: E402
from mstar.engines.base import CausalLMBase, KVLayout, LoopSpec, StepItem  # noqa: E402
from mstar.engines.kv_cache.config import KVCacheConfig  # noqa: E402
from mstar.engines.sampling_graph import SamplerGraphs  # noqa: E402

VOCAB = 156_940  # Orpheus-3B
AUDIO_BASE, AUDIO_CODES = 128_266, 7 * 4096  # audio token ids: <custom_token_10> on
END_OF_SPEECH = 128_258
ORPHEUS_OPTIONS = {"voice": "tara", "temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3,
                   "max_tokens": 1200}
PROMPT_LEN = 40
MAX_MODEL_LEN = 1280  # prompt + max_tokens fit
SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)  # CudaGraphConfig's default batch sizes
CODE_STEPS = 977  # distinct rows of fake sampled codes, used in turn


class FakeLM(CausalLMBase):
    """The CausalLM contract without compute: prefill returns zero hidden states and logits."""

    kv_layout = KVLayout(1, 1, 8, torch.float32)
    hidden_size = 8
    logit_width = VOCAB

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        return torch.zeros(len(input_ids), 8)

    def compute_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], VOCAB)


class FakeGraphs:
    """`BatchGraphs` without a GPU: `replay()` (when given) returns new static outputs; a call returns their
    first B rows. The copies into static inputs are left out: on a GPU they are a few asynchronous
    launches per step, here they would be real copies of the logits (megabytes)."""

    def __init__(self, sizes, outputs: tuple[torch.Tensor, ...], replay=None) -> None:
        self.sizes, self.outputs, self.replay = sorted(sizes), outputs, replay

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def __call__(self, *inputs: torch.Tensor, bucket: int | None = None) -> tuple[torch.Tensor, ...]:
        batch = inputs[0].shape[0]
        size = bucket or self.bucket(batch)
        assert size is not None and size >= batch and all(t.shape[0] == batch for t in inputs)
        outputs = self.outputs if self.replay is None else self.replay()
        return tuple(o[:batch] for o in outputs)


def make_engine(batch: int) -> AutoregressiveEngine:
    pages = batch * (MAX_MODEL_LEN // 16 + 1)
    engine = AutoregressiveEngine(FakeLM(), KVCacheConfig(max_num_pages=pages, attention_backend="triton"), "cpu",
                                  eos_token_ids=(END_OF_SPEECH,), max_num_seqs=max(SIZES),
                                  max_model_len=MAX_MODEL_LEN, warm_up=False, lookahead=True)
    logits = torch.zeros(max(SIZES), VOCAB)
    engine.runner.graphs = FakeGraphs(SIZES, (logits, torch.zeros(max(SIZES), dtype=torch.long)))
    # new audio codes every step, so the seen masks keep changing: rows of a table made once, in turn
    codes = (torch.arange(CODE_STEPS)[:, None] * 13 + torch.arange(max(SIZES))[None, :] * 7) % AUDIO_CODES + AUDIO_BASE
    step = iter(range(1 << 62))

    def sample() -> tuple[torch.Tensor]:
        return (codes[next(step) % CODE_STEPS],)

    # SamplerGraphs captures at its first call; what it captures here is the fake
    sampling_graph.BatchGraphs = lambda fn, sizes, *args, **kwargs: FakeGraphs(sizes, (), replay=sample)
    engine.sampler = SamplerGraphs(SIZES, torch.device("cpu"))
    return engine


def decode(engine: AutoregressiveEngine, batch: int, steps: int, warm: int) -> tuple[float, float]:
    """CPU seconds of this thread in step() and in handling the results over `steps` decode steps (after
    `warm` steps), each request an engine loop. CPU time, not wall time: the machine is shared, and a
    thread waiting for a core uses none."""
    prompt = torch.arange(PROMPT_LEN, dtype=torch.long) + 128_000
    tag = time.perf_counter_ns()
    for i in range(batch):  # each its own prompt: no prefix sharing
        ids = prompt.clone()
        ids[0] = i
        engine.submit(StepItem(f"r{tag}-{i}", "decode", "llm", {"input_ids": ids}, dict(ORPHEUS_OPTIONS),
                               loop=LoopSpec(warm + steps + 1)))
    step_s = submit_s = 0.0
    for n in range(warm + steps):
        t0 = time.thread_time()
        results = engine.step()
        t1 = time.thread_time()
        for r in results:
            assert r.error is None and not r.stop, r
        t2 = time.thread_time()
        assert len(results) == batch
        if n >= warm:
            step_s, submit_s = step_s + t1 - t0, submit_s + t2 - t1
    for i in range(batch):
        engine.release(f"r{tag}-{i}")
    return step_s, submit_s


def measure(batch: int, steps: int, runs: int) -> dict:
    engine = make_engine(batch)
    decode(engine, batch, 40, 0)  # warm-up
    step_us, submit_us = [], []
    for _ in range(runs):
        s, u = decode(engine, batch, steps, 20)
        step_us.append(s / (steps * batch) * 1e6)
        submit_us.append(u / (steps * batch) * 1e6)
    total = [a + b for a, b in zip(step_us, submit_us)]
    return {"batch": batch, "us_per_seq_step": round(statistics.median(total), 2),
            "step_us_per_seq": round(statistics.median(step_us), 2),
            "submit_us_per_seq": round(statistics.median(submit_us), 2),
            "runs_us_per_seq_step": [round(t, 2) for t in total],
            "lookahead_steps": engine.lookahead_steps,
            "sampler_replays": engine.sampler.replays if engine.sampler else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=400, help="decode steps measured per run (< 1160)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the first --batch and exit")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/ar_engine_host_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # no accelerator here (see the module docstring)
    if args.profile:
        engine = make_engine(args.batch[0])
        decode(engine, args.batch[0], 40, 0)
        prof = cProfile.Profile()
        prof.runcall(decode, engine, args.batch[0], args.steps, 0)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
        sys.stdout.write(out.getvalue())
        return
    results = []
    for batch in args.batch:
        results.append(measure(batch, args.steps, args.runs))
        sys.stdout.write(f"{results[-1]}\n")
    Path(args.out).write_text(json.dumps({
        "command": "python3 " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
                    "cpus": os.cpu_count()},
        "vocab": VOCAB, "options": ORPHEUS_OPTIONS, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
