"""GPU time of each fused Wan DiT block step (mstar/models/wan22/wan_ops.py) against its PyTorch form.

Full-width shapes of one TI2V-5B step at 832x480x33 (B=2 guidance rows, 9 frames x 390 tokens, hidden
3072, 24 heads, per-frame modulation). For every step: microseconds per call for the Triton kernel and
for the PyTorch form (under MSTAR's `fused_kernels(False)`), the bytes the kernel must move, and the
bandwidth that makes. Per DiT forward each block runs: 1 modulated norm, 2 q/k norm+rope, 1 gated
residual + norm2, 1 cross-attention q norm, 1 residual add + modulated norm, 1 FFN up-projection +
GELU (`ffn_in_gelu`: the GELU in the GEMM's cuBLASLt epilogue against GEMM then a GELU kernel; reported
as TFLOP/s, the GEMM being compute-bound), 1 gated residual. MSTAR_WAN_GEMM_GELU=0 times the GELU
kernel on both sides. Also the VAE's channel RMS norm + SiLU (`vae_norm_silu`, wan_vae_ops.py) at the
decoder's widest map of one chunk, [1, 256, 4, 240, 416] bf16 (30 norms per 4-frame chunk, ~1.3G
elements in all).

    python3 benchmarks/wan_block_ops.py [--iters 50] [--out FILE]

Measures, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from mstar.layers.fused import fused_kernels  # noqa: E402
from mstar.models.wan22 import block_math as bm  # noqa: E402

B, T, N, D, H, FFN = 2, 9, 390, 3072, 24, 14336


def gpu_us(fn, iters: int) -> float:
    """Mean GPU microseconds per call of fn over `iters` back-to-back calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1000 / iters


def cases() -> dict[str, tuple]:
    """name -> (fn, bytes the fused kernel reads and writes[, FLOPs of a GEMM])."""
    from mstar.models.wan22.transformer import rope_angles
    from mstar.models.wan22.vae_layers import ChannelRMSNorm

    dev, act = "cuda", B * T * N * D * 2  # one bf16 activation tensor
    x, y = (torch.randn(2, B, T * N, D, device=dev) * 2).bfloat16().unbind(0)
    shift, scale, gate = (0.1 * torch.randn(B, T, 3, 1, D, device=dev)).unbind(2)
    qkv = torch.randn(B, T * N, 3 * D, device=dev).bfloat16()
    ln = torch.nn.LayerNorm(D, eps=1e-6, device=dev, dtype=torch.bfloat16)
    rms = torch.nn.RMSNorm(D, eps=1e-6, device=dev, dtype=torch.bfloat16)
    rope = bm.rope_tables(rope_angles((T, 30, 13), D // H, 10000.0, torch.device(dev)))
    q = qkv[..., :D]
    ffn_in = torch.nn.Linear(D, FFN, device=dev, dtype=torch.bfloat16)
    vae_norm = ChannelRMSNorm(256, spatial_dims=3).to(dev, torch.bfloat16)
    vae_x = torch.randn(1, 256, 4, 240, 416, device=dev, dtype=torch.bfloat16)
    return {
        "modulated_norm": (lambda: bm.modulated_norm(x, shift, scale, 1e-6), 2 * act),
        "add_modulated_norm": (lambda: bm.modulated_norm(x, shift, scale, 1e-6, residual=y), 4 * act),
        "gated_residual": (lambda: bm.gated_residual(x, y, gate), 3 * act),
        "gated_residual_norm2": (lambda: bm.gated_residual(x, y, gate, ln), 4 * act),
        "qk_norm_rope": (lambda: bm.norm_heads(q, rms, H, rope), 2 * act),
        "q_norm": (lambda: bm.norm_heads(q, rms, H), 2 * act),
        "ffn_in_gelu": (lambda: bm.linear_gelu(x, ffn_in), B * T * N * (D + FFN) * 2 + D * FFN * 2,
                        2 * B * T * N * D * FFN),
        "vae_norm_silu": (lambda: vae_norm(vae_x, silu=True), 2 * vae_x.numel() * 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {}
    with torch.no_grad():
        for name, (fn, nbytes, *flops) in cases().items():
            fused = gpu_us(fn, args.iters)
            with fused_kernels(False):
                plain = gpu_us(fn, args.iters)
            results[name] = {"fused_us": round(fused, 1), "torch_us": round(plain, 1),
                             "fused_GBps": round(nbytes / fused / 1e3, 1)}
            if flops:
                results[name].update(fused_TFLOPs=round(flops[0] / fused / 1e6, 1),
                                     torch_TFLOPs=round(flops[0] / plain / 1e6, 1))
    report = {"device": torch.cuda.get_device_name(), "shape": [B, T * N, D], "heads": H, "ffn": FFN,
              "gemm_gelu": bm.GEMM_GELU,
              "command": " ".join(sys.argv), "results": results}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
