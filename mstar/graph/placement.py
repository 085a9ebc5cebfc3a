"""Placement planning: map each (component, walk) to the replicas that may run it.

Input groups are duck-typed (`node_names`, `graph_walks`, `replicas()`) so this module stays free
of the config package; errors name the group and the source file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mstar.graph.spec import ModelGraph, iter_nodes
from mstar.graph.validate import GraphError

Replica = tuple[int, ...]  # worker ranks running one copy of a component in lockstep (lead rank first)


class PlacementError(GraphError):
    """A placement cannot work; the message names the node group and the file."""


@dataclass(frozen=True)
class PlacementPlan:
    """(component, walk) -> replicas, plus which ranks build which components."""

    table: dict[tuple[str, str], tuple[Replica, ...]]
    num_workers: int

    def replicas(self, component: str, walk: str) -> tuple[Replica, ...]:
        return self.table[(component, walk)]

    def components_on(self, rank: int) -> list[str]:
        """Components a worker of this rank must build."""
        names = {c for (c, _), reps in self.table.items() for rep in reps if rank in rep}
        return sorted(names)


def plan_placement(
    graph: ModelGraph, groups: Sequence[Any], source: str = "<config>", max_ranks: int | None = None
) -> PlacementPlan:
    """Check the groups against the graph and build the plan; no groups puts everything on rank 0."""
    walks = {w.name: w for w in graph.walks}
    table: dict[tuple[str, str], list[Replica]] = {}
    for i, group in enumerate(groups):
        where = f"{source}: node_groups[{i}]"
        _check_group(group, graph, walks, where, max_ranks)
        for walk in group.graph_walks or walks:
            for component in group.node_names:
                table.setdefault((component, walk), []).extend(group.replicas())
    needed = {(n.component, w.name) for w in graph.walks for n in iter_nodes(w.body)}
    if not groups:
        table = {key: [(0,)] for key in needed}
    for component, walk in sorted(needed):
        if (component, walk) not in table:
            raise PlacementError(
                f"{source}: component {component!r} (used by walk {walk!r}) is placed in no node group; "
                "add it to a group's node_names (and its graph_walks, if the group restricts walks)"
            )
    num_workers = 1 + max(r for reps in table.values() for rep in reps for r in rep)
    return PlacementPlan({k: tuple(v) for k, v in table.items() if k in needed}, num_workers)


def _check_group(group: Any, graph: ModelGraph, walks: dict, where: str, max_ranks: int | None) -> None:
    for name in group.node_names:
        if name not in graph.components:
            raise PlacementError(f"{where}: node_names has unknown component {name!r}; components are {sorted(graph.components)}")
    for walk in group.graph_walks or ():
        if walk not in walks:
            raise PlacementError(f"{where}: graph_walks has unknown walk {walk!r}; walks are {sorted(walks)}")
    if max_ranks is not None:
        for rank in group.ranks:
            if rank >= max_ranks:
                raise PlacementError(f"{where}: rank {rank} is out of range: {max_ranks} device(s) available")
    if group.tp_size * group.sp_size > 1:
        raise PlacementError(
            f"{where}: tp_size={group.tp_size}, sp_size={group.sp_size}: tensor and sequence parallel replicas "
            "are not supported yet; use tp_size: 1 and sp_size: 1"
        )
