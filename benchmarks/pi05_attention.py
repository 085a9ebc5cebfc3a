"""Pi0.5's flow attention alone (asserts nothing): one call at a flow step's shapes (50 actions x 8 query
heads over a prefix of --prefix keys padded to 976 and the 50 actions' own, one KV head of 256 channels,
bf16), in forms that give the same result, each replayed 180 times (a chunk's calls) from one CUDA graph:
microseconds a call and the largest difference from a float64 reference.

Forms: `valid_keys` (what runs: `mstar/models/pi05/flow_attention.py`, a Triton kernel over each robot's
valid prefix keys and the actions' keys, its keys split across programs by `default_splits`), the same with
`valid_keys_splits_N` splits, `rows` (the masked form, what runs without the fused kernels: query heads as rows
of one head, additive mask, SDPA's own choice of backend), the same under each SDPA backend that accepts it,
`gqa` (8 heads, enable_gqa), `matmul` (scores and weights in float32: two matmuls and a softmax), and
`flash_valid` (flash over the valid keys only, no mask: the padding cut out on the host, so not a drop-in).

    python3 benchmarks/pi05_attention.py --out $OUT/pi05_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from mstar.models.pi05.flow_attention import default_splits, valid_keys_attention  # noqa: E402
from mstar.models.pi05.gemma import attention_bias  # noqa: E402

CALLS = 180  # 18 layers x 10 Euler steps
HEADS, DIM, CHUNK, PADDED = 8, 256, 50, 976


def inputs(prefix: int, batch: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = PADDED + CHUNK

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    valid = torch.ones(batch, keys, dtype=torch.bool, device="cuda")
    valid[:, prefix:PADDED] = False
    bias = attention_bias(valid, torch.bfloat16)  # as the flow makes it: rows 16-element aligned
    return {"q": randn(batch, 1, CHUNK * HEADS, DIM), "k": randn(batch, 1, keys, DIM), "v": randn(batch, 1, keys, DIM),
            "bias": bias[:, None, None, :], "valid": valid}


def forms(x: dict[str, torch.Tensor], prefix: int) -> dict[str, Callable[[], torch.Tensor]]:
    q, k, v, bias = x["q"], x["k"], x["v"], x["bias"]

    def rows() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def backend(which: SDPBackend) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with sdpa_kernel(which):
                return rows()
        return run

    def gqa() -> torch.Tensor:  # (position, head) rows back to 8 heads of 50 queries
        heads = q.view(q.shape[0], CHUNK, HEADS, DIM).transpose(1, 2)
        out = F.scaled_dot_product_attention(heads, k, v, attn_mask=bias, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)

    def matmul() -> torch.Tensor:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * DIM ** -0.5 + bias.float()
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)

    kept = torch.cat([k[:, :, :prefix], k[:, :, PADDED:]], dim=2), torch.cat([v[:, :, :prefix], v[:, :, PADDED:]], 2)

    def flash_valid() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, *kept)

    heads = q.view(q.shape[0], CHUNK, HEADS, DIM)  # rows are (action, head): the expert's q as it is
    prefix_kv = k[:, 0, :PADDED, None], v[:, 0, :PADDED, None]
    actions_kv = k[:, 0, PADDED:, None], v[:, 0, PADDED:, None]
    lengths = torch.full((q.shape[0],), prefix, device=q.device)

    def valid_keys(splits: int | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            return valid_keys_attention(heads, *prefix_kv, lengths, *actions_kv, splits).view(q.shape)
        return run

    found = {"valid_keys": valid_keys(None)}
    chosen = default_splits(heads, PADDED, CHUNK, 1)
    found.update({f"valid_keys_splits_{n}": valid_keys(n) for n in (1, 2, 4, 8, 16) if n != chosen})
    found.update({"rows": rows, "gqa": gqa, "matmul": matmul, "flash_valid": flash_valid})
    for which in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        found[f"rows_{which.name.lower()}"] = backend(which)
    return found


def reference(x: dict[str, torch.Tensor]) -> torch.Tensor:
    q, k, v = (x[name].double() for name in ("q", "k", "v"))
    scores = q @ k.transpose(-1, -2) * DIM ** -0.5 + x["bias"].double()
    return scores.softmax(-1) @ v


def time_form(fn: Callable[[], torch.Tensor]) -> float:
    """Microseconds a call, `CALLS` calls replayed from one graph (the median of 5 replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / CALLS)
    return sorted(times)[2]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", type=int, default=848, help="valid prefix keys (default 848: 3 cameras, 80 tokens)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="robots (default 1 8)")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("no CUDA device here")
    doc = {"device": torch.cuda.get_device_name(), "prefix": args.prefix, "command": " ".join(sys.argv), "cases": {},
           "valid_keys_splits": {}}
    with torch.inference_mode():
        for batch in args.batch:
            x = inputs(args.prefix, batch)
            heads = x["q"].view(batch, CHUNK, HEADS, DIM)
            doc["valid_keys_splits"][f"b{batch}"] = default_splits(heads, PADDED, CHUNK, 1)
            want = reference(x)
            for name, fn in forms(x, args.prefix).items():
                try:
                    error = (fn().double() - want).abs().max().item()
                    case = {"us_per_call": time_form(fn), "max_abs_error": error}
                except RuntimeError as exc:  # a backend that refuses these shapes or the mask
                    case = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                doc["cases"][f"{name}_b{batch}"] = case
                print(f"batch {batch} {name}: {case}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    main()
