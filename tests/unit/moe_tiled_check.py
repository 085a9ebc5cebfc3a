"""Checks of the tiled MoE kernels (mstar/kernels/moe_tiled.py) against the per-expert loop, of their expert
parallelism, and of SparseMoE's choice of path among small, tiled and grouped/loop; run with
TRITON_INTERPRET=1 by test_moe_tiled.py in a fresh process. Prints "moe tiled ok"."""

from __future__ import annotations

import sys

import torch

from mstar.kernels import moe_tiled
from mstar.kernels.moe_tiled import TiledMoEConfig, experts_tiled
from mstar.layers import moe as moe_mod
from mstar.layers.fused import FUSED
from mstar.layers.moe import ExpertShard, MoESpec, SparseMoE, experts_loop, route
from tests.unit.moe_small_check import TIGHT, block


def tiled(moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, first: int = 0,
          config: TiledMoEConfig | None = None, experts: slice = slice(None)) -> torch.Tensor:
    return experts_tiled(x, moe.experts.gate_up_proj[experts], moe.experts.down_proj[experts], ids, weights,
                         first, config)


# (T, top_k, E, H, I): non-powers of two (ragged K chunks in both kernels), top_k 3 and 6 padded to 4
# and 8 in the combine, one token, one expert per token, and few experts for many tokens: 40 tokens on
# 4 experts put ~20 slots on each, more than one 16-slot tile per expert.
CASES = [(1, 2, 4, 40, 24), (3, 3, 5, 40, 24), (6, 2, 3, 48, 20), (2, 6, 8, 24, 20), (5, 1, 7, 33, 17),
         (40, 2, 4, 32, 16), (17, 8, 16, 64, 48)]
QUICK_CASE = (40, 2, 4, 32, 16)  # several tiles per expert: the one shape of the default test run


def check_matches_loop(cases=CASES) -> None:
    for t, k, e, h, i in cases:
        moe = block(MoESpec(h, e, k, i))
        x = torch.randn(t, h)
        weights, ids = route(moe.gate(x), k, True)
        want = experts_loop(x, moe.experts, ids, weights)
        torch.testing.assert_close(tiled(moe, x, ids, weights), want, **TIGHT)
        if (t, e) == (40, 4):
            assert torch.bincount(ids.flatten(), minlength=e).max() > 16, "the case must need two tiles per expert"
    empty = torch.zeros(0, 16)
    assert tiled(block(MoESpec(16, 4, 2, 8)), empty, torch.zeros(0, 2, dtype=torch.long), empty[:, :2]).shape == (0, 16)


def check_configs() -> None:
    # tiles larger than the sizes (masked rows and columns), several K chunks, 32-slot tiles, 8 warps
    moe = block(MoESpec(80, 6, 3, 40))
    x = torch.randn(9, 80)
    weights, ids = route(moe.gate(x), 3, True)
    want = experts_loop(x, moe.experts, ids, weights)
    for cfg in (TiledMoEConfig(16, 16, 16, down_block_n=16, down_block_k=16, combine_block=16),
                TiledMoEConfig(32, 64, 32, 8, 2, 128, 64, 8, 2, 128), moe_tiled.tiled_config(80, 40), TiledMoEConfig()):
        torch.testing.assert_close(tiled(moe, x, ids, weights, config=cfg), want, **TIGHT)


def check_expert_parallel() -> None:
    # Each half of the experts alone (ids stay global) gives that half's share; the shares add up to the
    # whole, and a share no slot routes to is zero.
    moe = block(MoESpec(32, 8, 2, 24))
    x = torch.randn(6, 32)
    weights, ids = route(moe.gate(x), 2, True)
    low = tiled(moe, x, ids, weights, first=0, experts=slice(0, 4))
    high = tiled(moe, x, ids, weights, first=4, experts=slice(4, 8))
    for first, got in ((0, low), (4, high)):
        mine = (ids >= first) & (ids < first + 4)
        want = experts_loop(x, moe.experts, ids, torch.where(mine, weights, 0.0))
        torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(low + high, experts_loop(x, moe.experts, ids, weights), **TIGHT)
    assert torch.equal(tiled(moe, x, torch.zeros_like(ids), weights, first=4, experts=slice(4, 8)), torch.zeros(6, 32))

    # SparseMoE on an expert-parallel rank: the tiled path (global ids) equals the loop (localized ids)
    spec = MoESpec(32, 8, 2, 24)
    rank = SparseMoE(spec, ExpertShard(1, 2, 8, group=None))
    with torch.no_grad():
        rank.gate.weight.copy_(moe.gate.weight)
        rank.experts.gate_up_proj.copy_(moe.experts.gate_up_proj[4:])
        rank.experts.down_proj.copy_(moe.experts.down_proj[4:])
    rank.force_path = "tiled"
    got = rank._local(x)  # the rank's share, before the all-reduce
    rank.force_path = "loop"
    torch.testing.assert_close(got, rank._local(x), **TIGHT)
    torch.testing.assert_close(got, high, **TIGHT)


