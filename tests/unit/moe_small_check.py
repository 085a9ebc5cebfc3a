"""Checks of the small-batch MoE kernels (mstar/kernels/moe_small.py) against the per-expert loop, and of
SparseMoE's choice of path; run with TRITON_INTERPRET=1 by test_moe_small.py, in a fresh process so the
interpreter setting holds for every kernel. Prints "moe small ok"."""

from __future__ import annotations

import sys

import torch

from mstar.kernels import moe_small
from mstar.kernels.moe_small import SmallMoEConfig, experts_small
from mstar.layers import moe as moe_mod
from mstar.layers.fused import FUSED, fused_kernels
from mstar.layers.moe import MoESpec, SparseMoE, experts_grouped, experts_loop, moe_graph_capturable, route

TIGHT = {"atol": 2e-5, "rtol": 2e-5}  # float32: only the summation order differs


def block(spec: MoESpec, dtype: torch.dtype = torch.float32) -> SparseMoE:
    moe = SparseMoE(spec).to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def small(moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
          config: SmallMoEConfig | None = None) -> torch.Tensor:
    return experts_small(x, moe.experts.gate_up_proj, moe.experts.down_proj, ids, weights, config)


def check_matches_loop() -> None:
    # (T, top_k, E, H, I): non-powers of two everywhere, top_k 3 and 6 padded to 4 and 8 slots, few
    # experts for many slots (each expert serves several tokens), top_k = E, one token, one expert.
    cases = [(1, 2, 4, 40, 24), (3, 3, 5, 40, 24), (6, 2, 3, 48, 20), (2, 6, 8, 24, 20), (4, 4, 4, 16, 8),
             (5, 1, 7, 33, 17), (8, 8, 16, 32, 12)]
    for t, k, e, h, i in cases:
        moe = block(MoESpec(h, e, k, i))
        x = torch.randn(t, h)
        weights, ids = route(moe.gate(x), k, True)
        if t * k > e:
            assert ids.flatten().unique().numel() < t * k, "the case must repeat experts across tokens"
        want = experts_loop(x, moe.experts, ids, weights)
        torch.testing.assert_close(small(moe, x, ids, weights), want, **TIGHT)
    empty = torch.zeros(0, 16)
    assert small(block(MoESpec(16, 4, 2, 8)), empty, torch.zeros(0, 2, dtype=torch.long), empty[:, :2]).shape == (0, 16)


def check_configs(quick: bool = False) -> None:
    # The default config, x read as one row per chunk (BROADCAST_X: block_k spans the warps) with a
    # ragged last chunk, several chunks per slot in both kernels, and one output column per program.
    moe = block(MoESpec(40, 6, 3, 24))
    x = torch.randn(3, 40)
    weights, ids = route(moe.gate(x), 3, True)
    want = experts_loop(x, moe.experts, ids, weights)
    configs = [SmallMoEConfig(4, 512, 16, 32), SmallMoEConfig(2, 16, 4, 8), SmallMoEConfig(8, 32, 1, 16, 2),
               moe_small.small_config(40, 24, 4)]
    for cfg in configs[-1:] if quick else configs:
        torch.testing.assert_close(small(moe, x, ids, weights, cfg), want, **TIGHT)


def check_routing_weights() -> None:
    moe = block(MoESpec(24, 5, 2, 16))
    x = torch.randn(4, 24)
    weights, ids = route(moe.gate(x), 2, True)
    base = small(moe, x, ids, weights)
    # scaling the weights by two scales the output exactly (float32); a zero weight drops that expert
    assert torch.equal(small(moe, x, ids, weights * 2), base * 2)
    only_first = torch.stack([weights[:, 0], torch.zeros_like(weights[:, 0])], dim=1)
    torch.testing.assert_close(small(moe, x, ids, only_first),
                               experts_loop(x, moe.experts, ids[:, :1], weights[:, :1]), **TIGHT)


def check_bf16() -> None:
    # The interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest), so each of the kernels'
    # five roundings may be a step off here: a loose bound against the reference; tests/gpu checks bf16.
    moe = block(MoESpec(64, 8, 4, 48), torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    weights, ids = route(moe.gate(x), 4, True)
    got = small(moe, x, ids, weights)
    want = experts_grouped(x, moe.experts, ids, weights).float()
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 0.05 * want.abs().max(), (got.float() - want).abs().max()


def check_path_choice() -> None:
    moe = block(MoESpec(16, 8, 4, 8, shared_intermediate_size=8))
    calls = []
    real = moe_small.experts_small

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    limit, tiled_range = moe_mod.SMALL_MAX_SLOTS, (moe_mod.TILED_MIN_SLOTS, moe_mod.TILED_MAX_SLOTS)
    assert moe_mod.pick_path(torch.zeros(moe_mod.TILED_MIN_SLOTS // 4 - 1, 16), 4) == "small"
    moe_small.experts_small = counting
    # fewer tokens through the interpreter; the tiled path's range empty (tests/unit/moe_tiled_check.py
    # checks the choice among the three)
    moe_mod.SMALL_MAX_SLOTS, moe_mod.TILED_MIN_SLOTS, moe_mod.TILED_MAX_SLOTS = 64, 10**6, 0
    try:
        few, many = torch.randn(16, 16), torch.randn(17, 16)  # 64 slots: small; 68: past SMALL_MAX_SLOTS
        assert moe_mod.pick_path(few, 4) == "small" and moe_mod.pick_path(many, 4) == "loop"
        got = moe(few)
        assert calls == [16], calls
        moe(many)
        assert calls == [16], "more than SMALL_MAX_SLOTS slots must not take the small path"
        moe.force_path = "loop"
        torch.testing.assert_close(got, moe(few), **TIGHT)  # the shared expert is added on both paths
        moe.force_path = "small"  # forced: any number of slots
        torch.testing.assert_close(moe(many), experts_loop_block(moe, many), **TIGHT)
        assert calls == [16, 17], calls
        assert moe_graph_capturable(torch.nn.Sequential(moe))
        with fused_kernels(False):  # MSTAR_FUSED_KERNELS=0: no small path
            assert moe_mod.pick_path(few, 4) == "loop"
        moe.force_path = "fast"
        try:
            moe(few)
        except ValueError as err:
            assert "'small'" in str(err) and "'fast'" in str(err), err
        else:
            raise AssertionError("an unknown force_path must raise")
    finally:
        moe_small.experts_small, moe_mod.SMALL_MAX_SLOTS = real, limit
        moe_mod.TILED_MIN_SLOTS, moe_mod.TILED_MAX_SLOTS = tiled_range


def experts_loop_block(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    forced = moe.force_path
    moe.force_path = "loop"
    try:
        return moe(x)
    finally:
        moe.force_path = forced


if __name__ == "__main__":
    assert FUSED.ops_for(torch.zeros(1)) is not None, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    if "--quick" in sys.argv:  # the default config (the default test run)
        with torch.no_grad():
            check_configs(quick=True)
        print("moe small ok")
        sys.exit(0)
    with torch.no_grad():
        check_matches_loop()
        check_configs()
        check_routing_weights()
        check_bf16()
        check_path_choice()
    print("moe small ok")
