"""Measure (not assert) what prefill/decode disaggregation with layer-streamed K/V costs (#41, #46).

Models (`--model`, bf16, `load_format="dummy"`): `llama`, the Llama-3.1-8B shape of `structured_decode.py`;
`orpheus`, a Llama of Orpheus-3B's shape (`ORPHEUS_3B_CONFIG` of mstar/models/orpheus/weights.py, the LM
alone, served as model `llama`); both read the llama3 tokenizer folder. `qwen3_omni`: the full-size
Qwen3-Omni-30B-A3B (its built-in dummy config, the qwen3-omni tokenizer folder), text in and text out, so
only the thinker computes (the other components are built, as each config places them). Each is served in
this process by `MStar` twice: `colocated` (llama.yaml / qwen3_omni.yaml: one worker) and `disaggregated`
(llama_pd.yaml / qwen3_omni_pd.yaml: the prefill walk on worker 0, the decode walk on worker 1, K/V moving
layer by layer while the prefill computes; docs/operations.md, "Prefill/decode disaggregation"). Colocated
takes, as `mstar serve` does, the first of the shipped config and its variants for smaller cards that fits
the GPU (qwen3_omni_80gb.yaml on an 80 GB card, 16 requests at once). Worker r runs on GPU r modulo the
visible GPUs: on one GPU both processes share it (CUDA IPC), on two the prefill runs on GPU 0 and the decode
on GPU 1. Both layouts get an explicit KV pool of the same size (with --concurrency, sized for the largest
level's requests, or for as many as the config holds at once if fewer).

Without `--concurrency`: for each prompt length (`--prompt-lens`), one request at a time, greedy, eos
ignored, `--decode-tokens` tokens, each repeat a new random prompt (no prefix-cache hit), after one untimed
warm-up request: the time to the first token (the prefill walk's token, on worker 0), the gap from it to the
second token (the decode walk's first: on the decode worker this includes waiting for the stream's end and
adopting the pages; colocated it is one decode step), and the decode tokens/s after the first token; p50
over `--repeats`. Then `prefill_tap`: one engine built in process as a worker builds it (after both servers
closed), timing one prefill of each length as served (`plain`: `submit`, CUDA graphs where they apply) and
streamed to a sink that drops what it gets (`streamed`: `submit_streamed`, `stream_kv`; the eager forward
through the runner's layer tap, each layer's K/V gathered from the cache as for a real receiver, no
transport): the difference is the tap's own cost on the compute path.

With `--concurrency 1 16 64`: at each level, after one untimed round, `--repeats` rounds of that many
requests submitted at once (greedy, eos ignored, the one prompt length of `--prompt-lens`, `--decode-tokens`
tokens each, new random prompts every round, the same ones in both layouts): time to first token p50 and
max over the rounds' requests (each from its own submission), decode tokens/s over all requests (tokens
after each request's first, over the span from the round's first first token to its last token) and per
request (p50), and the round's seconds; p50 over rounds. `greedy` compares the two layouts' tokens of the
timed rounds per level: `tokens_equal`, how many requests matched, and the first mismatch (round, request,
token index, both tokens; None for a missing token). On GPU a batch's composition can differ between the
layouts, so bf16 numerics may part greedy paths; the benchmark reports it and asserts nothing.

After each layout, the engines' stats per rank as the workers last reported them (`prompt_tokens` on the
decode worker is 0 when nothing was recomputed; `kv_pages_sent` / `kv_pages_received`).

On a bare lent GPU machine (carry `.whl` and the tokenizer folders, `.devscratch/mstar_tokenizers/llama3-v1`
and, for qwen3_omni, `qwen3-omni-v2` (or `.devscratch/tok.tar.xz`), which benchmarks/device_setup.sh says
how to make):

    source benchmarks/device_setup.sh && OUT=$OUT bash benchmarks/gpu_suite.sh pd
    # which runs: python3 benchmarks/pd_stream.py --out $OUT/pd_stream_<gpu>.json
    source benchmarks/device_setup.sh && OUT=$OUT bash benchmarks/gpu_suite.sh pd2   # two GPUs
    # which runs, per model: python3 benchmarks/pd_stream.py --model orpheus --concurrency 1 16 64 ...

Without `--out` it writes `benchmarks/results/pd_stream_<gpu>[_<n>gpu][_<model>][_concurrency].json`. On CPU
(tiny models, two worker processes; the llama one-at-a-time run about 20 s):

    python3 benchmarks/pd_stream.py --quick [--model qwen3_omni] [--concurrency 1 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import platform
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from benchmarks.results_io import gpu_tag, write_results  # noqa: E402
from benchmarks.structured_decode import LLAMA31_8B, PAGE, checkpoint_folder  # noqa: E402
from mstar.conductor.request_state import FinishEvent, OutputEvent  # noqa: E402
from mstar.config import MStarConfig, config_from_dict, load_config  # noqa: E402
from mstar.engines.autoregressive import AutoregressiveEngine, build_autoregressive_engine  # noqa: E402
from mstar.engines.base import StepItem  # noqa: E402
from mstar.engines.kv_handoff import KVStreamEnd  # noqa: E402
from mstar.models.orpheus.weights import ORPHEUS_3B_CONFIG  # noqa: E402
from mstar.runtime.build import build_model  # noqa: E402
from mstar.runtime.memory_plan import fitting_config, memory_variants  # noqa: E402
from mstar.runtime.offline import MStar  # noqa: E402

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One `--model`: what is served, from which config.json (None: the model's own dummy config), with
    which tokenizer folder, and the shipped config of each layout."""

    served: str  # the registered model name
    label: str
    hf_config: dict[str, Any] | None
    tokenizer: str | None  # cached_tokenizer_folder's name; None: the model finds its own
    component: str  # the autoregressive component the prompts go through
    prompt_vocab: int  # random prompt ids stay below the special tokens
    layouts: dict[str, str]  # row name -> the shipped config it follows


