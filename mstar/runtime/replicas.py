"""Wire multi-rank replicas (sp_size > 1) into one worker process: join the groups, hand them to
components, and make the lead rank forward each batch to its followers (worker/replica.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from mstar.distributed.groups import ProcessGroups, Rendezvous
from mstar.engines.base import Engine
from mstar.graph.placement import PlacementPlan
from mstar.worker.replica import LeadModule

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
    if replicas and mode != "multiproc":
        raise ValueError(f"components {sorted(replicas)} run on multi-rank replicas (sp_size > 1), which need one "
                         f"process per rank: use mode='multiproc' (got {mode!r}) or sp_size: 1")


def join_replicas(plan: PlacementPlan, rank: int, device: torch.device, engines: dict[str, Engine],
                  rendezvous: Rendezvous, send: Callable[[int, Any], None], pack: Callable[[Any], Any]
                  ) -> ProcessGroups:
    """Join the world and this rank's replica groups (every worker must call this), give each
    sequence-parallel component its group, and wrap the lead rank's modules to forward batches."""
    replicas = multi_rank_replicas(plan)
    groups = ProcessGroups(rendezvous, rank, device)
    groups.start(r for reps in replicas.values() for r in reps)
    for component, engine in engines.items():
        mine = sorted(r for r in replicas.get(component, ()) if rank in r)
        if not mine:
            continue
        if len(mine) > 1:
            raise ValueError(f"worker {rank} holds component {component!r} in two multi-rank replicas {mine}; "
                             "place each rank in one replica of a component")
        replica = groups.group(mine[0])
        module = engine.module  # stateless engines only (placement checks ComponentSpec.sequence_parallel)
        module.set_sp_group(replica.group)
        if replica.is_lead:
            engine.module = LeadModule(module, component, replica.ranks[1:], send, pack)
        logger.info("worker %d: %s runs on replica %s (%s)", rank, component, replica.ranks,
                    "lead" if replica.is_lead else "follower")
    return groups
