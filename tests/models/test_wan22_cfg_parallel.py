"""Guidance branches on two worker processes (mstar/configs/wan22_cfg_parallel.yaml) give what one device gives."""

from __future__ import annotations

import pytest
import torch

from mstar.config import load_config
from mstar.graph.placement import plan_placement
from mstar.models.registry import get_model_class
from mstar.runtime.offline import MStar
from tests.models.wan22_testing import NEGATIVE, PROMPTS, outputs_of, write_pipeline_dir

OPTIONS = {"negative_prompt": NEGATIVE, "width": 64, "height": 64, "num_frames": 5, "num_inference_steps": 3,
           "guidance_scale": 5.0, "debug_outputs": True}


def test_cfg_parallel_placement_splits_the_branches_by_node_name():
    config = load_config("wan22_cfg_parallel")
    cls = get_model_class("wan22")
    graph = cls(cls.make_config(tiny=True)).graph()
    plan = plan_placement(graph, config.node_groups, config.source)
    assert plan.node_replicas("dit", "cond", "denoise") == ((0,),)
    assert plan.node_replicas("dit", "uncond", "denoise") == ((1,),)
    assert plan.components_on(0) == ["dit", "scheduler", "text_encoder", "vae"]
    assert plan.components_on(1) == ["dit"] and plan.num_workers == 2


def _run(m) -> list[dict]:
    handles = [m.submit({"text": p}, seed=i, **OPTIONS) for i, p in enumerate(PROMPTS[:2])]
    return [outputs_of(h.result()) for h in handles]


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_pipeline_dir(tmp_path_factory.mktemp("wan22_cfg"))


def test_two_process_cfg_parallel_equals_one_device(root):
    with MStar("wan22", tiny=True, model_path=str(root)) as m:
        expected = _run(m)
    with MStar(config="wan22_cfg_parallel", mode="multiproc", tiny=True, model_path=str(root)) as m:
        got = _run(m)
    for ours, want in zip(got, expected, strict=True):
        assert len(ours["steps"]) == 3
        for a, b in zip(ours["steps"], want["steps"], strict=True):
            # the branches batch differently (2 rows vs 1 per forward): float32 summation-order noise only
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        torch.testing.assert_close(ours["frames"], want["frames"], atol=1e-4, rtol=0)


def test_each_rank_runs_only_its_branch(root, monkeypatch):
    from mstar.models.wan22.components import DiTComponent

    seen: dict[int, set[str]] = {}
    original = DiTComponent.run_items

    def spy(self, items):
        seen.setdefault(id(self), set()).update(item.node for item in items)
        return original(self, items)

    monkeypatch.setattr(DiTComponent, "run_items", spy)
    with MStar(config="wan22_cfg_parallel", tiny=True, model_path=str(root)) as m:
        m.submit({"text": PROMPTS[0]}, seed=0, **OPTIONS).result()
        ranks = {rank: id(w.engines["dit"].module) for rank, w in m.runtime.workers.items()}
    assert seen == {ranks[0]: {"cond"}, ranks[1]: {"uncond"}}