LLAMA_LAYOUTS = {"colocated": "llama", "disaggregated": "llama_pd"}
SHAPES = {
    "llama": Shape("llama", "Llama-3.1-8B shape, bf16, dummy weights", LLAMA31_8B, "llama3", "llm", 128000,
                   LLAMA_LAYOUTS),
    "orpheus": Shape("llama", "Llama of Orpheus-3B's shape, bf16, dummy weights", ORPHEUS_3B_CONFIG, "llama3",
                     "llm", 128000, LLAMA_LAYOUTS),
    "qwen3_omni": Shape("qwen3_omni", "Qwen3-Omni-30B-A3B, bf16, dummy weights, text out (thinker)", None, None,
                        "thinker", 151643, {"colocated": "qwen3_omni", "disaggregated": "qwen3_omni_pd"}),
}
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_model_len": max(args.prompt_lens) + args.decode_tokens + PAGE}
    if not args.quick and args.shape.tokenizer:
        from mstar.models.common.tokenizer_build import cached_tokenizer_folder

        kwargs["tokenizer_path"] = str(cached_tokenizer_folder(args.shape.tokenizer))
    return kwargs


def pool_pages(args: argparse.Namespace, in_flight: int = 1) -> int:
    """One request at a time: room for the longest twice over (one finishing while the next starts); with
    --concurrency, for the largest level's requests at once, or the `in_flight` a config holds if fewer; and
    some slack."""
    pages = -(-(max(args.prompt_lens) + args.decode_tokens) // PAGE)
    return (min(max(args.concurrency), in_flight) * (pages + 1) if args.concurrency else 2 * pages) + 64


def served_config(layout: str, args: argparse.Namespace) -> MStarConfig:
    """The shipped config of `layout` on this device, with the benchmark's pool and context; colocated, the
    first of it and its variants for smaller cards that fits the GPU, as `mstar serve` picks (on an 80 GB
    card qwen3_omni_80gb.yaml: fewer requests at once)."""
    names = [args.shape.layouts[layout]] + (memory_variants(args.shape.served) if layout == "colocated" else [])
    configs = [dataclasses.replace(base, device=args.device.type, model_kwargs=model_kwargs(args),
                                   kv_cache=dataclasses.replace(
                                       base.kv_cache, max_num_pages=pool_pages(args, base.max_concurrent_requests)))
               for base in map(load_config, names)]
    return fitting_config(configs, tiny=args.quick)


class Collected:
    """One submitted request's text events as the conductor's sink receives them: arrival stamps and ids."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, int]] = []
        self.ids: list[int] = []
        self.finish: FinishEvent | None = None
        self.done = threading.Event()
        self.t0 = time.perf_counter()

    def __call__(self, event: OutputEvent | FinishEvent) -> None:
        if isinstance(event, FinishEvent):
            self.finish = event
            self.done.set()
        elif event.name == "text":
            ids = event.value.reshape(-1).tolist()
            self.stamps.append((time.perf_counter(), len(ids)))
            self.ids += ids

    def wait(self, timeout_s: float) -> None:
        if not self.done.wait(timeout_s) or self.finish is None or self.finish.error is not None:
            raise RuntimeError(f"request: {self.finish.error if self.finish else 'timed out'}")
        if len(self.stamps) < 2:
            raise RuntimeError(f"request: {len(self.stamps)} text events, a decode walk needs two or more")

    def decode_tokens_per_s(self) -> float:
        (t1, n1), (t_last, _) = self.stamps[0], self.stamps[-1]
        return (len(self.ids) - n1) / (t_last - t1)


def submit(m: MStar, prompt: torch.Tensor, max_tokens: int) -> Collected:
    """Submit `prompt`'s ids greedily for `max_tokens` tokens; its events gather in the returned sink."""
    sink = Collected()
    options = m.runtime.model.request_options({**GREEDY, "max_tokens": max_tokens})
    m.runtime.submit(uuid.uuid4().hex, {"prompt_ids": prompt}, options, sink)
    return sink


def timed_request(m: MStar, prompt: torch.Tensor, max_tokens: int, timeout_s: float = 600.0) -> dict[str, float]:
    """One request of `prompt`'s ids run alone: seconds to the first token, first to second token, and the
    decode tokens/s after the first (each text event's arrival, stamped in the conductor's sink)."""
    req = submit(m, prompt, max_tokens)
    req.wait(timeout_s)
    (t1, _), (t2, _) = req.stamps[0], req.stamps[1]
    return {"ttft_s": t1 - req.t0, "first_to_second_s": t2 - t1, "decode_tokens_per_s": req.decode_tokens_per_s()}


def timed_round(m: MStar, prompts: list[torch.Tensor], max_tokens: int,
                timeout_s: float = 900.0) -> tuple[dict[str, Any], list[list[int]]]:
    """`prompts` submitted at once: the round's figures (module doc) and each request's token ids."""
    t0 = time.perf_counter()
    reqs = [submit(m, p, max_tokens) for p in prompts]
    for r in reqs:
        r.wait(timeout_s)
    first = min(r.stamps[0][0] for r in reqs)
    last = max(r.stamps[-1][0] for r in reqs)
    decoded = sum(len(r.ids) - r.stamps[0][1] for r in reqs)
    row = {"ttft_s": [r.stamps[0][0] - r.t0 for r in reqs], "decode_tokens_per_s": decoded / (last - first),
           "request_decode_tokens_per_s": statistics.median(r.decode_tokens_per_s() for r in reqs),
           "round_s": last - t0}
    return row, [r.ids for r in reqs]


def engine_stats(m: MStar, component: str, timeout_s: float = 15.0) -> dict[str, dict[str, float]]:
    """rank -> `component`'s engine stats (cumulative, warm-ups included) once two of the workers' reports
    in a row agree (they report about twice a second)."""
    last: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.6)
        now = {str(rank): dict(c.gauges) for rank, ws in sorted(m.runtime.conductor.worker_stats().items())
               for c in ws.components if c.component == component}
        if now and now == last:
            break
        last = now
    return last


