"""BAGEL-7B-MoT served offline (in process, or a process per worker), dummy weights, bf16 (asserts nothing).

- `understanding`: an image (the ViT's 980 px) and a question, `--tokens` answer tokens each (eos ignored),
  at each `--concurrency`: time to the first answer token (p50) and answer tokens per second over all
  requests.
- `generation`: text to image at `--size`, `--steps` timesteps, text guidance 4 on the interval [0.4, 1]:
  seconds end to end (prompt to decoded image), concurrency 1.
- `editing`: an image of `--size` and an instruction, all three guidance branches over the whole grid:
  seconds end to end, concurrency 1.

`--cases` picks among the three (default all). A text-to-image request and, with `understanding`, a short
understanding request at each concurrency run first, unmeasured (first-call kernel choices and allocations).
After the measured cases, `--profile` runs one understanding decode step at the highest `--concurrency` (with
`understanding`) and one text-to-image denoising step under torch.profiler inside the worker, and writes each
one's top-25 ops by self device time (self CPU time on CPU) into the JSON (`profile`) and the log.

`--quantization none fp8`: the deployment once per setting, one after the other in the same run (`fp8`:
`quantization: {llm: fp8}`, both experts' decoder linears in FP8, W8A8 through torch._scaled_mm on CUDA from
16 rows). `--configs bagel bagel_cfg_parallel` (shipped names or YAML paths of model bagel; default `bagel`):
the deployment of each config, likewise (with both flags, every config under every quantization, named
`<config>_<quantization>`). The first setting's results are at the top level of the JSON (`config` and
`quantization` name it); each later setting's are under `settings.<name>` (a config's name is its file stem).
With several settings each image case first runs once untimed with option `debug_outputs` (which also warms
that case up), for its final latents; each later setting's generation and editing then report, against the
first setting's of the same seed, the image's PSNR (dB) and largest pixel difference, the final latents'
largest absolute difference (`latents_max_abs` gives their scale) and the seconds ratio. The weights are
dummy (seeded random, the FP8 ones the same weights quantized), so the images are not natural pictures: the
PSNR measures how far a setting moves the output, not how it looks.

`--mode` is the runtime's run mode for every setting (default `auto`: a process per worker when a config has
several workers, as `bagel_cfg_parallel` does, else in process). Each setting's JSON lists its workers'
devices (`workers`: a rank's GPU is its rank modulo `gpus_visible`). `peak_gb` (GPU 0's allocator peak) is
recorded in process only, and `--profile` needs it.

    python3 benchmarks/bagel_bench.py                   # GPU: writes benchmarks/results/bagel_bench_<gpu>.json
    python3 benchmarks/bagel_bench.py --concurrency 1 16 --tokens 64 256
    python3 benchmarks/bagel_bench.py --quick           # tiny random model on CPU (smoke test)
    python3 benchmarks/bagel_bench.py --cases generation editing --quantization none fp8 --profile
    python3 benchmarks/bagel_bench.py --cases generation editing --configs bagel bagel_cfg_parallel  # 3 GPUs
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

from benchmarks.bagel_settings import Setting, compare_image, seconds_ratios, settings  # noqa: E402
from benchmarks.results_io import gpu_tag, write_results  # noqa: E402
from mstar.config import ConfigError  # noqa: E402

QUESTION = "Describe this picture in detail: the objects, their colors and what is happening."
PROMPT = "A female cosplayer portraying an ethereal fairy, flowing emerald dress, a glowing magical forest behind."
CASES = ("understanding", "generation", "editing")
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
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="which cases (default all)")
    parser.add_argument("--quantization", nargs="+", choices=["none", "fp8", "fp8_block"], default=["none"],
                        help="the deployment once per setting (the LLM's decoder linears in FP8 for fp8/fp8_block); "
                        "later settings are compared to the first")
    parser.add_argument("--configs", nargs="+", default=["bagel"],
                        help="deployment configs (shipped names or YAML paths, model bagel), one after another; "
                        "later configs are compared to the first (default bagel)")
    parser.add_argument("--mode", choices=["auto", "inproc", "multiproc"], default="auto",
                        help="run mode of every setting (default auto: multiproc when a config has several "
                        "workers, else inproc)")
    args = parser.parse_args(argv)
    args.device = torch.device("cpu" if args.quick else "cuda")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --quick (tiny, CPU)")
    try:
        args.settings = settings(args.configs, args.quantization, cpu=args.quick)
    except (ValueError, ConfigError) as exc:
        parser.error(str(exc))
    if args.mode == "auto":
        args.mode = "multiproc" if any(s.config.num_workers > 1 for s in args.settings) else "inproc"
    if args.profile and args.mode != "inproc":
        parser.error(f"--profile reads the LLM engine in this process, which --mode {args.mode} does not run: "
                     "pass --mode inproc")
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
    if args.device.type == "cuda":  # work queued before this case is not timed
        torch.cuda.synchronize()
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


def image_request(args: argparse.Namespace, edit: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The request and options of the text-to-image case (or the editing case)."""
    options: dict[str, Any] = {"modalities": ["image"], "num_inference_steps": args.steps, "seed": 0}
    if edit:
        return {"text": EDIT, "media": [{"type": "image", "data": image(args.size, 2)}]}, options
    return {"text": PROMPT}, {**options, "size": f"{args.size}x{args.size}", "guidance_scale": 4.0,
                              "cfg_interval": [0.4, 1.0]}


