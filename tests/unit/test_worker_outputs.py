"""Client outputs leave a worker once per engine step, never after a later message to the conductor."""

from __future__ import annotations

import torch

from mstar.conductor.conductor import Conductor
from mstar.conductor.request_state import FinishEvent, OutputEvent
from mstar.graph import ComponentSpec, Emit, Lane, ModelGraph, Node, Walk
from mstar.graph.placement import plan_placement
from mstar.runtime.codecs import LocalCodec
from mstar.transport import wire
from mstar.transport.messages import Codec, discard_message
from mstar.transport.tensors import pack_tensor, unpack_tensor
from mstar.worker.outputs import BatchingOutbox


class Log:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def send(self, peer, msg) -> None:
        self.sent.append((peer, msg))


def _out(rid: str, i: int) -> wire.ClientOutput:
    return wire.ClientOutput(rid, "text", torch.tensor([i]))


def test_outputs_are_held_until_flush_or_the_next_conductor_message():
    log = Log()
    box = BatchingOutbox(log, "conductor")
    box.send("conductor", _out("a", 0))
    box.send("conductor", _out("b", 1))
    box.send("worker-1", wire.StreamItem("a", "s", 0, torch.tensor([0])))  # other peers pass at once
    assert [p for p, _ in log.sent] == ["worker-1"]
    box.send("conductor", _out("a", 2))
    box.send("conductor", wire.WalkDone("a", "decode", {}, {}))  # after the outputs, never before
    assert [type(m).__name__ for _, m in log.sent] == ["StreamItem", "ClientOutputs", "WalkDone"]
    assert [(o.rid, int(o.value)) for o in log.sent[1][1].outputs] == [("a", 0), ("b", 1), ("a", 2)]
    box.flush()  # nothing held: nothing sent
    box.send("conductor", _out("c", 3))
    box.flush()
    assert type(log.sent[-1][1]) is wire.ClientOutput and len(log.sent) == 4  # a lone output as itself


def test_a_batch_round_trips_the_wire_codec_and_the_conductor_numbers_each_output():
    codec = Codec(wire.Message)
    batch = wire.ClientOutputs([wire.ClientOutput("r", "text", pack_tensor(torch.tensor([5]))),
                                wire.ClientOutput("r", "audio", pack_tensor(torch.zeros(3)))])
    back = codec.decode(codec.encode(batch))
    assert [(o.rid, o.name, unpack_tensor(o.value).tolist()) for o in back.outputs] == [
        ("r", "text", [5]), ("r", "audio", [0.0, 0.0, 0.0])]
    assert discard_message(back) == 2  # both payloads found inside the batch
    graph = ModelGraph(components={"c": ComponentSpec("stateless", "a node")},
                       walks=(Walk("w", "l", Node("c", inputs=("x",), outputs=("y",)), inputs=("x",),
                                   emits=(Emit("y"),)),),
                       lanes=(Lane("l", "w", {"w": None}),))
    sent, events = [], []
    conductor = Conductor(graph, plan_placement(graph, []), lambda rank, msg: sent.append(msg), LocalCodec(), 4, 4)
    conductor.submit("r", {"x": torch.tensor([1])}, {}, events.append)
    rid = sent[0].rid
    conductor.handle(wire.ClientOutputs([wire.ClientOutput(rid, "y", torch.tensor([i])) for i in range(3)]
                                        + [wire.ClientOutput("gone#9", "y", torch.tensor([9]))]))
    conductor.handle(wire.WalkDone(rid, "w", {}, {}))
    assert [(e.seq, int(e.value)) for e in events if isinstance(e, OutputEvent)] == [(0, 0), (1, 1), (2, 2)]
    assert isinstance(events[-1], FinishEvent) and events[-1].outputs == {"y": 3}
