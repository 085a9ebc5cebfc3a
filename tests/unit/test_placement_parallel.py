"""Placement of multi-rank replicas: sp_size > 1 only for components that declare sequence_parallel."""

from __future__ import annotations

import pytest

from mstar.config import config_from_dict, load_config
from mstar.graph import ComponentSpec
from mstar.graph.placement import PlacementError, plan_placement
from mstar.models.registry import get_model_class


def _wan_graph():
    cls = get_model_class("wan22")
    return cls(cls.make_config(tiny=True)).graph()


def _groups(*groups: dict):
    return config_from_dict({"model": "wan22", "node_groups": list(groups)}, "sp.yaml").node_groups


def test_sp2_dit_is_one_replica_of_two_ranks():
    config = load_config("configs/wan22_sp2.yaml")
    plan = plan_placement(_wan_graph(), config.node_groups, config.source)
    assert plan.replicas("dit", "denoise") == ((0, 1),)
    assert plan.replicas("vae", "decode") == ((0,),)
    assert plan.components_on(1) == ["dit"] and plan.num_workers == 2


def test_sp_for_a_component_without_support_names_it_and_the_fix():
    groups = _groups({"node_names": ["text_encoder", "scheduler", "dit"], "ranks": [0]},
                     {"node_names": ["vae"], "ranks": [0, 1], "sp_size": 2})
    with pytest.raises(PlacementError, match=r"sp\.yaml: node_groups\[1\]: sp_size=2, but component 'vae' does "
                                             r"not support sequence parallelism \(components that do: \['dit'\]\)"):
        plan_placement(_wan_graph(), groups, "sp.yaml")


def test_sp_by_node_name_checks_the_node_component():
    groups = _groups({"node_names": ["text_encoder", "scheduler", "dit"], "ranks": [0]},
                     {"node_names": ["decode"], "ranks": [0, 1], "sp_size": 2})
    with pytest.raises(PlacementError, match=r"component 'vae' does not support .* move 'decode' to a group"):
        plan_placement(_wan_graph(), groups, "sp.yaml")
    ok = _groups({"node_names": ["text_encoder", "scheduler", "vae", "cond"], "ranks": [0]},
                 {"node_names": ["uncond"], "ranks": [1, 2], "sp_size": 2})
    assert plan_placement(_wan_graph(), ok).node_replicas("dit", "uncond", "denoise") == ((1, 2),)


def test_tensor_parallel_is_rejected_for_now():
    groups = _groups({"node_names": ["text_encoder", "scheduler", "vae", "dit"], "ranks": [0, 1], "tp_size": 2})
    with pytest.raises(PlacementError, match=r"tp_size=2: tensor-parallel replicas are not supported yet"):
        plan_placement(_wan_graph(), groups)


def test_only_stateless_components_may_declare_sequence_parallel():
    assert ComponentSpec("stateless", sequence_parallel=True).sequence_parallel
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs a stateless component"):
        ComponentSpec("autoregressive", sequence_parallel=True)
