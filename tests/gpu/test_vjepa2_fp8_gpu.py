"""V-JEPA 2-AC with FP8 predictor blocks on CUDA at tiny size (#40): bf16 activations take W8A8 `_scaled_mm`
(spied), and rollout steps and search iterations replayed from the world model's graphs give the eager results
without a host sync, as the bf16 predictor's do (tests/gpu/test_vjepa2_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from mstar.engines.stateless import capture_step_graphs
from mstar.layers import fp8
from mstar.models.vjepa2.ac_predictor import build_ac_predictor
from mstar.models.vjepa2.components import WorldModelComponent
from mstar.models.vjepa2.tiny import tiny_ac_config
from mstar.models.vjepa2.weights import build
from tests.gpu.test_vjepa2_gpu import _Counted, _plan, _request, _rollout

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# graphs and eager run the same kernels; a bf16 step of latents near unit size is 2^-7
TOL = 2e-2


@pytest.fixture(scope="module")
def worlds():
    """(graphed, eager) world models over one bf16 predictor with FP8 blocks on CUDA."""
    predictor = build(lambda: build_ac_predictor(tiny_ac_config(), "fp8"), torch.bfloat16, CUDA, None, None,
                      seed=5, std=0.3).eval()
    graphed = WorldModelComponent(predictor, rollout_frames=8, plan_samples=(8, 32), plan_frames=3)
    capture_step_graphs(graphed, [1], CUDA)
    return graphed, WorldModelComponent(predictor)


def test_fp8_blocks_run_w8a8(worlds, monkeypatch) -> None:
    """A search's forwards (24 candidates x 18 tokens: above the 64 rows where the FP8 GEMV may be timed in
    instead) run every block linear through `_scaled_mm`."""
    _, eager = worlds
    rows: list[int] = []
    real = fp8.scaled_mm

    def spy(x, weight, scale, bias):
        rows.append(x.shape[0])
        return real(x, weight, scale, bias)

    monkeypatch.setattr(fp8, "scaled_mm", spy)
    _plan(eager, _request(4, 1, 1), 1, 24)
    config = tiny_ac_config()
    per_forward = 4 * config.vit.num_layers
    plan_rows = 24 * (config.cond_tokens + config.tokens_per_frame)
    assert rows.count(plan_rows) >= 3 * per_forward and rows.count(plan_rows) % per_forward == 0, rows


def test_graphed_fp8_rollout_gives_the_eager_one_without_host_syncs(worlds) -> None:
    graphed, eager = worlds
    x = _request(1, 1, 7)
    counted = graphed.graphs = _Counted(graphed.graphs)
    try:
        got = _rollout(graphed, "r", x, 7, no_sync=True)
    finally:
        graphed.graphs = counted.graphs
    expected = _rollout(eager, "r", x, 7)
    assert counted.replays == 7
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL, rtol=0)
    assert (expected[-1] - expected[0]).float().abs().mean() > 0.1 and not graphed.holders


def test_graphed_fp8_search_gives_the_eager_one_without_host_syncs(worlds) -> None:
    graphed, eager = worlds
    x = _request(4, 1, 1)
    counted = graphed.graphs = _Counted(graphed.graphs)
    try:
        got, got_energies = _plan(graphed, x, 1, 24, no_sync=True)
    finally:
        graphed.graphs = counted.graphs
    expected, expected_energies = _plan(eager, x, 1, 24)
    assert counted.replays == 3 * 2
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL, rtol=0)
    torch.testing.assert_close(got_energies.float(), expected_energies.float(), atol=TOL, rtol=0)
    assert not graphed.holders
