"""How many audio seconds per second the Qwen3-Omni speech benchmark can reach while one GPU holds the
whole thinker: a bound from the bytes a thinker decode step must read, not a measurement.

The benchmark (`mstar bench --workload speech --max-tokens 256 --ignore-eos --extra-body
'{"talker.max_tokens": 256}'`) makes each request run 256 thinker decode steps and speak 256 frames of
80 ms (20.48 s). The talker consumes the thinker's states, so a request lasts at least its 256 thinker
steps, and a closed loop of C requests makes at most C * 20.48 / (256 * step(C)) audio seconds a second.
A thinker step at B = C rows reads at least: the experts its tokens route to (top-k of E per token;
expected distinct experts per layer E * (1 - (1 - k/E)^B) for routing spread evenly, which is what
random dummy weights give), the attention and router weights, the output head, and the rows' KV cache.
step(C) >= those bytes / HBM bandwidth. Sizes come from `mstar.models.qwen3_omni.config.FULL_SIZES`.

    python3 benchmarks/omni_thinker_floor.py [--context 160] [--out benchmarks/results/omni_thinker_floor.json]

Runs on any CPU in a second; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar.models.qwen3_omni.config import FULL_SIZES  # noqa: E402

THINKER_STEPS, AUDIO_S = 256, 256 * 0.08  # per request in the benchmark
BYTES = 2  # bf16
BANDWIDTHS_TBPS = {"h200_spec": 4.8, "h200_measured_copy": 4.26}  # docs/benchmarks.md: 4.26 TB/s device copy
ORIGINAL_2GPU = {1: 12.4, 4: 36.2, 8: 55.0, 16: 88.1, 32: 114.4}  # the figures for the original M*


def distinct_experts(rows: int) -> float:
    """Expected distinct experts per layer that `rows` tokens route to, each to top-k of E at random."""
    t = FULL_SIZES["thinker"]
    return t["num_experts"] * (1 - (1 - t["top_k"] / t["num_experts"]) ** rows)


def step_bytes(rows: int, context: int) -> dict[str, float]:
    """Bytes a thinker decode step of `rows` rows reads, by part."""
    t = FULL_SIZES["thinker"]
    h, layers, experts, inter = t["hidden_size"], t["num_layers"], t["num_experts"], t["moe_intermediate_size"]
    heads, kv_heads = t["heads"]
    hd = t["head_dim"]
    expert = 3 * h * inter * BYTES
    attention = (h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h) * BYTES
    router = h * experts * BYTES
    kv = rows * context * 2 * kv_heads * hd * BYTES  # per layer
    return {"experts": layers * distinct_experts(rows) * expert, "attention_and_router": layers * (attention + router),
            "head": t["vocab_size"] * h * BYTES, "kv_cache": layers * kv}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=160,
                        help="mean tokens of KV a row attends to (prompt ~30 + half of 256 generated)")
    parser.add_argument("--out", default="benchmarks/results/omni_thinker_floor.json")
    args = parser.parse_args()
    rows = []
    for c in (1, 4, 8, 16, 32):
        parts = step_bytes(c, args.context)
        total = sum(parts.values())
        row = {"concurrency": c, "distinct_experts_per_layer": round(distinct_experts(c), 1),
               "gb_per_step": round(total / 1e9, 2), **{f"gb_{k}": round(v / 1e9, 2) for k, v in parts.items()}}
        for name, tbps in BANDWIDTHS_TBPS.items():
            step_ms = total / (tbps * 1e12) * 1e3
            row[f"step_ms_floor_{name}"] = round(step_ms, 2)
            row[f"audio_s_per_s_bound_{name}"] = round(c * AUDIO_S / (THINKER_STEPS * step_ms / 1e3), 1)
        row["target_2x_original"] = round(2 * ORIGINAL_2GPU[c], 1)
        rows.append(row)
        print(json.dumps(row))
    result = {"benchmark": "omni_thinker_floor", "command": "python3 " + " ".join(sys.argv),
              "kind": "analytical bound (bytes / bandwidth), not a measurement", "context": args.context,
              "thinker_steps_per_request": THINKER_STEPS, "audio_s_per_request": AUDIO_S, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
