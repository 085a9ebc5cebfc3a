"""Measure (not assert) what prefill/decode disaggregation with layer-streamed K/V costs on one GPU (#41).

Model: the Llama-3.1-8B shape of `structured_decode.py` (bf16, `load_format="dummy"`, the llama3 tokenizer
folder), served in this process by `MStar` twice: `colocated` (mstar/configs/llama.yaml: one worker) and
`disaggregated` (llama_pd.yaml: the prefill walk on worker 0, the decode walk on worker 1, two processes on
the one GPU, K/V moving by CUDA IPC layer by layer while the prefill computes; docs/operations.md,
"Prefill/decode disaggregation"). Both get the same explicit KV pool (two processes share the card).

For each prompt length (`--prompt-lens`), one request at a time, greedy, eos ignored, `--decode-tokens`
tokens, each repeat a new random prompt (no prefix-cache hit), after one untimed warm-up request: the time to
the first token (the prefill walk's token, on worker 0), the gap from it to the second token (the decode
walk's first: on the decode worker this includes waiting for the stream's end and adopting the pages;
colocated it is one decode step), and the decode tokens/s after the first token; p50 over `--repeats`.
After each layout, the engines' stats per rank as the workers last reported them (`prompt_tokens` on the
decode worker is 0 when nothing was recomputed; `kv_pages_sent` / `kv_pages_received`).

`prefill_tap`: one `llm` engine built in process as a worker builds it (after both servers closed), timing
one prefill of each length as served (`plain`: `submit`, CUDA graphs where they apply) and streamed to a sink
that drops what it gets (`streamed`: `submit_streamed`, `stream_kv`; the eager forward through the runner's
layer tap, each layer's K/V gathered from the cache as for a real receiver, no transport): the difference is
the tap's own cost on the compute path.

On a bare lent GPU machine (carry `.whl` and `.devscratch/mstar_tokenizers/llama3-v1`, which
benchmarks/device_setup.sh says how to make):

    source benchmarks/device_setup.sh && OUT=$OUT bash benchmarks/gpu_suite.sh pd
    # which runs: python3 benchmarks/pd_stream.py --out $OUT/pd_stream_<gpu>.json

It writes `benchmarks/results/pd_stream_<gpu>.json` without `--out`. On CPU (the tiny Llama, two worker
processes, about 20 s):

    python3 benchmarks/pd_stream.py --quick
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

from benchmarks.results_io import write_results  # noqa: E402
from benchmarks.structured_decode import PAGE, checkpoint_folder, gpu_tag  # noqa: E402
from mstar.conductor.request_state import FinishEvent, OutputEvent  # noqa: E402
from mstar.config import MStarConfig, config_from_dict, load_config  # noqa: E402
from mstar.engines.autoregressive import AutoregressiveEngine, build_autoregressive_engine  # noqa: E402
from mstar.engines.base import StepItem  # noqa: E402
from mstar.engines.kv_handoff import KVStreamEnd  # noqa: E402
from mstar.runtime.build import build_model  # noqa: E402
from mstar.runtime.offline import MStar  # noqa: E402

logger = logging.getLogger(__name__)

LAYOUTS = {"colocated": "llama", "disaggregated": "llama_pd"}  # row name -> the shipped config it follows
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_model_len": max(args.prompt_lens) + args.decode_tokens + PAGE}
    if not args.quick:
        from mstar.models.common.tokenizer_build import cached_tokenizer_folder

        kwargs["tokenizer_path"] = str(cached_tokenizer_folder("llama3"))
    return kwargs


def pool_pages(args: argparse.Namespace) -> int:
    """Room for the longest request twice over (one finishing while the next starts) and some slack."""
    return 2 * -(-(max(args.prompt_lens) + args.decode_tokens) // PAGE) + 64


def served_config(layout: str, args: argparse.Namespace) -> MStarConfig:
    """The shipped config of `layout` on this device, with the benchmark's pool and context."""
    base = load_config(LAYOUTS[layout])
    return dataclasses.replace(base, device=args.device.type, model_kwargs=model_kwargs(args),
                               kv_cache=dataclasses.replace(base.kv_cache, max_num_pages=pool_pages(args)))


