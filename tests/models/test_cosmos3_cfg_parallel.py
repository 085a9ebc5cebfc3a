"""Cosmos3's guidance branches on two worker processes (mstar/configs/cosmos3_cfg_parallel.yaml) give what
one device gives; each rank holds only its branch's prompt keys and values."""

from __future__ import annotations

import pytest
import torch

from mstar.config import load_config
from mstar.graph.placement import plan_placement
from mstar.models.registry import get_model_class
from mstar.runtime.offline import MStar
from tests.models.cosmos3_testing import NEGATIVE, PROMPTS, outputs_of

OPTIONS = {"negative_prompt": NEGATIVE, "width": 64, "height": 64, "num_frames": 5, "num_inference_steps": 3,
           "debug_outputs": True}


def test_cfg_parallel_placement_splits_the_branches_by_node_name():
    config = load_config("cosmos3_cfg_parallel")
    cls = get_model_class("cosmos3")
    plan = plan_placement(cls(cls.make_config(tiny=True)).graph(), config.node_groups, config.source)
    assert plan.node_replicas("dit", "cond", "denoise") == ((0,),)
    assert plan.node_replicas("dit", "uncond", "denoise") == ((1,),)
    assert plan.components_on(1) == ["dit"] and plan.num_workers == 2


@pytest.mark.slow  # worker processes; test_wan22_cfg_parallel.py is the default run's representative
def test_two_process_cfg_parallel_equals_one_device():
    def run(m) -> list[dict]:
        handles = [m.submit({"text": p}, seed=i, **OPTIONS) for i, p in enumerate(PROMPTS[:2])]
        return [outputs_of(h.result()) for h in handles]

    with MStar("cosmos3", tiny=True) as m:
        expected = run(m)
    with MStar(config="cosmos3_cfg_parallel", mode="multiproc", tiny=True) as m:
        got = run(m)
    for ours, want in zip(got, expected, strict=True):
        assert len(ours["steps"]) == 3
        for a, b in zip(ours["steps"], want["steps"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)  # rows batch differently: summation order only
        torch.testing.assert_close(ours["frames"], want["frames"], atol=1e-4, rtol=0)
