"""The frame-place head (`mstar/kernels/window_head.py`) against the speakable-span head it replaces, GPU
microseconds per call inside a CUDA graph, at Orpheus-3B's shape (28,680 span rows x 3,072, bf16).

`span`: the served head before frame places (`linear_weight` over the span rows, the skinny GEMV, then
the float32 cast and the markers' -inf, as `LlamaForCausalLM.compute_logits` runs it); `window`: the
kernel at each launch config of --configs (block_n, block_k, num_warps, num_stages), fed input ids of a
different frame place every call, so consecutive calls read different windows and, as in a decode step,
the rows come from HBM (seven windows = the whole span, > 2 x L2). Timed with
`mstar.kernels.timing.graph_time_us`.

    python3 benchmarks/window_head_micro.py [--ms 1 2 4 6] [--out benchmarks/results/window_head_micro_h200.json]

Measures, asserts nothing. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from itertools import cycle
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar.kernels import window_head  # noqa: E402
from mstar.kernels.timing import graph_time_us  # noqa: E402
from mstar.layers.linear import linear_weight  # noqa: E402
from mstar.models.orpheus.tokens import FRAME, OrpheusTokens  # noqa: E402

CONFIGS = [(8, 1024, 4, 2), (16, 512, 4, 3), (8, 512, 4, 3), (32, 256, 4, 3), (16, 256, 4, 3), (16, 1024, 8, 3), (32, 512, 8, 3),
           (16, 512, 4, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 6])
    parser.add_argument("--out", default="benchmarks/results/window_head_micro_h200.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    tokens = OrpheusTokens()
    lo, hi = tokens.speakable_span
    windows = tokens.place_windows(tokens.vocab_size).to(device)
    weight = (0.02 * torch.randn(hi - lo, 3072, device=device)).bfloat16()
    blocked = (tokens.span_markers[0] - lo, tokens.span_markers[1] - lo)
    rows = []
    for m in args.ms:
        x = torch.randn(m, 3072, device=device).bfloat16()
        # one ids tensor per frame place (row r of call p: place p + r), cycled call after call
        ids = [torch.tensor([tokens.audio_offset + ((p + r) % FRAME) * tokens.codebook_size + 5 for r in range(m)],
                            device=device) for p in range(FRAME)]

        def span(w: torch.Tensor, x: torch.Tensor = x) -> torch.Tensor:
            logits = linear_weight(x, w).float()
            logits[:, blocked[0]:blocked[1]].fill_(-math.inf)
            return logits

        row = {"m": m, "span_us": round(graph_time_us(span, weight, min_calls=14), 2)}
        for cfg in CONFIGS:
            feed = cycle(ids)

            def window(w: torch.Tensor, x: torch.Tensor = x, cfg=cfg, feed=feed) -> torch.Tensor:
                return window_head.window_logits(x, w, next(feed), windows, *cfg)

            row["window_" + "_".join(map(str, cfg))] = round(graph_time_us(window, weight, min_calls=14), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"benchmark": "window_head_micro", "command": "python3 " + " ".join(sys.argv),
              "device": torch.cuda.get_device_name(), "configs": "block_n_block_k_num_warps_num_stages", "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