def prompt_vocab(processor: Any, args: argparse.Namespace) -> int:
    """Random prompt ids stay below this: the tokenizer's end, or the shape's first special token."""
    return min(processor.tokenizer.vocab_size, args.shape.prompt_vocab)


def p50(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}


def prompt_lens_rows(m: MStar, args: argparse.Namespace, vocab: int, layout: str) -> dict[str, Any]:
    """Prompt length -> p50 figures of one request at a time (and each timed run's)."""
    gen = torch.Generator().manual_seed(0)
    rows = {}
    for n in args.prompt_lens:
        timed_request(m, torch.randint(0, vocab, (n,), generator=gen), args.decode_tokens)  # warm-up
        runs = [timed_request(m, torch.randint(0, vocab, (n,), generator=gen), args.decode_tokens)
                for _ in range(args.repeats)]
        rows[str(n)] = {**p50(runs), "runs": [{k: round(v, 4) for k, v in r.items()} for r in runs]}
        logger.info("%s %d tokens: %s", layout, n, p50(runs))
    return rows


def concurrency_rows(m: MStar, args: argparse.Namespace, vocab: int,
                     layout: str) -> tuple[dict[str, Any], dict[str, list[list[list[int]]]]]:
    """Level -> the figures of its timed rounds (module doc); and level -> each timed round's token ids."""
    gen = torch.Generator().manual_seed(0)  # both layouts draw the same prompts
    n = args.prompt_lens[0]
    rows, tokens = {}, {}
    for c in args.concurrency:
        rounds = [timed_round(m, [torch.randint(0, vocab, (n,), generator=gen) for _ in range(c)],
                              args.decode_tokens) for _ in range(args.repeats + 1)][1:]  # the first is a warm-up
        ttft = [t for row, _ in rounds for t in row["ttft_s"]]
        figures = p50([{k: v for k, v in row.items() if k != "ttft_s"} for row, _ in rounds])
        rows[str(c)] = {"ttft_p50_s": round(statistics.median(ttft), 4), "ttft_max_s": round(max(ttft), 4),
                        **figures, "rounds": [{k: round(v, 4) for k, v in row.items() if k != "ttft_s"}
                                              for row, _ in rounds]}
        tokens[str(c)] = [ids for _, ids in rounds]
        logger.info("%s concurrency %d: %s", layout, c, {k: v for k, v in rows[str(c)].items() if k != "rounds"})
    return rows, tokens