def image_case(m, args: argparse.Namespace, edit: bool) -> tuple[dict[str, Any], np.ndarray]:
    """Seconds of one generation (or edit) end to end, and its uint8 image [H, W, 3] on the host."""
    request, options = image_request(args, edit)
    if args.device.type == "cuda":  # work queued before this case is not timed
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = m.submit(request, **options).result()
    # in process the image is a GPU tensor handed over by reference, perhaps still being computed: the clock
    # stops once it is on the host
    picture = result.outputs["image"][0].cpu().numpy()
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 3), "image": list(picture.shape), "steps": args.steps}, picture


def final_latents(m, args: argparse.Namespace, edit: bool) -> torch.Tensor:
    """The image case's latents after its last step (float32, host), from an untimed run of the same seed."""
    request, options = image_request(args, edit)
    result = m.submit(request, **options, debug_outputs=True).result()
    return result.outputs["step_latents"][-1].float().cpu()


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
    """Top-25 op tables of one decode step at the highest concurrency (with the understanding case) and one
    text-to-image denoising step."""
    profiler = StepProfiler(m.runtime.workers[0].engines["llm"].module, args.device.type == "cuda")
    concurrency, out = max(args.concurrency), {}
    if "understanding" in args.cases:
        profiler.expect("decode", concurrency, skip=2)  # past the first steps' first-call kernel choices
        understanding_case(m, args, concurrency, max(*args.tokens, 16))  # requests that start apart still meet
        out[f"decode_c{concurrency}"] = profiler.found or {"table": "no decode step of that size ran"}
    profiler.expect("denoise", None, skip=1)
    image_case(m, args, edit=False)
    out["denoise_t2i"] = profiler.found or {"table": "no denoising step ran"}
    for name, case in out.items():
        print(f"== {name}: {case.get('items')} items, {case.get('step_ms_under_profiler')} ms\n{case['table']}")
    return out


def run_setting(args: argparse.Namespace, setting: Setting, doc: dict[str, Any],
                reference: dict[str, tuple[np.ndarray, torch.Tensor | None]], save) -> None:
    """Every case of `args.cases` on `setting`'s deployment, into `doc`; `reference` holds the first setting's
    image and final latents of each image case, which later settings are compared to."""
    from benchmarks.call_timing import free_memory, peak_gb
    from mstar.runtime.build import worker_device
    from mstar.runtime.offline import MStar

    free_memory(args.device)
    config, first = setting.config, args.settings[0].name
    doc["workers"] = [str(worker_device(config, rank)) for rank in range(config.num_workers)]
    kwargs = {"tiny": True} if args.quick else {"load_format": "dummy"}
    start = time.perf_counter()
    with MStar(config.model, config, mode=args.mode, **kwargs) as m:
        doc["build_s"] = round(time.perf_counter() - start, 1)
        # warm-up: first-call kernel choices (decode GEMMs pick theirs per row count) and allocations
        image_case(m, args, edit=False)
        if "understanding" in args.cases:
            doc["understanding"] = {}
            for concurrency in args.concurrency:
                understanding_case(m, args, concurrency, 8)
            for concurrency in args.concurrency:
                for tokens in args.tokens:
                    case = doc["understanding"][f"c{concurrency}_t{tokens}"] = understanding_case(
                        m, args, concurrency, tokens)
                    print(f"{setting.name} understanding c{concurrency} t{tokens}: {case}", flush=True)
                    save()
        for name in ("generation", "editing"):
            if name in args.cases:
                edit = name == "editing"
                latents = final_latents(m, args, edit) if len(args.settings) > 1 else None
                doc[name], picture = image_case(m, args, edit)
                compare_image(doc[name], reference, name, picture, latents, first)
                print(f"{setting.name} {name}: {doc[name]}", flush=True)
                save()
        if args.profile:
            doc["profile"] = profile_steps(m, args)
        if args.mode == "inproc":  # another process's allocations are not this one's to read
            doc["peak_gb"] = peak_gb(args.device)
        save()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    kind = "cpu" if args.quick else gpu_tag(torch.cuda.get_device_name())
    first = args.settings[0]
    doc: dict[str, Any] = {"device": "cpu" if args.quick else torch.cuda.get_device_name(),
                           "gpus_visible": 0 if args.quick else torch.cuda.device_count(),
                           "dtype": "float32" if args.quick else "bfloat16", "command": " ".join(sys.argv),
                           "weights": "tiny, seeded random" if args.quick else "BAGEL-7B-MoT shapes, dummy (seeded random)",
                           "config": first.source, "quantization": first.quantization, "mode": args.mode}
    # written after every case, so that a run cut short keeps what it measured
    save = partial(write_results, doc, args.out, args.quick, f"bagel_bench_{kind}")
    reference: dict[str, tuple[np.ndarray, torch.Tensor | None]] = {}
    for setting in args.settings:
        part = doc if setting is first else doc.setdefault("settings", {}).setdefault(setting.name, {})
        if setting is not first:
            part.update(config=setting.source, quantization=setting.quantization)
        run_setting(args, setting, part, reference, save)
        seconds_ratios(doc, first.name)
        save()
    print(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
