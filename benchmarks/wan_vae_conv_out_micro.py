"""The Wan2.2 VAE decoder's conv_out alone on one GPU: does padding its 12 output channels pick a faster kernel?

conv_out (256 -> 12 channels, 3x3x3, causal) ran as cuDNN's `sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_..._
tilesize128x16x64` at about 3.5 ms per 4-frame 832x480 chunk (19 TFLOP/s) in `wan_bench.py --trace-steps`, while
the decoder's wide convolutions run near 350 TFLOP/s. Here the same convolution (float32, channels-last, TF32 as
served) with its weight zero-padded to 16, 32 or 64 output channels, sliced back to 12: ms per call (CUDA
events, median of --iters after warm-up) and the largest difference from the 12-channel result.

    python3 benchmarks/wan_vae_conv_out_micro.py [--frames 4] [--out benchmarks/results/wan_vae_conv_out_micro_h200.json]

Measures, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CL3D = torch.channels_last_3d


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=4, help="frames of the chunk (4 per latent frame)")
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--height", type=int, default=240, help="the decoder's output map before unpatchify")
    parser.add_argument("--width", type=int, default=416)
    parser.add_argument("--pads", type=int, nargs="+", default=[12, 16, 24, 32, 48, 64])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.backends.cudnn.allow_tf32 = True
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, args.channels, args.frames + 2, args.height, args.width, device="cuda", generator=gen)
    x = x.contiguous(memory_format=CL3D)
    weight = torch.randn(12, args.channels, 3, 3, 3, device="cuda", generator=gen) / (27 * args.channels) ** 0.5
    flops = 2 * 12 * args.channels * 27 * args.frames * args.height * args.width
    rows, reference = [], None
    for pad in args.pads:
        w = torch.zeros(pad, *weight.shape[1:], device="cuda")
        w[:12] = weight
        w = w.contiguous(memory_format=CL3D)

        def conv(w=w):
            return F.conv3d(x, w, None, 1, (0, 1, 1))[:, :12]

        out = conv()
        reference = out if reference is None else reference
        ms = time_ms(conv, args.iters)
        row = {"out_channels": pad, "ms": round(ms, 4), "useful_tflops": round(flops / ms / 1e9, 1),
               "max_diff_vs_12": float((out - reference).abs().max())}
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"benchmark": "wan_vae_conv_out_micro", "command": "python3 " + " ".join(sys.argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "input": list(x.shape), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
