"""Guidance branches of BAGEL on three worker processes (mstar/configs/bagel_cfg_parallel.yaml) give what one
worker gives: each branch's context is prefilled and read on the rank its node sits on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar.config import load_config
from mstar.graph.placement import plan_placement
from mstar.models.registry import get_model_class
from mstar.runtime.offline import MStar

pytestmark = pytest.mark.usefixtures("one_thread")
PHOTO = (np.random.default_rng(1).random((48, 64, 3)) * 255).astype(np.uint8)
REQUESTS = [({"text": "Make the sky purple", "media": [{"type": "image", "data": PHOTO}]}, {"seed": 1}),
            ({"text": "A red fox in the snow"}, {"seed": 2, "modalities": ["text", "image"], "max_tokens": 3})]
OPTIONS = {"modalities": ["image"], "num_inference_steps": 4, "debug_outputs": True, "temperature": 0.0}


def test_placement_puts_each_branch_on_its_rank():
    config = load_config("bagel_cfg_parallel")
    cls = get_model_class("bagel")
    plan = plan_placement(cls(cls.make_config(tiny=True)).graph(), config.node_groups, config.source)
    for walk in ("prefill_guided", "denoise"):
        assert plan.node_replicas("llm", "full", walk) == ((0,),)
        assert plan.node_replicas("llm", "no_text", walk) == ((1,),)
        assert plan.node_replicas("llm", "no_image", walk) == ((2,),)
    assert plan.node_replicas("llm", "decode", "decode") == ((0,),) and plan.num_workers == 3
    assert plan.components_on(1) == ["llm"] and plan.components_on(2) == ["llm"]


def _run(m) -> list:
    handles = [m.submit(request, **{**OPTIONS, **options}) for request, options in REQUESTS]
    return [h.result().outputs for h in handles]


@pytest.mark.slow  # worker processes; test_wan22_cfg_parallel.py is the default run's representative
def test_three_process_cfg_parallel_equals_one_worker():
    with MStar("bagel", tiny=True) as m:
        expected = _run(m)
    with MStar(config="bagel_cfg_parallel", mode="multiproc", tiny=True) as m:
        got = _run(m)
    for ours, want in zip(got, expected, strict=True):
        assert [t.tolist() for t in ours.get("text", [])] == [t.tolist() for t in want.get("text", [])]
        assert len(ours["step_latents"]) == 3
        for a, b in zip(ours["step_latents"], want["step_latents"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)  # branches batched differently: float noise only
        assert np.abs(np.asarray(ours["image"][0]).astype(int) - np.asarray(want["image"][0]).astype(int)).max() <= 1


def test_each_rank_runs_only_its_branch(monkeypatch):
    from mstar.models.bagel.components import LLMComponent

    seen: dict[int, set[tuple[str, str]]] = {}
    original = LLMComponent.run_items

    def spy(self, items):
        seen.setdefault(id(self), set()).update((item.walk, item.node) for item in items)
        return original(self, items)

    monkeypatch.setattr(LLMComponent, "run_items", spy)
    with MStar(config="bagel_cfg_parallel", tiny=True) as m:
        _run(m)
        ranks = {rank: id(w.engines["llm"].module) for rank, w in m.runtime.workers.items()}
    assert seen[ranks[1]] == {("prefill_guided", "no_text"), ("denoise", "no_text")}
    assert seen[ranks[2]] == {("prefill_guided", "no_image"), ("denoise", "no_image")}
    assert {node for _, node in seen[ranks[0]]} == {"full", "decode", "close"}
