"""Measure (not assert) what json_schema-constrained decoding costs per decode step on one GPU (#43).

Model: a Llama with the shape of Llama-3.1-8B (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336,
vocab 128,256, untied), bf16, `load_format="dummy"` (seeded random weights), over the real Llama-3 vocabulary:
the tokenizer folder `cached_tokenizer_folder("llama3")` builds (128,000 tiktoken ranks + 256 specials), so
xgrammar masks a real 128k vocabulary. The model and its component are built as a worker builds them
(`runtime.build.build_model`, `Model.build_component`, `build_autoregressive_engine`: CUDA graphs, sampler
graphs, lookahead and step graphs as served), and the engine is driven directly, as `decode_step.py` does.

For each batch B: B requests decode together, temperature 1, each one engine loop. `free`: unconstrained,
ignore_eos, a fixed max_tokens. `json_schema`: every request constrained to a schema of
`grammar_mask_cost.SCHEMAS` (taken in turn); a request whose JSON completes is replaced at once by a new
one, so B rows keep decoding. Only steady steps are timed: every row decodes one token and none is being
prefilled, after `--warm-steps` such steps. Per case: ms per step (wall time of `engine.step()`: mean and
p50), the host time of the grammar itself per step (the matchers' `fill_bitmask` and `accept`, timed by
wrapping the model's `Grammars`, whose contract the engine calls), and JSON documents completed. Per
batch: the median over `--runs` runs of each figure (free and constrained runs alternate), and the mask
cost per step = constrained - free ms per step (it includes what of the grammar's host time the forward
does not hide, the masks' copy and their application on the device; see engines/token_masks.py). A constrained warm-up case at each
batch (not timed) first fills the grammar caches, as a server that has run a while has them.

With random weights the text is a random walk through what the grammar allows, mostly long strings;
real models' JSON visits more structural states. The figure is the machinery's cost, not a model's.

On a bare lent GPU machine (carry `.whl` and `.devscratch/mstar_tokenizers/llama3-v1`, where
benchmarks/device_setup.sh says how to make both; xgrammar's wheel is in `.whl`):

    source benchmarks/device_setup.sh && OUT=$OUT bash benchmarks/gpu_suite.sh structured
    # which runs: python3 benchmarks/structured_decode.py --batch 1 16 --out $OUT/structured_decode_<gpu>.json

It writes `benchmarks/results/structured_decode_<gpu>.json` without `--out`. On CPU, in seconds:

    python3 benchmarks/structured_decode.py --quick    # the tiny Llama (320-token vocabulary), no file
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from benchmarks.grammar_mask_cost import SCHEMAS  # noqa: E402
from benchmarks.results_io import gpu_tag, write_results  # noqa: E402
from mstar.config import config_from_dict  # noqa: E402
from mstar.engines.autoregressive import AutoregressiveEngine, build_autoregressive_engine  # noqa: E402
from mstar.engines.base import LoopSpec, StepItem  # noqa: E402
from mstar.engines.grammar import GrammarMatcher, Grammars, canonical_spec  # noqa: E402
from mstar.runtime.build import build_model  # noqa: E402

logger = logging.getLogger(__name__)

LLAMA31_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
PAGE = 16


class TimedGrammars:
    """A model's `Grammars` whose matchers add the host seconds of their mask fills and accepts here."""

    def __init__(self, inner: Grammars) -> None:
        self.inner = inner
        self.fill_s = 0.0
        self.accept_s = 0.0

    def matcher(self, spec: str) -> GrammarMatcher:
        return TimedMatcher(self.inner.matcher(spec), self)


class TimedMatcher:
    """One sequence's matcher, timed (`GrammarMatcher`)."""

    def __init__(self, inner: GrammarMatcher, clock: TimedGrammars) -> None:
        self.inner = inner
        self.clock = clock

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        t0 = time.perf_counter()
        self.inner.fill_bitmask(bitmask, row)
        self.clock.fill_s += time.perf_counter() - t0

    def accept(self, token_id: int) -> bool:
        t0 = time.perf_counter()
        ok = self.inner.accept(token_id)
        self.clock.accept_s += time.perf_counter() - t0
        return ok

    def is_finished(self) -> bool:
        return self.inner.is_finished()


@contextmanager
def checkpoint_folder(quick: bool, hf_config: dict[str, Any] | None = LLAMA31_8B) -> Iterator[str | None]:
    """A folder holding only the full-size `hf_config` as config.json (dummy weights need no weight files);
    None for --quick, or without a config (a model whose dummy weights need no folder)."""
    if quick or hf_config is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="structured_decode_") as folder:
        (Path(folder) / "config.json").write_text(json.dumps(hf_config))
        yield folder


