"""Declarative graph specs (runtime-free): nodes, edges, primitives, walks, lanes, validation."""

from mstar.graph.chunking import ChunkPolicy, Fixed, LeftContext, SlidingWindow
from mstar.graph.spec import (
    CARRY,
    FED_PORT,
    SAMPLED_PORT,
    TO_CLIENT,
    ComponentSpec,
    Emit,
    Lane,
    Loop,
    ModelGraph,
    Node,
    Parallel,
    Section,
    Sequential,
    StreamEdge,
    Walk,
    iter_loops,
    iter_nodes,
)
from mstar.graph.validate import GraphError, validate_graph

__all__ = [
    "CARRY", "FED_PORT", "SAMPLED_PORT", "TO_CLIENT", "ChunkPolicy", "ComponentSpec", "Emit", "Fixed", "GraphError", "Lane",
    "LeftContext", "Loop", "ModelGraph", "Node", "Parallel", "Section", "Sequential", "SlidingWindow",
    "StreamEdge", "Walk", "iter_loops", "iter_nodes", "validate_graph",
]
