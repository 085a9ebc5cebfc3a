"""The conductor names where a prefilled sequence streams (`StartWalk.kv_targets`) when the prefill walk
starts: the decode walk's replica is chosen then, and is released with the request even if decode never runs."""

from __future__ import annotations

import pytest

from mstar.conductor.conductor import Conductor
from mstar.config import NodeGroup
from mstar.graph import ComponentSpec, Emit, Lane, Loop, ModelGraph, Node, Sequential, Walk
from mstar.graph.placement import plan_placement
from mstar.runtime.codecs import LocalCodec
from mstar.transport import wire

GRAPH = ModelGraph(
    components={"llm": ComponentSpec("autoregressive", "a language model", tensor_parallel=True)},
    walks=(Walk("prefill", "text", Node("llm", inputs=("x",), outputs=("y",)), inputs=("x",), emits=(Emit("y"),)),
           Walk("decode", "text", Node("llm", inputs=("x",), outputs=("y",)), inputs=("x",), emits=(Emit("y"),))),
    lanes=(Lane("text", "prefill", {"prefill": "decode", "decode": None}),),
)


def _conductor(groups: list[NodeGroup], graph: ModelGraph = GRAPH) -> tuple[Conductor, list[tuple[int, object]]]:
    sent: list[tuple[int, object]] = []
    conductor = Conductor(graph, plan_placement(graph, groups), lambda rank, msg: sent.append((rank, msg)),
                          LocalCodec(), 4, 4)
    conductor.submit("r", {"x": 1}, {}, lambda event: None)
    return conductor, sent


def _starts(sent) -> list[tuple[int, str, dict]]:
    return [(rank, m.walk, m.kv_targets) for rank, m in sent if isinstance(m, wire.StartWalk)]


def test_prefill_start_names_the_decode_rank_and_decode_runs_there():
    conductor, sent = _conductor([NodeGroup(["llm"], [0], ["prefill"]), NodeGroup(["llm"], [1, 2], ["decode"])])
    ((rank, walk, targets),) = _starts(sent)
    assert (rank, walk) == (0, "prefill") and targets in ({"llm": 1}, {"llm": 2})
    conductor.handle(wire.WalkDone("r#1", "prefill", {}, {}))
    assert _starts(sent)[1] == (targets["llm"], "decode", {})  # the reserved replica, nothing moves on


def test_the_reserved_decode_rank_dying_during_prefill_fails_the_request_and_releases_the_prefill_worker():
    # the prefill worker's sequence waits for that rank's KVAccept: the release is what frees it
    events = []
    conductor, sent = _conductor([NodeGroup(["llm"], [0], ["prefill"]), NodeGroup(["llm"], [1], ["decode"])])
    conductor.submit("s", {"x": 1}, {}, events.append)
    assert [t for _, _, t in _starts(sent)] == [{"llm": 1}, {"llm": 1}]
    conductor.worker_died(1, "killed")
    assert [rank for rank, m in sent if isinstance(m, wire.Release)] == [0, 0]  # r and s; none to the dead rank
    (event,) = events
    assert event.finish_reason == "error" and "worker 1 died" in event.error


def test_a_request_that_ends_after_prefill_releases_the_reserved_decode_rank():
    conductor, sent = _conductor([NodeGroup(["llm"], [0], ["prefill"]), NodeGroup(["llm"], [1], ["decode"])])
    conductor.handle(wire.WalkDone("r#1", "prefill", {}, {}, stopped=True))
    assert sorted(rank for rank, m in sent if isinstance(m, wire.Release)) == [0, 1]


@pytest.mark.parametrize("groups", [
    [NodeGroup(["llm"], [0])],  # colocated: the sequence stays
    [NodeGroup(["llm"], [0], ["prefill"]), NodeGroup(["llm"], [1, 2], ["decode"], tp_size=2)],  # shards recompute
])
def test_nothing_streams_where_the_sequence_stays_or_cannot_move(groups):
    _, sent = _conductor(groups)
    assert _starts(sent) == [(0, "prefill", {})]


def _two_walks(prefill_body) -> ModelGraph:
    return ModelGraph(
        components={"llm": ComponentSpec("autoregressive", "a language model")},
        walks=(Walk("prefill", "text", prefill_body, inputs=("x",), emits=(Emit("y"),)),
               Walk("decode", "text", Node("llm", inputs=("x",), outputs=("y",)), inputs=("x",), emits=(Emit("y"),))),
        lanes=(Lane("text", "prefill", {"prefill": "decode", "decode": None}),),
    )


@pytest.mark.parametrize("body", [
    # the sender forgets a streamed sequence when its item ends: a walk that submits the component more than
    # one item (here two nodes, or a loop run iteration by iteration) would lose it after the first
    Sequential(Node("llm", inputs=("x",), outputs=("y",)), Node("llm", name="again", inputs=("y",), outputs=("z",))),
    Loop(Node("llm", inputs=("x",), outputs=("y",)), max_iterations=2),
])
def test_nothing_streams_from_a_walk_that_gives_the_component_several_items(body):
    graph = _two_walks(body)
    _, sent = _conductor([NodeGroup(["llm"], [0], ["prefill"]), NodeGroup(["llm"], [1], ["decode"])], graph)
    assert _starts(sent) == [(0, "prefill", {})]


def test_an_engine_loop_is_one_item_and_streams():
    loop = Loop(Node("llm", inputs={"input_ids": "x"}, outputs={"token": "x"}), max_iterations=2)
    graph = _two_walks(loop)
    assert graph.engine_loop(graph.walks[0], loop) is not None
    _, sent = _conductor([NodeGroup(["llm"], [0], ["prefill"]), NodeGroup(["llm"], [1], ["decode"])], graph)
    assert _starts(sent) == [(0, "prefill", {"llm": 1})]
