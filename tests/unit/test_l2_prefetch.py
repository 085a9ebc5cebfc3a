"""The decode GEMVs' L2 prefetch chain (`layers/linear.chain_l2_prefetch`, `kernels/gemv.L2_PREFETCH`):
which weight each projection hints, and how many lines each GEMV program hints. The hint itself is a
GPU instruction: `tests/gpu/test_gemv_gpu.py::test_l2_prefetch_changes_no_bits` runs it."""

from __future__ import annotations

import pytest
import torch

from mstar.layers.linear import L2Next, chain_l2_prefetch
from mstar.models.llama.model import build_model
from mstar.models.llama.tiny import tiny_config

pytest.importorskip("triton")


def test_llama_chains_its_projections_in_decode_order_and_ends_on_the_head_rows_it_reads():
    model = build_model(tiny_config("llama"))
    order = []
    for layer in model.model.layers:
        order += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    for module, following in zip(order, order[1:]):
        assert module.l2_next.module is following and module.l2_next.rows is None
    assert order[-1].l2_next == L2Next(model.lm_head, None)
    assert getattr(model.lm_head, "l2_next", None) is None
    model.restrict_logits((5, 40), blocked=(6, 9))
    assert order[-1].l2_next == L2Next(model.lm_head, (5, 40))
    torch.testing.assert_close(order[-1].l2_next.weight(), model.lm_head.weight[5:40], rtol=0, atol=0)
    model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight))  # a later load
    assert order[-1].l2_next.weight().abs().sum() == 0  # the module's current weight is the one hinted
    model.restrict_logits(None)
    assert order[-1].l2_next.rows is None


def test_chain_of_one_hints_nothing():
    single = torch.nn.Linear(4, 4)
    chain_l2_prefetch([single])
    assert single.l2_next is None


def test_prefetch_lines_cover_the_capped_target_once_spread_over_the_programs():
    from mstar.kernels.gemv import L2_LINE, L2_PREFETCH

    target = torch.empty(3072, 3072, dtype=torch.bfloat16)  # 18 MiB
    saved = L2_PREFETCH.max_bytes
    try:
        L2_PREFETCH.max_bytes = 0
        assert L2_PREFETCH.lines(target, 100) == (0, 0)
        L2_PREFETCH.max_bytes = 4 << 20
        lines, numel = L2_PREFETCH.lines(target, 1000)
        assert numel * 2 == 4 << 20
        assert lines * 1000 * L2_LINE >= 4 << 20 and lines == 64  # 32.8 lines a program, rounded up to 2^k
        L2_PREFETCH.max_bytes = 1 << 30
        assert L2_PREFETCH.lines(target, 1000)[1] == target.numel()
        assert L2_PREFETCH.lines(None, 1000) == (0, 0)
        with pytest.raises(ValueError, match="contiguous"):
            L2_PREFETCH.lines(target.t(), 1000)
    finally:
        L2_PREFETCH.max_bytes = saved
