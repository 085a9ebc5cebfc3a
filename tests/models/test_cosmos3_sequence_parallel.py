"""Cosmos3's generation tower sequence-parallel on CPU: 2 spawned ranks over gloo against one process,
float32; packed rows of odd lengths (padded per row), sound and action tokens, grouped heads."""

from __future__ import annotations

import pytest
import torch

from tests.models.sp_testing import run_ranks


def _rows(model, gen: torch.Generator):
    from tests.models.test_cosmos3_networks import CONFIG, _row

    ids = torch.randint(0, 400, (9,), generator=gen)
    first, _ = _row(model, ids, torch.randn(16, 3, 5, 3, generator=gen), torch.tensor([False, True, True]), 700,
                    torch.randn(8, 6, generator=gen), torch.randn(7, 16, generator=gen), fps=12.0)
    second, _ = _row(model, ids[:4], torch.randn(16, 1, 4, 4, generator=gen), torch.tensor([True]), 999)
    assert first.num_tokens % 2 == 1 and CONFIG.num_heads % 2 == 0 == CONFIG.num_kv_heads % 2
    return [first, second]


def _model():
    from mstar.models.common.loading import fill_dummy_weights
    from mstar.models.cosmos3.weights import build_generator
    from tests.models.test_cosmos3_networks import CONFIG

    model = build_generator(CONFIG, torch.float32)
    fill_dummy_weights(model, seed=3, std=0.3)
    return model


def _check(replica, device) -> dict:
    group = replica.group
    model = _model()
    rows = _rows(model, torch.Generator().manual_seed(5))
    alone = model(rows)
    parallel = model(rows, sp_group=group)
    return {"max_diff": max((a.vision - b.vision).abs().max().item() + (0 if a.sound is None else
                            (a.sound - b.sound).abs().max().item()) + (0 if a.action is None else
                            (a.action - b.action).abs().max().item()) for a, b in zip(alone, parallel, strict=True)),
            "scale": alone[0].vision.abs().mean().item()}


@pytest.mark.slow  # spawned ranks; test_wan22_sequence_parallel.py is the default run's representative
def test_two_ranks_equal_one(tmp_path):
    results = run_ranks(_check, 2, "cpu", tmp_path)
    for result in results:
        assert result["max_diff"] < 1e-5 and result["scale"] > 0.1