def timed_request(m: MStar, prompt: torch.Tensor, max_tokens: int, timeout_s: float = 600.0) -> dict[str, float]:
    """One request of `prompt`'s ids run alone: seconds to the first token, first to second token, and the
    decode tokens/s after the first (each text event's arrival, stamped in the conductor's sink)."""
    stamps: list[tuple[float, int]] = []
    done = threading.Event()
    finish: list[FinishEvent] = []

    def sink(event: OutputEvent | FinishEvent) -> None:
        if isinstance(event, FinishEvent):
            finish.append(event)
            done.set()
        elif event.name == "text":
            stamps.append((time.perf_counter(), int(event.value.numel())))

    options = m.runtime.model.request_options({**GREEDY, "max_tokens": max_tokens})
    t0 = time.perf_counter()
    m.runtime.submit(uuid.uuid4().hex, {"prompt_ids": prompt}, options, sink)
    if not done.wait(timeout_s) or finish[0].error is not None:
        raise RuntimeError(f"request of {len(prompt)} tokens: {finish[0].error if finish else 'timed out'}")
    (t1, n1), (t2, _) = stamps[0], stamps[1]
    tokens = sum(n for _, n in stamps)
    return {"ttft_s": t1 - t0, "first_to_second_s": t2 - t1, "decode_tokens_per_s": (tokens - n1) / (stamps[-1][0] - t1)}


def engine_stats(m: MStar, timeout_s: float = 15.0) -> dict[str, dict[str, float]]:
    """rank -> the `llm` engine's stats (cumulative, warm-ups included) once two of the workers' reports in a
    row agree (they report about twice a second)."""
    last: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.6)
        now = {str(rank): dict(c.gauges) for rank, ws in sorted(m.runtime.conductor.worker_stats().items())
               for c in ws.components if c.component == "llm"}
        if now and now == last:
            break
        last = now
    return last


def p50(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}


def serve_layout(layout: str, args: argparse.Namespace, folder: str | None) -> dict[str, Any]:
    """Every prompt length's p50 figures and the engines' stats for one layout."""
    gen = torch.Generator().manual_seed(0)
    config = served_config(layout, args)
    t0 = time.perf_counter()
    with MStar("llama", config=config, mode="multiproc", tiny=args.quick, model_path=folder,
               load_format="auto" if args.quick else "dummy") as m:
        ready_s = time.perf_counter() - t0
        vocab = min(m.processor.tokenizer.vocab_size, 128000)  # below the Llama-3 specials
        rows = {}
        for n in args.prompt_lens:
            timed_request(m, torch.randint(0, vocab, (n,), generator=gen), args.decode_tokens)  # warm-up
            runs = [timed_request(m, torch.randint(0, vocab, (n,), generator=gen), args.decode_tokens)
                    for _ in range(args.repeats)]
            rows[str(n)] = {**p50(runs), "runs": [{k: round(v, 4) for k, v in r.items()} for r in runs]}
            logger.info("%s %d tokens: %s", layout, n, p50(runs))
        stats = engine_stats(m)
    return {"config": LAYOUTS[layout], "workers": config.num_workers, "ready_s": round(ready_s, 1),
            "prompt_lens": rows, "engine_stats": stats}


