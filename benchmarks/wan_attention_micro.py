"""The Wan2.2 DiT's attention at 832x480, 33 frames: PyTorch SDPA (as served) against FlashInfer's
FA2 and FA3 prefill kernels, one H200.

Shapes: self-attention over 3,510 video tokens, cross-attention of those to 512 text tokens; 24
heads of 128, bf16, batch 2 (both guidance branches), q/k/v [B, L, H, D] as the DiT hands them to
its `attend` (v a strided view of the fused QKV output). Per kernel: the first call's wall time
(FlashInfer JIT-compiles its module then), ms per call from CUDA events around --iters back-to-back
calls (`call_timing.time_calls`), TFLOP/s, and the largest difference from SDPA's output.

    python3 benchmarks/wan_attention_micro.py [--iters 20] [--out benchmarks/results/wan_attention_micro_h200.json]

Measures, asserts nothing. Needs a CUDA GPU and flashinfer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.call_timing import time_calls  # noqa: E402

HEADS, HEAD_DIM, VIDEO_TOKENS, TEXT_TOKENS, BATCH = 24, 128, 3510, 512, 2


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def flashinfer_attention(backend: str):
    import flashinfer

    def attend(q, k, v):
        return torch.stack([flashinfer.single_prefill_with_kv_cache(q[b], k[b], v[b], backend=backend)
                            for b in range(q.shape[0])])
    return attend


def inputs(kv_len: int, strided_v: bool):
    g = torch.Generator(device="cuda").manual_seed(kv_len)
    q = torch.randn(BATCH, VIDEO_TOKENS, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
    kv = torch.randn(BATCH, kv_len, 3 if strided_v else 2, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
    return q, kv[:, :, 0], kv[:, :, -1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--backends", nargs="+", default=["fa2", "fa3"])
    parser.add_argument("--out", default="benchmarks/results/wan_attention_micro_h200.json")
    args = parser.parse_args()
    result = {"benchmark": "wan_attention_micro", "command": "python3 " + " ".join(sys.argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for case, kv_len in (("self", VIDEO_TOKENS), ("cross", TEXT_TOKENS)):
        q, k, v = inputs(kv_len, strided_v=case == "self")
        flops = 4 * BATCH * HEADS * HEAD_DIM * VIDEO_TOKENS * kv_len
        reference = sdpa(q, k, v)
        rows = {}
        kernels = {"sdpa": sdpa, **{f"flashinfer_{b}": flashinfer_attention(b) for b in args.backends}}
        for name, fn in kernels.items():
            try:
                timing = time_calls(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), torch.device("cuda"), args.iters)
                out, ms = fn(q, k, v), timing["gpu_ms"]
                rows[name] = {"first_call_s": round(timing["first_ms"] / 1e3, 2), "ms": round(ms, 4),
                              "tflops": round(flops / ms / 1e9, 1),
                              "max_abs_diff_vs_sdpa": float((out.float() - reference.float()).abs().max())}
            except Exception as exc:  # a backend this machine cannot build is reported, not fatal
                rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(json.dumps({"case": case, "kernel": name, **rows[name]}), flush=True)
        result["cases"][case] = rows
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
