"""The Wan DiT replayed from CUDA graphs (dit_graphs.py) gives the eager forward's velocities.

Run on the lent machine: `python3 -m pytest -q -m gpu tests/gpu/test_wan22_dit_graphs_gpu.py`.
"""

from __future__ import annotations

import types

import pytest
import torch

from mstar.engines.cuda_graphs import BatchGraphs
from mstar.models.common.loading import fill_dummy_weights
from mstar.models.wan22.components import DiTComponent
from mstar.models.wan22.config import WanTransformerConfig
from mstar.models.wan22.tiny import TINY_TEXT_LENGTH, tiny_config
from mstar.models.wan22.transformer import build_transformer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_lazy_batch_graphs_capture_a_size_on_its_first_batch_and_share_a_pool() -> None:
    pool = torch.cuda.graph_pool_handle()
    double = BatchGraphs(lambda x: x * 2 + 1, [1, 2, 4], [((3,), torch.float32)], torch.device("cuda"),
                         lazy=True, pool=pool)
    square = BatchGraphs(lambda x: x * x, [1, 2, 4], [((3,), torch.float32)], torch.device("cuda"),
                         lazy=True, pool=pool)
    assert double.captured_sizes == [] and square.captured_sizes == []
    x = torch.arange(9.0, device="cuda").view(3, 3)
    got = double(x)[0].clone()
    assert double.captured_sizes == [4] and square.captured_sizes == []
    torch.testing.assert_close(got, x * 2 + 1)
    torch.testing.assert_close(square(x[:1])[0], x[:1] * x[:1])
    torch.testing.assert_close(double(x + 1)[0], (x + 1) * 2 + 1)  # replays the captured size
    assert double.captured_sizes == [4] and square.captured_sizes == [1]


def _items(latents, contexts, step: int, request: str = "r") -> list:
    ts = torch.full((latents.shape[1],), 900.0 - 200 * step, device="cuda")
    ts[0] = 0.0
    return [types.SimpleNamespace(request_id=request, node=node, walk="denoise",
                                  inputs={"latents": latents, "timestep": ts, "context": ctx})
            for node, ctx in zip(("cond", "uncond"), contexts, strict=False)]


def _velocities(component: DiTComponent, items: list) -> list[torch.Tensor]:
    return [out["velocity"] for out in component.run_items(items)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replays_match_eager_forwards_as_batches_change(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = build_transformer(tiny_config().transformer, dtype, "cuda")
    fill_dummy_weights(model, std=0.3)
    graphs, eager = DiTComponent(model, graph_rows=4), DiTComponent(model)
    gen = torch.Generator("cuda").manual_seed(1)
    texts = [torch.randn(TINY_TEXT_LENGTH, 32, device="cuda", generator=gen) for _ in range(5)]
    lat = [torch.randn(16, 3, 4, 6, device="cuda", generator=gen) for _ in range(3)]
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    batches = [
        _items(lat[0], texts[:2], 0),  # 2 rows: captured at 2
        _items(lat[0], texts[:2], 1),  # same rows, next step: text K/V already staged
        _items(lat[1], texts[2:3], 0, "q"),  # 1 row, another text
        _items(lat[0], texts[:2], 2) + _items(lat[2], texts[3:4], 0, "s"),  # 3 rows: restaged
        _items(lat[0], texts[:2], 3) + _items(lat[1], texts[2:4], 1, "q") + _items(lat[2], texts[4:5], 1, "s"),
    ]
    kept = None
    for items in batches:
        got, want = _velocities(graphs, items), _velocities(eager, items)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **tol)
        if kept is None:
            kept = (got[0].clone(), got[0])
    torch.testing.assert_close(kept[1], kept[0], atol=0, rtol=0)  # later replays left earlier outputs alone
    shapes = graphs.graphs.captured
    assert list(shapes.values()) == [[1, 2, 3]]  # the 5-row batch ran eagerly (over graph_rows)


def test_full_width_two_layers_at_the_benchmark_shape() -> None:
    """Two full-width bf16 layers at 832x480 x 9 latent frames, 2 rows: graph replay = eager forward."""
    config = WanTransformerConfig(num_layers=2)
    torch.manual_seed(0)
    model = build_transformer(config, torch.bfloat16, "cuda")
    fill_dummy_weights(model)
    graphs, eager = DiTComponent(model, graph_rows=2), DiTComponent(model)
    gen = torch.Generator("cuda").manual_seed(1)
    texts = [torch.randn(512, config.text_dim, device="cuda", generator=gen) for _ in range(2)]
    latents = torch.randn(48, 9, 30, 52, device="cuda", generator=gen)
    for step in range(2):
        items = _items(latents, texts, step)
        for g, w in zip(_velocities(graphs, items), _velocities(eager, items), strict=True):
            assert (g - w).abs().max().item() <= 0.02 * w.abs().max().item()
