"""Wire multi-rank replicas into one worker process: join the groups (before any component is built,
so a tensor-parallel one warms up and captures its graphs with its collectives), say which share of a
tensor-parallel component this rank builds, then hand groups to sequence-parallel modules and put each
replica's lead and followers in lockstep (worker/replica.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from mstar.distributed.groups import ProcessGroups, Rendezvous
from mstar.engines.base import Engine, SequenceParallelComponent, require
from mstar.graph import ModelGraph
from mstar.graph.placement import PlacementPlan
from mstar.layers.attention import HeadShard
from mstar.worker.replica import FollowerEngine, LeadEngine, LeadModule

logger = logging.getLogger(__name__)


def multi_rank_replicas(plan: PlacementPlan) -> dict[str, set[tuple[int, ...]]]:
    """component -> its replicas of more than one rank (component- and node-level placements)."""
    out: dict[str, set[tuple[int, ...]]] = {}
    for (component, _walk), reps in plan.table.items():
        out.setdefault(component, set()).update(r for r in reps if len(r) > 1)
    for key, reps in plan.nodes.items():
        out.setdefault(plan.node_components[key], set()).update(r for r in reps if len(r) > 1)
    return {c: reps for c, reps in out.items() if reps}


def check_run_mode(plan: PlacementPlan, mode: str) -> None:
    """Multi-rank replicas need one process per rank: reject in-process mode with the fix."""
    replicas = multi_rank_replicas(plan)
    if replicas and mode == "ray":
        raise ValueError(f"components {sorted(replicas)} run on multi-rank replicas (tp_size or sp_size > 1), which "
                         "the Ray launcher does not start yet: use replicas of one rank, or serve on one host")
    if replicas and mode != "multiproc":
        raise ValueError(f"components {sorted(replicas)} run on multi-rank replicas (tp_size or sp_size > 1), which "
                         f"need one process per rank: use mode='multiproc' (got {mode!r}) or replicas of one rank")


def start_replica_groups(plan: PlacementPlan, rank: int, device: torch.device, rendezvous: Rendezvous) -> ProcessGroups:
    """Join the world and this rank's replica groups (every worker must call this, before building)."""
    groups = ProcessGroups(rendezvous, rank, device)
    groups.start(r for reps in multi_rank_replicas(plan).values() for r in reps)
    return groups


def _replica_of(plan: PlacementPlan, rank: int, component: str, groups: ProcessGroups):
    mine = sorted(r for r in multi_rank_replicas(plan).get(component, ()) if rank in r)
    if not mine:
        return None
    if len(mine) > 1:
        raise ValueError(f"worker {rank} holds component {component!r} in two multi-rank replicas {mine}; "
                         "place each rank in one replica of a component")
    return groups.group(mine[0])


def tensor_parallel_shards(plan: PlacementPlan, graph: ModelGraph, rank: int, groups: ProcessGroups
                           ) -> dict[str, HeadShard]:
    """component -> the share of it this rank builds, for its tensor-parallel components."""
    shards = {}
    for component in plan.components_on(rank):
        replica = _replica_of(plan, rank, component, groups)
        if replica is not None and graph.components[component].tensor_parallel:
            shards[component] = HeadShard(replica.index, replica.size, replica.group)
    return shards


def wrap_replicas(plan: PlacementPlan, graph: ModelGraph, rank: int, engines: dict[str, Engine],
                  groups: ProcessGroups, send: Callable[[int, Any], None], pack: Callable[[Any, int], Any]) -> None:
    """Give each sequence-parallel module its group and wrap the lead's module to forward batches; put
    each tensor-parallel engine in lockstep (`LeadEngine` on the lead, `FollowerEngine` elsewhere; both
    were built sampling with per-request seeds and equal KV pools, `runtime.build`). Replaces entries of
    `engines`."""
    from mstar.engines.stateless import StatelessEngine

    for component, engine in list(engines.items()):
        replica = _replica_of(plan, rank, component, groups)
        if replica is None:
            continue
        if graph.components[component].tensor_parallel:
            engines[component] = (LeadEngine(engine, component, replica.ranks[1:], send, pack) if replica.is_lead
                                  else FollowerEngine(engine))
        else:
            assert isinstance(engine, StatelessEngine)  # placement checks ComponentSpec.sequence_parallel
            module = engine.module
            require(module, SequenceParallelComponent)
            module.set_sp_group(replica.group)
            if replica.is_lead:
                engine.module = LeadModule(module, component, replica.ranks[1:], send, pack)
        logger.info("worker %d: %s runs on replica %s (%s)", rank, component, replica.ranks,
                    "lead" if replica.is_lead else "follower")
