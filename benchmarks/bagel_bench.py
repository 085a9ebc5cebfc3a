"""BAGEL-7B-MoT served in process on one GPU, dummy weights, bf16 (asserts nothing).

- `understanding`: an image (the ViT's 980 px) and a question, `--tokens` answer tokens each (eos ignored),
  at each `--concurrency`: time to the first answer token (p50) and answer tokens per second over all
  requests.
- `generation`: text to image at `--size`, `--steps` timesteps, text guidance 4 on the interval [0.4, 1]:
  seconds end to end (prompt to decoded image), concurrency 1.
- `editing`: an image of `--size` and an instruction, all three guidance branches over the whole grid:
  seconds end to end, concurrency 1.

A text-to-image request and a short understanding request at each concurrency run first, unmeasured
(first-call kernel choices and allocations). After the measured cases, `--profile` runs one understanding
decode step at the highest `--concurrency` and one text-to-image denoising step under torch.profiler inside
the worker, and writes each one's top-25 ops by self device time (self CPU time on CPU) into the JSON
(`profile`) and the log.

    python3 benchmarks/bagel_bench.py                   # GPU: writes benchmarks/results/bagel_bench_<gpu>.json
    python3 benchmarks/bagel_bench.py --concurrency 1 16 --tokens 64 256
    python3 benchmarks/bagel_bench.py --quick           # tiny random model on CPU (smoke test)
    python3 benchmarks/bagel_bench.py --profile --out benchmarks/results/bagel_bench_h100_profile.json 2>&1 | tee bagel.log
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from benchmarks.results_io import write_results  # noqa: E402

QUESTION = "Describe this picture in detail: the objects, their colors and what is happening."
PROMPT = "A female cosplayer portraying an ethereal fairy, flowing emerald dress, a glowing magical forest behind."
EDIT = "She boards a modern subway, quietly reading a folded newspaper, wearing the same clothes."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny random model on CPU (smoke test)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="understanding (default 1 16)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="answer tokens (default 64 256)")
    parser.add_argument("--size", type=int, default=None, help="image side in pixels (default 1024)")
    parser.add_argument("--steps", type=int, default=None, help="timesteps of a generation (default 50)")
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument("--profile", action="store_true", help="also profile a decode and a denoising step")
    args = parser.parse_args(argv)
    args.device = torch.device("cpu" if args.quick else "cuda")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --quick (tiny, CPU)")
    quick = args.quick
    args.concurrency = args.concurrency or ([1, 2] if quick else [1, 16])
    args.tokens = args.tokens or ([4] if quick else [64, 256])
    args.size = args.size or (64 if quick else 1024)
    args.steps = args.steps or (3 if quick else 50)
    return args


def image(size: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).random((size, size, 3)) * 255).astype(np.uint8)


def understanding_case(m, args: argparse.Namespace, concurrency: int, tokens: int) -> dict[str, Any]:
    """TTFT p50 and answer tokens/s of `concurrency` image questions at once."""
    request = {"text": QUESTION, "media": [{"type": "image", "data": image(args.size, 1)}]}
    start = time.perf_counter()
    handles = [m.submit(request, max_tokens=tokens, ignore_eos=True, temperature=0.0) for _ in range(concurrency)]

    def drain(handle) -> tuple[float | None, int]:
        """The first answer token's arrival and the answer's token count: each handle read on its own
        thread, so a request's first token is timed when it comes, not when the handles before it end."""
        first, count = None, 0
        for event in handle:
            if event.name == "text":
                count += 1
                if first is None:
                    first = time.perf_counter() - start
        return first, count

    with ThreadPoolExecutor(len(handles)) as pool:
        drained = list(pool.map(drain, handles))
    first = [f for f, _ in drained if f is not None]
    count = sum(n for _, n in drained)
    elapsed = time.perf_counter() - start
    return {"ttft_p50_s": round(statistics.median(first), 4), "tokens_per_s": round(count / elapsed, 1),
            "tokens": count, "seconds": round(elapsed, 3)}


