"""Placement planning: map each (component, walk) to the replicas that may run it.

Input groups are duck-typed (`node_names`, `graph_walks`, `replicas()`) so this module stays free
of the config package; errors name the group and the source file.

`node_names` entries are component names (every node of the component, in the group's walks) or,
when no component has that name, node names: a node entry places that one node and wins over its
component's entries. Guidance branches use this: the DiT's `cond` node on one rank, `uncond` on
another, with the graph unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mstar.graph.spec import ModelGraph, iter_nodes
from mstar.graph.validate import GraphError

Replica = tuple[int, ...]  # worker ranks running one copy of a component in lockstep (lead rank first)


class PlacementError(GraphError):
    """A placement cannot work; the message names the node group and the file."""


@dataclass(frozen=True)
class PlacementPlan:
    """(component, walk) -> replicas, node-level overrides, and which ranks build which components."""

    table: dict[tuple[str, str], tuple[Replica, ...]]
    num_workers: int
    nodes: dict[tuple[str, str], tuple[Replica, ...]] = field(default_factory=dict)  # (node, walk) overrides
    node_components: dict[tuple[str, str], str] = field(default_factory=dict)  # (node, walk) -> its component

    def replicas(self, component: str, walk: str) -> tuple[Replica, ...]:
        return self.table[(component, walk)]

    def node_replicas(self, component: str, node: str, walk: str) -> tuple[Replica, ...]:
        """Replicas that may run `node` (of `component`) in `walk`: its own placement, else its component's."""
        return self.nodes.get((node, walk)) or self.table[(component, walk)]

    def components_on(self, rank: int) -> list[str]:
        """Components a worker of this rank must build."""
        names = {c for (c, _), reps in self.table.items() for rep in reps if rank in rep}
        names |= {self.node_components[key] for key, reps in self.nodes.items() for rep in reps if rank in rep}
        return sorted(names)


def plan_placement(
    graph: ModelGraph, groups: Sequence[Any], source: str = "<config>", max_ranks: int | None = None
) -> PlacementPlan:
    """Check the groups against the graph and build the plan; no groups puts everything on rank 0."""
    walks = {w.name: w for w in graph.walks}
    node_components = {(n.name, w.name): n.component for w in graph.walks for n in iter_nodes(w.body)}
    node_names = {node for node, _ in node_components}
    table: dict[tuple[str, str], list[Replica]] = {}
    nodes: dict[tuple[str, str], list[Replica]] = {}
    placed_by: dict[tuple[str, str, Replica], int] = {}
    for i, group in enumerate(groups):
        where = f"{source}: node_groups[{i}]"
        _check_group(group, graph, walks, node_names, where, max_ranks)
        _check_parallel(group, graph, node_components, where)
        for walk in group.graph_walks or walks:
            for name in group.node_names:
                target = table if name in graph.components else nodes
                for rep in group.replicas():
                    if (name, walk, rep) in placed_by:  # a second identical replica on the same worker
                        raise PlacementError(
                            f"{where}: {name!r} is already on ranks {list(rep)} for walk {walk!r} "
                            f"(node_groups[{placed_by[name, walk, rep]}]); name it in one group only")
                    placed_by[name, walk, rep] = i
                    target.setdefault((name, walk), []).append(rep)
    used = {(n.name, n.component, w.name) for w in graph.walks for n in iter_nodes(w.body)}
    needed = {(component, walk) for _, component, walk in used}
    if not groups:
        table = {key: [(0,)] for key in needed}
    for node, component, walk in sorted(used):
        if (component, walk) not in table and (node, walk) not in nodes:
            raise PlacementError(
                f"{source}: component {component!r} (used by walk {walk!r}) is placed in no node group; "
                "add it to a group's node_names (and its graph_walks, if the group restricts walks)"
            )
    nodes = {k: v for k, v in nodes.items() if k in node_components}  # drop walks without that node
    table = {k: v for k, v in table.items() if k in needed}
    used = {r for reps in (*table.values(), *nodes.values()) for rep in reps for r in rep}
    _check_no_idle_ranks(groups, used, source)
    return PlacementPlan({k: tuple(v) for k, v in table.items()}, 1 + max(used),
                         {k: tuple(v) for k, v in nodes.items()},
                         {k: node_components[k] for k in nodes})


def _check_no_idle_ranks(groups: Sequence[Any], used: set[int], source: str) -> None:
    """Every rank from 0 to the highest one named runs a component: rank r is worker r (on GPU r modulo
    the GPUs), so a rank with none would be a worker process that loads nothing and serves nothing."""
    named = {r for group in groups for r in group.ranks}
    idle = sorted((named | set(range(max(used | named) + 1))) - used)
    if idle:
        raise PlacementError(
            f"{source}: ranks {idle} would run no component (components are on ranks {sorted(used)}): number "
            "the ranks from 0 with no gaps, each group's graph_walks using its components; to leave a GPU "
            "unused, pick the GPUs with --gpus or CUDA_VISIBLE_DEVICES")


def _check_group(group: Any, graph: ModelGraph, walks: dict, node_names: set[str], where: str,
                 max_ranks: int | None) -> None:
    for name in group.node_names:
        if name not in graph.components and name not in node_names:
            raise PlacementError(f"{where}: node_names has unknown component {name!r}; components are "
                                 f"{sorted(graph.components)} (or name a node: {sorted(node_names)})")
    for walk in group.graph_walks or ():
        if walk not in walks:
            raise PlacementError(f"{where}: graph_walks has unknown walk {walk!r}; walks are {sorted(walks)}")
    if max_ranks is not None:
        for rank in group.ranks:
            if rank >= max_ranks:
                raise PlacementError(f"{where}: rank {rank} is out of range: {max_ranks} device(s) available")


def _check_parallel(group: Any, graph: ModelGraph, node_components: dict[tuple[str, str], str], where: str) -> None:
    """tp_size > 1 only for components declaring tensor_parallel, sp_size > 1 only for those declaring
    sequence_parallel, and not both in one group."""
    if group.tp_size > 1 and group.sp_size > 1:
        raise PlacementError(f"{where}: tp_size={group.tp_size} with sp_size={group.sp_size}: a replica is "
                             "tensor- or sequence-parallel, not both, today")
    for size, key, flag, kind in ((group.tp_size, "tp_size", "tensor_parallel", "tensor"),
                                  (group.sp_size, "sp_size", "sequence_parallel", "sequence")):
        if size == 1:
            continue
        for name in group.node_names:
            components = {name} if name in graph.components else {c for (n, _), c in node_components.items() if n == name}
            for component in sorted(components):
                if not getattr(graph.components[component], flag):
                    supported = sorted(c for c, spec in graph.components.items() if getattr(spec, flag))
                    raise PlacementError(
                        f"{where}: {key}={size}, but component {component!r} does not support {kind} "
                        f"parallelism (components that do: {supported or 'none'}); move {name!r} to a group "
                        f"with {key}: 1"
                    )
