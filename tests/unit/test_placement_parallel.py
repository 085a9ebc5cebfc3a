"""Placement of multi-rank replicas: sp_size > 1 only for components that declare sequence_parallel,
tp_size > 1 only for those that declare tensor_parallel, never both in one group."""

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
    config = load_config("wan22_sp2")
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


def test_tensor_parallel_only_where_declared():
    groups = _groups({"node_names": ["text_encoder", "scheduler", "vae", "dit"], "ranks": [0, 1], "tp_size": 2})
    with pytest.raises(PlacementError, match=r"tp_size=2, but component 'text_encoder' does not support tensor "
                                             r"parallelism \(components that do: none\)"):
        plan_placement(_wan_graph(), groups)
    both = _groups({"node_names": ["text_encoder", "scheduler", "vae"], "ranks": [0]},
                   {"node_names": ["dit"], "ranks": [0, 1, 2, 3], "tp_size": 2, "sp_size": 2})
    with pytest.raises(PlacementError, match=r"tp_size=2 with sp_size=2: a replica is tensor- or sequence-parallel"):
        plan_placement(_wan_graph(), both)


def test_the_omni_thinker_may_be_tensor_parallel():
    cls = get_model_class("qwen3_omni")
    graph = cls(cls.make_config(tiny=True)).graph()
    groups = config_from_dict({"model": "qwen3_omni", "node_groups": [
        {"node_names": ["thinker"], "ranks": [0, 1], "tp_size": 2},
        {"node_names": ["audio_encoder", "vision_encoder", "talker_input", "talker", "code_predictor", "code2wav"],
         "ranks": [0]}]}, "tp.yaml").node_groups
    plan = plan_placement(graph, groups, "tp.yaml")
    assert plan.replicas("thinker", "decode") == ((0, 1),) and plan.replicas("talker", "talk") == ((0,),)
    assert plan.components_on(1) == ["thinker"]


def test_only_stateless_components_may_declare_sequence_parallel():
    assert ComponentSpec("stateless", sequence_parallel=True).sequence_parallel
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs a stateless component"):
        ComponentSpec("autoregressive", sequence_parallel=True)
    assert ComponentSpec("autoregressive", tensor_parallel=True).tensor_parallel
    with pytest.raises(ValueError, match=r"tensor_parallel=True needs an autoregressive component"):
        ComponentSpec("stateless", tensor_parallel=True)


def test_multi_rank_replicas_are_refused_on_ray_with_the_fix():
    from mstar.runtime.replicas import check_run_mode

    config = load_config("wan22_sp2")
    plan = plan_placement(_wan_graph(), config.node_groups, config.source)
    with pytest.raises(ValueError, match=r"\['dit'\] run on multi-rank replicas .* the Ray launcher does not start "
                                         r"yet: use replicas of one rank, or serve on one host"):
        check_run_mode(plan, "ray")
    check_run_mode(plan, "multiproc")