def build_engine(args: argparse.Namespace, folder: str | None) -> tuple[AutoregressiveEngine, TimedGrammars, Any]:
    """The `llm` engine as a worker builds it, its grammars timed; with the model (for its tokenizer)."""
    max_model_len = args.prompt_len + max_tokens(args) + PAGE
    kwargs: dict[str, Any] = {"max_model_len": max_model_len}
    if not args.quick:
        from mstar.models.common.tokenizer_build import cached_tokenizer_folder

        kwargs["tokenizer_path"] = str(cached_tokenizer_folder("llama3"))
    config = config_from_dict({"model": "llama", "device": "cpu" if args.quick else "cuda", "model_kwargs": kwargs})
    model = build_model(config, tiny=args.quick, load_format="auto" if args.quick else "dummy", model_path=folder)
    built = model.build_component("llm", args.device)
    assert built.engine.grammars is not None, "the llama model gives its engine grammars"
    timed = TimedGrammars(built.engine.grammars)
    spec = dataclasses.replace(built.engine, grammars=timed)
    # every sequence of a case fits at once, replacements included (finished ones free their pages)
    pages = 2 * max(args.batch) * (-(-max_model_len // PAGE) + 1) + 64
    engine = build_autoregressive_engine(built.module, spec, config.kv_cache, args.device, config.cuda_graphs, pages)
    return engine, timed, model


def max_tokens(args: argparse.Namespace) -> int:
    return args.warm_steps + args.steps + 8  # a free row outlives the timed steps


def run_case(engine: AutoregressiveEngine, clock: TimedGrammars, args: argparse.Namespace, batch: int,
             specs: list[str] | None, tag: str, steps: int) -> dict[str, float]:
    """`steps` steady decode steps of `batch` rows, free (`specs` None) or each row constrained to a spec of
    `specs` in turn (a finished row replaced by a new one); ms per step and grammar host ms per step."""
    gen = torch.Generator().manual_seed(batch)
    torch.manual_seed(batch)  # the engine's shared sampling randomness
    options: dict[str, Any] = {"temperature": 1.0, "max_tokens": max_tokens(args)}
    if specs is None:
        options["ignore_eos"] = True
    count, live, unstarted = itertools.count(), set(), set()

    def start() -> None:
        n = next(count)
        rid = f"{tag}-{n}"
        prompt = torch.randint(0, args.prompt_vocab, (args.prompt_len,), generator=gen)
        row = options if specs is None else {**options, "structured_outputs": specs[n % len(specs)]}
        engine.submit(StepItem(rid, "gen", "llm", {"input_ids": prompt}, row, loop=LoopSpec(max_tokens(args))))
        live.add(rid)
        unstarted.add(rid)

    for _ in range(batch):
        start()
    times, grammar, steady, completed = [], [], 0, 0
    for _ in range(50 * (args.warm_steps + steps) + 64):  # bounded: a case that never steadies fails below
        if len(times) == steps:
            break
        was_steady, before = not unstarted, clock.fill_s + clock.accept_s
        t0 = time.perf_counter()
        results = engine.step()
        elapsed = time.perf_counter() - t0
        if was_steady and len(results) == batch:  # every row decoded one token; none was prefilled
            steady += 1
            if steady > args.warm_steps:
                times.append(elapsed)
                grammar.append(clock.fill_s + clock.accept_s - before)
        for r in results:
            assert r.error is None, f"{r.request_id}: {r.error}"
            unstarted.discard(r.request_id)
            if not r.more:  # its engine loop ended: the JSON completed (or, rarely, max_tokens)
                live.discard(r.request_id)
                completed += r.finish_reason == "stop"
                start()
    assert len(times) == steps, f"{tag}: only {len(times)} of {steps} steady steps at batch {batch}"
    for rid in live:
        engine.release(rid)
    engine.step()  # drops a step launched ahead for the released rows
    assert not engine.has_work()
    return {"ms_per_step": 1e3 * statistics.fmean(times), "ms_p50": 1e3 * statistics.median(times),
            "ms_max": 1e3 * max(times), "grammar_host_ms_per_step": 1e3 * statistics.fmean(grammar),
            "json_completed": completed}


def bounded(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with every string at most 8 characters and every array at most 3 items."""
    out = {k: bounded(v) if k == "items" else v for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {name: bounded(sub) for name, sub in schema["properties"].items()}
    if schema.get("type") == "string":
        out["maxLength"] = 8
    if schema.get("type") == "array":
        out["maxItems"] = min(schema.get("maxItems", 3), 3)
    return out


def cases() -> dict[str, list[str] | None]:
    """Case name -> the specs its rows take in turn (None: free). `json_schema`: the schemas as written, whose
    strings random weights make long; `json_schema_bounded`: the same bounded, so documents complete in tens
    of tokens and a row's steps visit the structural states (keys, separators, enums, numbers) too."""
    return {"free": None,
            "json_schema": [canonical_spec({"json_schema": s}) for s in SCHEMAS.values()],
            "json_schema_bounded": [canonical_spec({"json_schema": bounded(s)}) for s in SCHEMAS.values()]}


def measure_batch(engine: AutoregressiveEngine, clock: TimedGrammars, args: argparse.Namespace,
                  batch: int) -> dict[str, Any]:
    """Every case at `batch`, taking turns for `--runs` runs; each figure's median over the runs, and each
    constrained case's mask cost (its ms per step less the free case's)."""
    specs = cases()
    for name, case in specs.items():  # untimed: fills the sampler's and the grammars' caches
        run_case(engine, clock, args, batch, case, f"warm-{name}-b{batch}", args.steps)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in specs}
    for r in range(args.runs):
        for name, case in specs.items():
            runs[name].append(run_case(engine, clock, args, batch, case, f"{name}-b{batch}-{r}", args.steps))
    row: dict[str, Any] = {"batch": batch}
    for name, results in runs.items():
        row[name] = {k: round(statistics.median(run[k] for run in results), 3) for k in results[0]}
    free = row["free"]
    for name in specs:
        if name != "free":
            cost = row[name]["ms_per_step"] - free["ms_per_step"]
            row[name].update(mask_cost_ms_per_step=round(cost, 3),
                             mask_cost_pct_of_free_step=round(100 * cost / free["ms_per_step"], 1),
                             mask_cost_p50_ms=round(row[name]["ms_p50"] - free["ms_p50"], 3))
    row["runs"] = {name: [{k: round(v, 3) for k, v in run.items()} for run in results]
                   for name, results in runs.items()}
    return row



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny Llama on CPU, few steps (smoke test, no file)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=None, help="timed steady steps per case (default 256; --quick 12)")
    p.add_argument("--warm-steps", type=int, default=None, help="steady steps left untimed (default 16; --quick 2)")
    p.add_argument("--runs", type=int, default=None, help="runs per case, median kept (default 3; --quick 1)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/structured_decode_<gpu>.json; "
                                               "--quick: none)")
    args = p.parse_args(argv)
    args.steps = args.steps or (12 if args.quick else 256)
    args.warm_steps = args.warm_steps if args.warm_steps is not None else (2 if args.quick else 16)
    args.runs = args.runs or (1 if args.quick else 3)
    if min(args.batch) < 1 or args.steps < 1 or args.runs < 1:
        p.error("--batch, --steps and --runs must be >= 1")
    args.device = torch.device("cpu" if args.quick else "cuda")
    if not args.quick and not torch.cuda.is_available():
        p.error("no CUDA device here: pass --quick (tiny, CPU)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    t0 = time.perf_counter()
    with checkpoint_folder(args.quick) as folder:
        engine, clock, model = build_engine(args, folder)
        setup_s = time.perf_counter() - t0
        vocab = model.tokenizer.vocab_size
        args.prompt_vocab = min(vocab, 128000)  # below the Llama-3 specials
        logger.info("engine ready in %.1f s (vocabulary %d)", setup_s, vocab)
        rows = []
        for batch in args.batch:
            rows.append(measure_batch(engine, clock, args, batch))
            logger.info("batch %d: %s", batch, json.dumps({k: v for k, v in rows[-1].items() if k != "runs"}))
    device = "cpu" if args.quick else torch.cuda.get_device_name(args.device)
    doc = {"benchmark": "structured_decode", "command": "python3 benchmarks/structured_decode.py " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "device": device, "torch": torch.__version__, "xgrammar": version("xgrammar"),
           "python": platform.python_version(),
           "model": "tiny Llama, float32" if args.quick else "Llama-3.1-8B shape, bf16, dummy weights",
           "tokenizer": "tiny (320 tokens)" if args.quick else "llama3 (cached_tokenizer_folder('llama3'))",
           "vocab_size": vocab, "schemas": {name: [json.loads(spec)["json_schema"] for spec in specs] for name, specs in cases().items()
                       if specs is not None}, "prompt_len": args.prompt_len, "steps": args.steps,
           "warm_steps": args.warm_steps, "runs": args.runs, "engine_setup_s": round(setup_s, 1),
           "cuda_graphs": engine.runner.graphs is not None, "lookahead": engine.lookahead, "rows": rows}
    name = "structured_decode_" + ("cpu" if args.quick else gpu_tag(device))
    out = write_results(doc, args.out, args.quick, name)
    logger.info("wrote %s", out or "no file (--quick)")
    return doc


if __name__ == "__main__":
    main()