def serve_layout(layout: str, args: argparse.Namespace, folder: str | None) -> tuple[dict[str, Any], dict]:
    """One layout's figures (per prompt length, or per concurrency level with its token ids) and engine stats."""
    config = served_config(layout, args)
    t0 = time.perf_counter()
    tokens: dict[str, list[list[list[int]]]] = {}
    with MStar(args.shape.served, config=config, mode="multiproc", tiny=args.quick, model_path=folder,
               load_format="auto" if args.quick else "dummy") as m:
        ready_s = time.perf_counter() - t0
        vocab = prompt_vocab(m.processor, args)
        if args.concurrency:
            rows, tokens = concurrency_rows(m, args, vocab, layout)
        else:
            rows = prompt_lens_rows(m, args, vocab, layout)
        stats = engine_stats(m, args.shape.component)
    key = "concurrency" if args.concurrency else "prompt_lens"
    return {"config": Path(config.source).stem, "workers": config.num_workers, "ready_s": round(ready_s, 1),
            "max_concurrent_requests": config.max_concurrent_requests, "kv_pool_pages": config.kv_cache.max_num_pages,
            key: rows, "engine_stats": stats}, tokens


def compare_tokens(one: list[list[list[int]]], split: list[list[list[int]]]) -> dict[str, Any]:
    """Whether every request of every round got the same greedy tokens in both layouts; the first mismatch."""
    pairs = [(r, i, a, b) for r, (ra, rb) in enumerate(zip(one, split, strict=True))
             for i, (a, b) in enumerate(zip(ra, rb, strict=True))]
    mismatch = None
    for r, i, a, b in pairs:
        if a != b:
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatch = {"round": r, "request": i, "index": j, "colocated": a[j] if j < len(a) else None,
                        "disaggregated": b[j] if j < len(b) else None}
            break
    equal = sum(a == b for _, _, a, b in pairs)
    return {"tokens_equal": equal == len(pairs), "requests_equal": equal, "requests": len(pairs),
            "first_mismatch": mismatch}


