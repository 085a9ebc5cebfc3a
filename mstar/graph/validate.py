"""Validation of a ModelGraph. Every error names the walk, node and edge at fault."""

from __future__ import annotations

from mstar.graph.spec import Loop, ModelGraph, Node, Parallel, Section, Sequential, Walk, iter_nodes


class GraphError(ValueError):
    """A model graph is invalid; the message says where and why."""


def validate_graph(graph: ModelGraph) -> None:
    """Raise GraphError on the first problem found; return None for a valid graph."""
    lanes = {lane.name: lane for lane in graph.lanes}
    walk_names = [w.name for w in graph.walks]
    if len(set(walk_names)) != len(walk_names):
        raise GraphError(f"walk names must be unique, got {walk_names}")
    for walk in graph.walks:
        if walk.lane not in lanes:
            raise GraphError(f"walk {walk.name!r}: lane {walk.lane!r} is not declared; lanes are {sorted(lanes)}")
        _check_walk(graph, walk)
    for lane in graph.lanes:
        targets = [] if callable(lane.transitions) else [t for t in lane.transitions.values() if t]
        if isinstance(lane.first, str):
            targets.append(lane.first)
        for target in targets:
            if target not in walk_names:
                raise GraphError(f"lane {lane.name!r}: transition to unknown walk {target!r}; walks are {walk_names}")
    _check_streams(graph)


def _check_walk(graph: ModelGraph, walk: Walk) -> None:
    names = [n.name for n in iter_nodes(walk.body)]
    for dup in {n for n in names if names.count(n) > 1}:
        raise GraphError(f"walk {walk.name!r}: node name {dup!r} is used twice; give one of them name=...")
    for node in iter_nodes(walk.body):
        if node.component not in graph.components:
            raise GraphError(
                f"walk {walk.name!r}, node {node.name!r}: unknown component {node.component!r}; "
                f"components are {sorted(graph.components)}"
            )
    checker = _WalkChecker(walk)
    checker.section(walk.body, set(walk.inputs) | set(walk.optional_inputs), ())
    streamed = {s.edge for s in graph.streams if s.source_lane == walk.lane}
    consumed = checker.consumed | streamed | {e.edge for e in walk.emits}
    for node_name, edge in checker.produced:
        if edge not in consumed:
            raise GraphError(
                f"walk {walk.name!r}, node {node_name!r}: output edge {edge!r} is consumed by no node, "
                "emit or stream; consume it or drop the output"
            )
    known = checker.all_edges | set(walk.inputs) | set(walk.optional_inputs)
    for emit in walk.emits:
        if emit.edge not in known:
            raise GraphError(f"walk {walk.name!r}: emit of edge {emit.edge!r} ({emit.to}) but no node produces it")


class _WalkChecker:
    """Walks a section in program order tracking which edges are available."""

    def __init__(self, walk: Walk) -> None:
        self.walk = walk
        self.produced: list[tuple[str, str]] = []
        self.consumed: set[str] = set()
        self.all_edges = {e for n in iter_nodes(walk.body) for e in n.output_edges}

    def section(self, sec: Section, available: set[str], loops: tuple[Loop, ...]) -> set[str]:
        if isinstance(sec, Node):
            return self.node(sec, available, loops)
        if isinstance(sec, Sequential):
            for member in sec.members:
                available = available | self.section(member, available, loops)
            return available
        if isinstance(sec, Parallel):
            out = set(available)
            for member in sec.members:
                out |= self.section(member, available, loops)
            return out
        if isinstance(sec, Loop):
            return self.loop(sec, available, loops)
        raise GraphError(f"walk {self.walk.name!r}: {sec!r} is not a Node, Sequential, Parallel or Loop")

    def loop(self, loop: Loop, available: set[str], loops: tuple[Loop, ...]) -> set[str]:
        mi = loop.max_iterations
        if isinstance(mi, int) and mi < 1:
            raise GraphError(f"walk {self.walk.name!r}, loop {loop.name!r}: max_iterations must be >= 1, got {mi}")
        out = self.section(loop.body, available, loops + (loop,))
        body_edges = {e for n in iter_nodes(loop.body) for e in n.output_edges}
        for edge in loop.accumulate:
            if edge not in body_edges:
                raise GraphError(
                    f"walk {self.walk.name!r}, loop {loop.name!r}: accumulated edge {edge!r} is not produced in the loop"
                )
        return out

    def node(self, node: Node, available: set[str], loops: tuple[Loop, ...]) -> set[str]:
        for edge in node.input_edges:
            if edge not in available:
                raise GraphError(self._missing(node, edge, loops))
            self.consumed.add(edge)
        for edge in node.output_edges:
            self.produced.append((node.name, edge))
        return available | set(node.output_edges)

    def _missing(self, node: Node, edge: str, loops: tuple[Loop, ...]) -> str:
        where = f"walk {self.walk.name!r}, node {node.name!r}: input edge {edge!r}"
        for loop in reversed(loops):
            if any(edge in n.output_edges for n in iter_nodes(loop.body)):
                return f"{where} is a loop-back edge of loop {loop.name!r} with no initial value before the loop"
        producers = [n.name for n in iter_nodes(self.walk.body) if edge in n.output_edges]
        if producers:
            return f"{where} comes from later node {producers[0]!r}: a loop-back edge outside a loop"
        return f"{where} is produced by no node and is not a walk input (inputs: {list(self.walk.inputs)})"


def _check_streams(graph: ModelGraph) -> None:
    walks = {w.name: w for w in graph.walks}
    for s in graph.streams:
        where = f"stream of edge {s.edge!r} from lane {s.source_lane!r} to walk {s.target_walk!r}"
        if s.target_walk not in walks:
            raise GraphError(f"{where}: unknown target walk")
        target = walks[s.target_walk]
        if target.lane == s.source_lane:
            raise GraphError(f"{where}: a stream between nodes of the same lane ({s.source_lane!r}); use a plain edge")
        if s.target_input not in target.inputs:
            raise GraphError(f"{where}: target input {s.target_input!r} is not an input of walk {target.name!r}")
        producers = [
            n.name for w in graph.walks if w.lane == s.source_lane for n in iter_nodes(w.body) if s.edge in n.output_edges
        ]
        if not producers:
            raise GraphError(f"{where}: no walk of lane {s.source_lane!r} produces edge {s.edge!r}")
