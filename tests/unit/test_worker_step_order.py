"""The worker steps its engines in the graph's data-flow order (`ModelGraph.step_order`): a loop whose body
spans three components on one worker advances one iteration per pass over the engines, whatever the
components' names. (By name, Qwen3-Omni's talk loop talker_input -> talker -> code_predictor ran against
its flow and took two passes a frame, each also paying a thinker step.)"""

from __future__ import annotations

import torch

from mstar.conductor.conductor import Conductor
from mstar.conductor.request_state import FinishEvent
from mstar.config import NodeGroup
from mstar.engines.base import StatelessBase
from mstar.engines.stateless import StatelessEngine
from mstar.graph import ComponentSpec, Emit, Lane, Loop, ModelGraph, Node, Sequential, Walk
from mstar.graph.placement import plan_placement
from mstar.models.qwen3_omni.model import OmniServeConfig, omni_graph
from mstar.runtime.codecs import LocalCodec
from mstar.transport import wire
from mstar.transport.channels import make_network
from mstar.transport.messages import Codec
from mstar.worker.worker import CONDUCTOR, Worker, worker_peer

FLOW = ("zeta", "mid", "alpha")  # the loop body's order: by name it is the reverse


class AddOne(StatelessBase, torch.nn.Module):
    def run_batch(self, walk, node, inputs, options):
        return [{"x": x["x"] + 1} for x in inputs]


def _graph() -> ModelGraph:
    body = Sequential(*(Node(c, inputs=("x",), outputs=("x",)) for c in FLOW))
    return ModelGraph(components={c: ComponentSpec("stateless", "adds one") for c in FLOW},
                      walks=(Walk("spin", "main", Loop(body, max_iterations="max_tokens", name="spin"),
                                  inputs=("x",), emits=(Emit("x"),)),),
                      lanes=(Lane("main", "spin", {"spin": None}),))


def _passes(iterations: int) -> tuple[int, list[int]]:
    """Passes over the worker's engines until a request of `iterations` loop iterations finishes; its values."""
    graph = _graph()
    plan = plan_placement(graph, [NodeGroup(list(FLOW), [0])])
    network = make_network("inproc", Codec(wire.Message))
    inbox, outbox, codec = network.inbox(CONDUCTOR), network.outbox(), LocalCodec()
    conductor = Conductor(graph, plan, lambda rank, msg: outbox.send(worker_peer(rank), msg), codec, 4, 64)
    worker = Worker(0, graph, {c: StatelessEngine(AddOne()) for c in plan.components_on(0)},
                    network.inbox(worker_peer(0)), network.outbox(), codec, torch.device("cpu"))
    assert list(worker.engines) == list(FLOW)
    values, done = [], []

    def sink(event) -> None:
        if isinstance(event, FinishEvent):
            done.append(event)
        else:
            values.append(int(event.value.reshape(-1)[0]))

    conductor.submit("r", {"x": torch.tensor([0])}, {"max_tokens": iterations}, sink)
    passes = 0
    while not done:
        assert passes < 10 * iterations, "the request did not finish"
        worker.receive(0.0)
        worker.execute()
        passes += 1
        while (msg := inbox.recv(0.0)) is not None:
            conductor.handle(msg)
    return passes, values


def test_a_three_component_loop_makes_one_iteration_per_pass():
    passes, values = _passes(20)
    assert values[-1] == 3 * 20  # every iteration ran all three components once
    assert passes <= 20 + 2, passes  # against the flow it took about 3 passes an iteration


def test_step_order_follows_the_walks():
    assert _graph().step_order() == list(FLOW)
    order = omni_graph(OmniServeConfig()).step_order()
    assert order.index("talker_input") < order.index("talker") < order.index("code_predictor")
    assert sorted(order) == sorted(omni_graph(OmniServeConfig()).components)