class DropSink:
    """A stream's receiving end that keeps nothing (`KVStreamSink`): the sender's gathers still run."""

    def layer(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pass

    def end(self, done: KVStreamEnd) -> None:
        pass


def build_engine(args: argparse.Namespace, folder: str | None) -> tuple[AutoregressiveEngine, int]:
    """The prompts' engine as a worker builds it, with the benchmark's pool; and the prompt ids' bound."""
    config = config_from_dict({"model": args.shape.served, "device": args.device.type,
                               "model_kwargs": model_kwargs(args)})
    model = build_model(config, tiny=args.quick, load_format="auto" if args.quick else "dummy", model_path=folder)
    built = model.build_component(args.shape.component, args.device)
    engine = build_autoregressive_engine(built.module, built.engine, config.kv_cache, args.device,
                                         config.cuda_graphs, pool_pages(args))
    return engine, prompt_vocab(model.processor(), args)


def timed_prefill(engine: AutoregressiveEngine, prompt: torch.Tensor, streamed: bool, component: str) -> float:
    """Seconds from a prefill's start to its sampled token, on its own (plain or streamed to a `DropSink`)."""
    rid = uuid.uuid4().hex
    item = StepItem(rid, "prefill", component, {"input_ids": prompt}, dict(GREEDY))
    if streamed:
        assert engine.submit_streamed(item, DropSink()) is not None, "a new sequence is offered"
        assert not engine.step()  # it waits for the receiver's answer, computing nothing
    sync(engine)
    t0 = time.perf_counter()
    if streamed:
        engine.stream_kv(rid, item.kv_slot, 0)
    else:
        engine.submit(item)
    results = []
    while not results:
        results = engine.step()
    sync(engine)
    elapsed = time.perf_counter() - t0
    assert results[0].error is None, results[0].error
    engine.release(rid)
    return elapsed


def sync(engine: AutoregressiveEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def prefill_tap(args: argparse.Namespace, folder: str | None) -> dict[str, Any]:
    """Prompt length -> p50 ms of a plain and of a streamed prefill (they take turns), and the difference; with
    the most tokens a plain prefill replays as a CUDA graph (0: none), which a streamed one never does."""
    engine, vocab = build_engine(args, folder)
    gen = torch.Generator().manual_seed(1)
    rows = {}
    for n in args.prompt_lens:
        times: dict[str, list[float]] = {"plain": [], "streamed": []}
        for r in range(args.repeats + 1):  # the first of each is a warm-up
            for kind in times:
                prompt = torch.randint(0, vocab, (n,), generator=gen)
                t = timed_prefill(engine, prompt, kind == "streamed", args.shape.component)
                times[kind] += [t] if r else []
        ms = {kind: round(1e3 * statistics.median(ts), 3) for kind, ts in times.items()}
        rows[str(n)] = {"plain_ms": ms["plain"], "streamed_ms": ms["streamed"],
                        "tap_cost_ms": round(ms["streamed"] - ms["plain"], 3)}
        logger.info("prefill %d tokens: %s", n, rows[str(n)])
    graphs = engine.runner.prefill_graphs
    return {"prefill_graph_max_tokens": graphs.max_tokens if graphs is not None else 0, "prompt_lens": rows}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny model on CPU (smoke test, no file)")
    p.add_argument("--model", choices=sorted(SHAPES), default="llama", help="the shape served (module doc)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="requests submitted at once, one level after another (module doc); default: one at a time")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=None,
                   help="default 1024 4096 16384 (--quick 48 200); with --concurrency one length, default 512 "
                        "(--quick 40)")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help="tokens per request (default 32, with --concurrency 128; --quick 6)")
    p.add_argument("--repeats", type=int, default=None, help="timed requests per length, or timed rounds per "
                                                             "level with --concurrency (default 5, 2; --quick 2, 1)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/pd_stream_<gpu>...json, "
                                               "module doc; --quick: none)")
    args = p.parse_args(argv)
    many = args.concurrency is not None
    lens = ([40] if many else [48, 200]) if args.quick else ([512] if many else [1024, 4096, 16384])
    args.prompt_lens = args.prompt_lens or lens
    args.decode_tokens = args.decode_tokens or (6 if args.quick else 128 if many else 32)
    args.repeats = args.repeats or ((1 if many else 2) if args.quick else (2 if many else 5))
    if min(args.prompt_lens) < 1 or args.decode_tokens < 2 or args.repeats < 1:
        p.error("--prompt-lens and --repeats must be >= 1, --decode-tokens >= 2 (a decode walk must run)")
    if many and (len(args.prompt_lens) != 1 or min(args.concurrency) < 1):
        p.error("--concurrency takes levels >= 1 and one prompt length (--prompt-lens N)")
    args.shape = SHAPES[args.model]
    args.device = torch.device("cpu" if args.quick else "cuda")
    if not args.quick and not torch.cuda.is_available():
        p.error("no CUDA device here: pass --quick (tiny, CPU)")
    return args


def results_name(args: argparse.Namespace, device: str) -> str:
    """pd_stream_<gpu>[_<n>gpu][_<model>][_concurrency] (cpu for --quick)."""
    gpus = torch.cuda.device_count() if args.device.type == "cuda" else 1
    return "_".join(["pd_stream", "cpu" if args.quick else gpu_tag(device)] + ([f"{gpus}gpu"] if gpus > 1 else [])
                    + ([args.model] if args.model != "llama" else []) + (["concurrency"] if args.concurrency else []))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    layouts, tokens = {}, {}
    with checkpoint_folder(args.quick, args.shape.hf_config) as folder:
        for layout in args.shape.layouts:
            layouts[layout], tokens[layout] = serve_layout(layout, args, folder)
        extra = {} if args.concurrency else {"prefill_tap": prefill_tap(args, folder)}
    if args.concurrency:
        extra["greedy"] = {c: compare_tokens(tokens["colocated"][c], tokens["disaggregated"][c]) for c in tokens["colocated"]}
        logger.info("greedy tokens, colocated against disaggregated: %s", extra["greedy"])
    device = "cpu" if args.quick else torch.cuda.get_device_name(args.device)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if not args.quick else []
    doc = {"benchmark": "pd_stream", "command": "python3 benchmarks/pd_stream.py " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "device": device, "gpus": gpus, "torch": torch.__version__, "python": platform.python_version(),
           "model": f"tiny {args.model}, float32" if args.quick else args.shape.label,
           "prompt_lens": args.prompt_lens, "decode_tokens": args.decode_tokens, "repeats": args.repeats,
           "concurrency": args.concurrency, **layouts, **extra}
    out = write_results(doc, args.out, args.quick, results_name(args, device))
    logger.info("wrote %s", out or "no file (--quick)")
    return doc


if __name__ == "__main__":
    main()
