"""Under TRITON_INTERPRET=1 with PDL forced on (the mode MSTAR_PDL=1 sets), kernels on CPU tensors still
launch without it (the interpreter has no gdc_* ops) and give the bits they give with PDL off; run by
test_pdl.py in a fresh process. Prints "pdl interpreted ok"."""

from __future__ import annotations

import torch

from mstar.kernels import fused_ops
from mstar.kernels.pdl import PDL, pdl_args
from mstar.kernels.skinny_gemm import SkinnyConfig, skinny_linear, skinny_silu_and_mul_linear


def run() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(3, 200, generator=g), torch.randn(3, 200, generator=g), torch.randn(37, 200, generator=g) / 14
    b, nw = torch.randn(37, generator=g), 1 + torch.randn(200, generator=g) / 4
    gate_up, w_down = torch.randn(2, 400, generator=g), torch.randn(37, 200, generator=g) / 14
    cos, sin = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    normed, summed = fused_ops.rms_norm(x, nw, 1e-5, r)
    return [skinny_linear(x, w, b, config=SkinnyConfig(block_m=4, block_n=8, block_k=32, split_k=3)),
            skinny_linear(torch.randn(16, 200, generator=g), w, b,
                          config=SkinnyConfig(block_m=16, block_n=16, block_k=32, split_k=2)),
            skinny_silu_and_mul_linear(gate_up, w_down), normed, summed, fused_ops.silu_and_mul(gate_up),
            fused_ops.rotary(torch.randn(3, 4, 16, generator=g), cos, sin)]


def main() -> None:
    PDL.mode = False
    off = run()
    PDL.mode = True
    assert pdl_args(torch.device("cpu")) == {"PDL": False}
    on = run()
    assert len(on) == len(off) and all(torch.equal(a, b) for a, b in zip(off, on))
    print("pdl interpreted ok")


if __name__ == "__main__":
    main()
