"""Checks of FP8 routed experts (`StackedExperts.to_fp8`) in the small and tiled MoE kernels against the
per-expert loop over the dequantized experts, and of SparseMoE's FP8 paths (a batch too large for one tiled
call runs in chunks); run with TRITON_INTERPRET=1 by test_moe_fp8.py. Prints "moe fp8 ok"."""

from __future__ import annotations

import copy

import torch

from mstar.kernels import moe_tiled
from mstar.kernels.moe_small import experts_small
from mstar.kernels.moe_tiled import experts_tiled
from mstar.layers import moe as moe_mod
from mstar.layers.fp8 import quantize_per_channel
from mstar.layers.fused import FUSED
from mstar.layers.moe import MoESpec, SparseMoE, experts_loop, route

TIGHT = {"atol": 2e-5, "rtol": 2e-5}  # float32: the loop applies q * s before its matmul, the kernels after


def quantize_experts(moe: SparseMoE) -> None:
    """Make `moe`'s full-precision experts FP8 in place: quantize_per_channel of each row, as loading does."""
    experts = moe.experts
    full = {name: getattr(experts, name).detach().clone() for name in ("gate_up_proj", "down_proj")}
    experts.to_fp8()
    for name, scale_name in experts.row_scales().items():
        q, s = quantize_per_channel(full[name].reshape(-1, full[name].shape[-1]))
        getattr(experts, name).data.copy_(q.view(full[name].shape))
        getattr(experts, scale_name).data.copy_(s.view(full[name].shape[:-1]))


def fp8_block(spec: MoESpec, dtype: torch.dtype) -> tuple[SparseMoE, SparseMoE]:
    """A random block in `dtype` and its copy with FP8 experts (quantize_per_channel of each row)."""
    moe = SparseMoE(spec).to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    quantized = copy.deepcopy(moe)
    quantize_experts(quantized)
    return moe, quantized


def kernels(moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    e = moe.experts
    scales = {"gate_up_scale": e.gate_up_scale, "down_scale": e.down_scale}
    return {"small": experts_small(x, e.gate_up_proj, e.down_proj, ids, weights, **scales),
            "tiled": experts_tiled(x, e.gate_up_proj, e.down_proj, ids, weights, **scales)}


def check_kernels_match_loop() -> None:
    # (T, top_k, E, H, I): ragged K chunks and several experts per token, as in the bf16 checks
    for t, k, e, h, i in [(3, 2, 4, 40, 24), (6, 3, 5, 48, 20), (1, 2, 3, 16, 8)]:
        _, moe = fp8_block(MoESpec(h, e, k, i), torch.float32)
        x = torch.randn(t, h)
        weights, ids = route(moe.gate(x), k, True)
        want = experts_loop(x, moe.experts, ids, weights)
        for path, got in kernels(moe, x, ids, weights).items():
            torch.testing.assert_close(got, want, **TIGHT, msg=f"{path} {(t, k, e, h, i)}")


def check_bfloat16_and_error() -> None:
    """The FP8 experts' distance to float32 ones (E4M3 rounding), and bfloat16 activations: each kernel as
    far from the loop over the dequantized experts as the bfloat16 kernels are from the bfloat16 loop on
    the same block (2.0% in norm under the interpreter; both round the same intermediates, the loop
    also rounds q * s), bound 3%."""
    spec = MoESpec(64, 8, 2, 32)
    ref, fp8 = fp8_block(spec, torch.float32)
    x = torch.randn(5, 64)
    weights, ids = route(ref.gate(x), 2, True)
    want = experts_loop(x, ref.experts, ids, weights)
    got = experts_loop(x, fp8.experts, ids, weights)
    error = ((got - want).norm() / want.norm()).item()
    assert 0.005 < error < 0.08, error  # E4M3's 2^-4 relative rounding, averaged over the sums
    xb, wb = x.bfloat16(), weights.bfloat16()
    loop = experts_loop(xb, fp8.experts, ids, wb).float()
    for path, out in kernels(fp8, xb, ids, wb).items():
        assert ((out.float() - loop).norm() / loop.norm()).item() < 0.03, path


def check_sparse_moe_paths() -> None:
    """SparseMoE with FP8 experts: small, tiled and loop agree; a forced "grouped" runs the tiled kernels in
    chunks of MAX_SLOTS // top_k tokens (MAX_SLOTS lowered so 10 tokens take 3 calls)."""
    _, moe = fp8_block(MoESpec(32, 6, 2, 16, shared_intermediate_size=8), torch.float32)
    x = torch.randn(10, 32)
    moe.force_path = "loop"
    want = moe(x)
    for path in ("small", "tiled"):
        moe.force_path = path
        torch.testing.assert_close(moe(x), want, **TIGHT, msg=path)
    calls = []
    real, max_slots = moe_tiled.experts_tiled, moe_tiled.MAX_SLOTS

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    moe_tiled.experts_tiled, moe_tiled.MAX_SLOTS = counting, 8
    try:
        moe.force_path = "grouped"
        torch.testing.assert_close(moe(x), want, **TIGHT)
        assert calls == [4, 4, 2], calls
    finally:
        moe_tiled.experts_tiled, moe_tiled.MAX_SLOTS = real, max_slots
    moe.force_path = None  # FP8 experts are capturable where the tiled kernels serve large batches: CUDA only
    assert moe_mod.moe_graph_capturable(torch.nn.ModuleList([moe])) is False


if __name__ == "__main__":
    assert FUSED.ops_for(torch.zeros(1)) is not None, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    with torch.no_grad():
        check_kernels_match_loop()
        check_bfloat16_and_error()
        check_sparse_moe_paths()
    print("moe fp8 ok")
