"""Host time of a Qwen3-Omni talker decode step's per-sequence extras, on this machine's CPU:

- `us_per_decode_add`: recording one decode step's explicit positions (`TokenInputs.add`, n = 1), as every
  talker step does for each of its sequences: 3-row M-RoPE positions after a shifted prompt;
- `extras_step_us[B]`: a whole talker step's extras bookkeeping at B sequences: each sequence's add (its
  input embedding and default 3-row positions) and the extras graph's `accepts`, `inputs` (positions,
  embedding rows, mask) and `store_hidden` (the final hidden state handed to each sequence), around a
  graph replay that costs nothing here (its outputs are fixed tensors). On a GPU host each tensor op
  there also launches a kernel, so the same code costs more there.

    python3 benchmarks/token_inputs_host.py --out benchmarks/results/token_inputs_host.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mstar.engines.autoregressive.extras_graph import ExtrasGraphs  # noqa: E402
from mstar.engines.autoregressive.scheduler import Chunk  # noqa: E402
from mstar.engines.autoregressive.token_inputs import ItemExtras, TokenInputs  # noqa: E402
from mstar.engines.base import CausalLMBase, KVLayout  # noqa: E402

HIDDEN = 1024  # the talker's hidden size


def us_per_add(steps: int) -> float:
    inputs = TokenInputs()
    inputs.add(0, 16, ItemExtras(positions=torch.arange(16).expand(3, -1).contiguous() + 5))
    n, t0 = 16, time.perf_counter()
    for _ in range(steps):
        inputs.add(n, 1, ItemExtras(positions=torch.full((3, 1), n + 5, dtype=torch.long)))
        n += 1
    return (time.perf_counter() - t0) / steps * 1e6


class _TalkerShape(CausalLMBase):
    """What ExtrasGraphs reads of a model: the talker's declared capture, 3-row positions, hidden size."""

    graph_hidden_layers = (-1,)
    multirow_positions = True
    hidden_size = HIDDEN
    kv_layout = KVLayout(1, 1, 8, torch.bfloat16)


class _Seq:
    def __init__(self) -> None:
        self.token_ids = list(range(16))
        self.inputs = TokenInputs()
        self.inputs.add(0, 16, ItemExtras(embeds=torch.zeros(16, HIDDEN, dtype=torch.bfloat16), rows=torch.arange(16),
                                          positions=torch.arange(16).expand(3, -1).contiguous() + 5))


def us_per_extras_step(batch: int, steps: int) -> float:
    graphs = ExtrasGraphs(_TalkerShape(), None, torch.device("cpu"))
    graphs.graphs = type("Fake", (), {"max_batch": 64})()  # accepts() only asks for its size
    seqs = [_Seq() for _ in range(batch)]
    embed = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)
    final = torch.zeros(batch, HIDDEN, dtype=torch.bfloat16)  # the graph's static output
    t0 = time.perf_counter()
    for _ in range(steps):
        for s in seqs:
            n = len(s.token_ids)
            s.token_ids.append(0)
            s.inputs.add(n, 1, ItemExtras(embeds=embed, rows=torch.arange(1),
                                          positions=torch.full((3, 1), n + 5, dtype=torch.long), hidden_layers=(-1,)))
        chunks = [Chunk(s, len(s.token_ids) - 1, 1) for s in seqs]
        assert graphs.accepts(chunks)
        graphs.inputs(chunks)
        graphs.store_hidden(chunks, (final,))
        for s in seqs:
            s.inputs.take_hidden()
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    best = min(us_per_add(args.steps) for _ in range(args.repeats))
    steps = max(args.steps // 10, 1)
    extras = {b: round(min(us_per_extras_step(b, steps) for _ in range(args.repeats)), 1) for b in args.batch}
    doc = {"command": "python3 " + " ".join(sys.argv), "cpu": platform.processor() or platform.machine(),
           "us_per_decode_add_best_of_repeats": round(best, 2), "steps": args.steps,
           "extras_step_us_best_of_repeats": extras, "extras_steps": steps}
    print(json.dumps(doc))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