class DropSink:
    """A stream's receiving end that keeps nothing (`KVStreamSink`): the sender's gathers still run."""

    def layer(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pass

    def end(self, done: KVStreamEnd) -> None:
        pass


def build_engine(args: argparse.Namespace, folder: str | None) -> AutoregressiveEngine:
    """The `llm` engine as a worker builds it, with the benchmark's pool."""
    config = config_from_dict({"model": "llama", "device": args.device.type, "model_kwargs": model_kwargs(args)})
    model = build_model(config, tiny=args.quick, load_format="auto" if args.quick else "dummy", model_path=folder)
    built = model.build_component("llm", args.device)
    return build_autoregressive_engine(built.module, built.engine, config.kv_cache, args.device, config.cuda_graphs,
                                       pool_pages(args))


def timed_prefill(engine: AutoregressiveEngine, prompt: torch.Tensor, streamed: bool) -> float:
    """Seconds from a prefill's start to its sampled token, on its own (plain or streamed to a `DropSink`)."""
    rid = uuid.uuid4().hex
    item = StepItem(rid, "prefill", "llm", {"input_ids": prompt}, dict(GREEDY))
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
    engine = build_engine(args, folder)
    gen = torch.Generator().manual_seed(1)
    vocab = min(engine.runner.model.config.vocab_size, 128000)
    rows = {}
    for n in args.prompt_lens:
        times: dict[str, list[float]] = {"plain": [], "streamed": []}
        for r in range(args.repeats + 1):  # the first of each is a warm-up
            for kind in times:
                t = timed_prefill(engine, torch.randint(0, vocab, (n,), generator=gen), kind == "streamed")
                times[kind] += [t] if r else []
        ms = {kind: round(1e3 * statistics.median(ts), 3) for kind, ts in times.items()}
        rows[str(n)] = {"plain_ms": ms["plain"], "streamed_ms": ms["streamed"],
                        "tap_cost_ms": round(ms["streamed"] - ms["plain"], 3)}
        logger.info("prefill %d tokens: %s", n, rows[str(n)])
    graphs = engine.runner.prefill_graphs
    return {"prefill_graph_max_tokens": graphs.max_tokens if graphs is not None else 0, "prompt_lens": rows}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny Llama on CPU (smoke test, no file)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="default 1024 4096 16384 (--quick 48 200)")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens per request (default 32; --quick 6)")
    p.add_argument("--repeats", type=int, default=None, help="timed requests per length (default 5; --quick 2)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/pd_stream_<gpu>.json; "
                                               "--quick: none)")
    args = p.parse_args(argv)
    args.prompt_lens = args.prompt_lens or ([48, 200] if args.quick else [1024, 4096, 16384])
    args.decode_tokens = args.decode_tokens or (6 if args.quick else 32)
    args.repeats = args.repeats or (2 if args.quick else 5)
    if min(args.prompt_lens) < 1 or args.decode_tokens < 2 or args.repeats < 1:
        p.error("--prompt-lens and --repeats must be >= 1, --decode-tokens >= 2 (a decode walk must run)")
    args.device = torch.device("cpu" if args.quick else "cuda")
    if not args.quick and not torch.cuda.is_available():
        p.error("no CUDA device here: pass --quick (tiny, CPU)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    with checkpoint_folder(args.quick) as folder:
        layouts = {layout: serve_layout(layout, args, folder) for layout in LAYOUTS}
        tap = prefill_tap(args, folder)
    device = "cpu" if args.quick else torch.cuda.get_device_name(args.device)
    doc = {"benchmark": "pd_stream", "command": "python3 benchmarks/pd_stream.py " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "device": device, "torch": torch.__version__, "python": platform.python_version(),
           "model": "tiny Llama, float32" if args.quick else "Llama-3.1-8B shape, bf16, dummy weights",
           "prompt_lens": args.prompt_lens, "decode_tokens": args.decode_tokens, "repeats": args.repeats,
           "kv_pool_pages": pool_pages(args), **layouts, "prefill_tap": tap}
    out = write_results(doc, args.out, args.quick, "pd_stream_" + ("cpu" if args.quick else gpu_tag(device)))
    logger.info("wrote %s", out or "no file (--quick)")
    return doc


if __name__ == "__main__":
    main()