def image_case(m, args: argparse.Namespace, edit: bool) -> dict[str, Any]:
    """Seconds of one generation (or edit) end to end."""
    if edit:
        request, options = {"text": EDIT, "media": [{"type": "image", "data": image(args.size, 2)}]}, {}
    else:
        request = {"text": PROMPT}
        options = {"size": f"{args.size}x{args.size}", "guidance_scale": 4.0, "cfg_interval": [0.4, 1.0]}
    start = time.perf_counter()
    result = m.submit(request, modalities=["image"], num_inference_steps=args.steps, seed=0, **options).result()
    seconds = time.perf_counter() - start
    shape = list(result.outputs["image"][0].shape)  # a tensor on the GPU in process
    return {"seconds": round(seconds, 3), "image": shape, "steps": args.steps}


class StepProfiler:
    """Profiles one forward of the LLM component, the one after `skip` forwards of the expected walk and size,
    in the worker thread that runs it (the profiler records the thread that starts it)."""

    def __init__(self, llm, cuda: bool) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.llm, self.run_items = llm, llm.run_items
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.want: tuple[str, int | None] | None = None  # (walk, items or None for any)
        self.skip, self.found = 0, None
        with profile(activities=self.activities):  # the profiler's backend must first start on this thread
            pass
        llm.run_items = self._run_items

    def expect(self, walk: str, items: int | None, skip: int) -> None:
        self.want, self.skip, self.found = (walk, items), skip, None

    def _run_items(self, items):
        if self.want is None or items[0].walk != self.want[0] or self.want[1] not in (None, len(items)):
            return self.run_items(items)
        if self.skip:
            self.skip -= 1
            return self.run_items(items)
        self.want = None
        from torch.profiler import profile

        cuda = len(self.activities) > 1
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        with profile(activities=self.activities) as prof:
            start = time.perf_counter()
            out = self.run_items(items)
            sync()
            seconds = time.perf_counter() - start
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        self.found = {"items": len(items), "step_ms_under_profiler": round(seconds * 1e3, 3), "sorted_by": sort,
                      "table": prof.key_averages().table(sort_by=sort, row_limit=25)}
        return out


def profile_steps(m, args: argparse.Namespace) -> dict[str, Any]:
    """Top-25 op tables of one decode step at the highest concurrency and one text-to-image denoising step."""
    profiler = StepProfiler(m.runtime.workers[0].engines["llm"].module, args.device.type == "cuda")
    concurrency, out = max(args.concurrency), {}
    profiler.expect("decode", concurrency, skip=2)  # past the first steps' first-call kernel choices
    understanding_case(m, args, concurrency, max(*args.tokens, 16))  # requests that start apart still meet
    out[f"decode_c{concurrency}"] = profiler.found or {"table": "no decode step of that size ran"}
    profiler.expect("denoise", None, skip=1)
    image_case(m, args, edit=False)
    out["denoise_t2i"] = profiler.found or {"table": "no denoising step ran"}
    for name, case in out.items():
        print(f"== {name}: {case.get('items')} items, {case.get('step_ms_under_profiler')} ms\n{case['table']}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from mstar.runtime.offline import MStar

    kind = "cpu" if args.quick else torch.cuda.get_device_name().split()[-1].lower()
    kwargs = {"tiny": True} if args.quick else {"load_format": "dummy"}
    doc: dict[str, Any] = {"device": "cpu" if args.quick else torch.cuda.get_device_name(),
                           "dtype": "float32" if args.quick else "bfloat16", "command": " ".join(sys.argv),
                           "understanding": {}}
    # written after every case, so that a run cut short keeps what it measured
    save = partial(write_results, doc, args.out, args.quick, f"bagel_bench_{kind}")
    with MStar("bagel", **kwargs) as m:
        # warm-up: first-call kernel choices (decode GEMMs pick theirs per row count) and allocations
        image_case(m, args, edit=False)
        for concurrency in args.concurrency:
            understanding_case(m, args, concurrency, 8)
        for concurrency in args.concurrency:
            for tokens in args.tokens:
                case = doc["understanding"][f"c{concurrency}_t{tokens}"] = understanding_case(m, args, concurrency,
                                                                                              tokens)
                print(f"understanding c{concurrency} t{tokens}: {case}", flush=True)
                save()
        for name, edit in (("generation", False), ("editing", True)):
            doc[name] = image_case(m, args, edit=edit)
            print(f"{name}: {doc[name]}", flush=True)
            save()
        if args.profile:
            doc["profile"] = profile_steps(m, args)
            save()
    print(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