def check_half() -> None:
    # float16 (the interpreter's tl.dot takes bfloat16 operands as raw bits, so bfloat16 is checked on the
    # GPU, tests/gpu/test_moe_grouped.py): the kernels round where the reference rounds, the summation
    # order differs, so a bound of a few half-precision steps of the largest output.
    moe = block(MoESpec(64, 8, 4, 48), torch.float16)
    x = torch.randn(20, 64, dtype=torch.float16)
    weights, ids = route(moe.gate(x), 4, True)
    got = tiled(moe, x, ids, weights)
    want = experts_loop(x.float(), block_as(moe, torch.float32).experts, ids, weights.float())
    assert got.dtype == torch.float16
    assert (got.float() - want).abs().max() <= 0.01 * want.abs().max(), (got.float() - want).abs().max()


def block_as(moe: SparseMoE, dtype: torch.dtype) -> SparseMoE:
    copy = SparseMoE(moe.spec)
    copy.load_state_dict({k: v.to(dtype) for k, v in moe.state_dict().items()})
    return copy


def check_path_bounds() -> None:
    lo, hi = moe_mod.TILED_MIN_SLOTS, moe_mod.TILED_MAX_SLOTS
    x = lambda t: torch.zeros(t, 16)  # noqa: E731
    assert moe_mod.pick_path(x(lo // 4 - 1), 4) == "small"
    assert moe_mod.pick_path(x(lo // 4), 4) == "tiled"
    assert moe_mod.pick_path(x(hi // 4), 4) == "tiled"
    assert moe_mod.pick_path(x(hi // 4 + 1), 4) == "loop"  # CPU: no grouped path


def check_path_choice() -> None:
    lo, hi, small_max = moe_mod.TILED_MIN_SLOTS, moe_mod.TILED_MAX_SLOTS, moe_mod.SMALL_MAX_SLOTS
    calls = []
    real = moe_tiled.experts_tiled

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    def broken(*args, **kwargs):
        calls.append(-1)
        raise RuntimeError("no compiler")

    moe = block(MoESpec(16, 8, 4, 8, shared_intermediate_size=8))
    moe_tiled.experts_tiled = counting
    moe_mod.TILED_MIN_SLOTS, moe_mod.TILED_MAX_SLOTS = 16, 48  # fewer tokens through the interpreter
    try:
        few, some, many = torch.randn(3, 16), torch.randn(5, 16), torch.randn(13, 16)  # 12, 20 and 52 slots
        assert [moe_mod.pick_path(t, 4) for t in (few, some, many)] == ["small", "tiled", "small"]
        got = moe(some)
        assert calls == [5], calls
        moe(few)
        moe(many)
        assert calls == [5], "only the tiled range takes the tiled path"
        moe.force_path = "loop"
        torch.testing.assert_close(got, moe(some), **TIGHT)  # the shared expert is added on both paths
        moe.force_path = None
        moe_tiled.experts_tiled = broken  # a tiled kernel that fails: logged once, then the small path
        torch.testing.assert_close(moe(some), got, **TIGHT)
        assert not moe_mod._TILED.usable and calls == [5, -1]
        assert moe_mod.pick_path(some, 4) == "small"
        moe(some)
        assert calls == [5, -1], "a failed kernel is not tried again"
    finally:
        moe_tiled.experts_tiled = real
        moe_mod.TILED_MIN_SLOTS, moe_mod.TILED_MAX_SLOTS, moe_mod.SMALL_MAX_SLOTS = lo, hi, small_max
        moe_mod._TILED.usable = True


if __name__ == "__main__":
    assert FUSED.ops_for(torch.zeros(1)) is not None, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    if "--quick" in sys.argv:  # one representative shape and the path bounds (the default test run)
        with torch.no_grad():
            check_matches_loop([QUICK_CASE])
            check_path_bounds()
        print("moe tiled ok")
        sys.exit(0)
    with torch.no_grad():
        check_matches_loop()
        check_configs()
        check_expert_parallel()
        check_half()
        check_path_bounds()
        check_path_choice()
    print("moe tiled ok")
