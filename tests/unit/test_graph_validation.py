"""Invalid graphs give errors that name the walk, node and edge at fault."""

import pytest

from mstar.graph import (
    CARRY,
    ComponentSpec,
    Emit,
    GraphError,
    Lane,
    Loop,
    ModelGraph,
    Node,
    Parallel,
    Sequential,
    SlidingWindow,
    StreamEdge,
    Walk,
    validate_graph,
)

COMPONENTS = {"a": ComponentSpec("stateless"), "b": ComponentSpec("stateless")}


def graph(*walks, streams=(), lanes=None):
    lanes = lanes or tuple(Lane(name, None) for name in sorted({w.lane for w in walks}))
    return ModelGraph(COMPONENTS, walks, lanes, streams)


def test_valid_graph_with_every_primitive_passes():
    body = Loop(Sequential(Parallel(Node("a", ("x",), ("y",)), Node("b", ("x",), ("z",))),
                           Node("a", ("y", "z"), ("x",), name="combine")), max_iterations=4)
    validate_graph(graph(Walk("w", "l", body, inputs=("x",), emits=(Emit("x"),))))


def test_unknown_component_names_walk_and_node():
    with pytest.raises(GraphError, match=r"walk 'w', node 'c': unknown component 'c'.*components are \['a', 'b'\]"):
        validate_graph(graph(Walk("w", "l", Node("c", ("x",), ("y",)), inputs=("x",), emits=(Emit("y"),))))


def test_input_nobody_produces():
    with pytest.raises(GraphError, match=r"walk 'w', node 'a': input edge 'q' is produced by no node"):
        validate_graph(graph(Walk("w", "l", Node("a", ("q",), ("y",)), emits=(Emit("y"),))))


def test_output_nobody_consumes():
    with pytest.raises(GraphError, match=r"walk 'w', node 'a': output edge 'y' is consumed by no node"):
        validate_graph(graph(Walk("w", "l", Node("a", ("x",), ("y",)), inputs=("x",))))


def test_loop_back_edge_outside_a_loop():
    body = Sequential(Node("a", ("y",), ("z",)), Node("b", ("z",), ("y",)))
    with pytest.raises(GraphError, match=r"node 'a': input edge 'y' comes from later node 'b': a loop-back edge outside a loop"):
        validate_graph(graph(Walk("w", "l", body, emits=(Emit("z"), Emit("y")))))


def test_loop_back_edge_without_initial_value():
    body = Loop(Sequential(Node("a", ("y",), ("z",)), Node("b", ("z",), ("y",))), max_iterations=3, name="dec")
    with pytest.raises(GraphError, match=r"loop-back edge of loop 'dec' with no initial value"):
        validate_graph(graph(Walk("w", "l", body, emits=(Emit("y"),))))


def test_stream_between_nodes_of_the_same_lane():
    w1 = Walk("w1", "l", Node("a", ("x",), ("y",)), inputs=("x",))
    w2 = Walk("w2", "l", Node("b", ("s",), ("z",)), inputs=("s",), emits=(Emit("z"),))
    with pytest.raises(GraphError, match=r"a stream between nodes of the same lane \('l'\)"):
        validate_graph(graph(w1, w2, streams=(StreamEdge("y", "l", "w2", "s", SlidingWindow(4, 2)),)))


def test_duplicate_node_names_and_unknown_transition():
    body = Sequential(Node("a", ("x",), ("y",)), Node("a", ("y",), ("z",)))
    with pytest.raises(GraphError, match=r"node name 'a' is used twice"):
        validate_graph(graph(Walk("w", "l", body, inputs=("x",), emits=(Emit("z"),))))
    w = Walk("w", "l", Node("a", ("x",), ("y",)), inputs=("x",), emits=(Emit("y", CARRY),))
    with pytest.raises(GraphError, match=r"lane 'l': transition to unknown walk 'nope'"):
        validate_graph(graph(w, lanes=(Lane("l", "w", {"w": "nope"}),)))


def test_accumulated_edge_must_come_from_the_loop():
    body = Loop(Node("a", ("x",), ("x",)), max_iterations=2, accumulate=("q",), name="L")
    with pytest.raises(GraphError, match=r"loop 'L': accumulated edge 'q' is not produced in the loop"):
        validate_graph(graph(Walk("w", "l", body, inputs=("x",), emits=(Emit("x"),))))


def test_toy_graph_is_valid():
    from mstar.models.toy.model import ToyModel

    validate_graph(ToyModel(ToyModel.make_config()).graph())
