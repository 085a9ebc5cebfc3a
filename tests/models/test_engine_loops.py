"""Engine loops with the real engines: tiny Orpheus (LM -> vocoder stream, audio out) and tiny Llama
(tokens to the client), conductor and worker pumped from one thread so that both runs see the same
steps: the decode loop run by the engine and the same loop run iteration by iteration by the walk
interpreter (its node wrapped in a Sequential) give the same events in the same order, bit for bit,
and the same cancellation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mstar.conductor.conductor import Conductor
from mstar.conductor.request_state import FinishEvent
from mstar.config import config_from_dict
from mstar.graph import Loop, ModelGraph, Node, Sequential
from mstar.graph.placement import plan_placement
from mstar.runtime.build import build_engines, build_model
from mstar.runtime.codecs import LocalCodec
from mstar.transport import wire
from mstar.transport.channels import make_network
from mstar.transport.messages import Codec
from mstar.worker.worker import CONDUCTOR, Worker, worker_peer

KV = {"max_num_pages": 256, "page_size": 16}
CASES = {
    "orpheus": [("a", "Hello there.", {"max_tokens": 120, "seed": 1}),
                ("b", "Speak to me.", {"max_tokens": 90, "seed": 2, "voice": "leah"}),
                ("c", "Greedy now.", {"max_tokens": 60, "temperature": 0.0}),
                ("cancelled", "Never mind.", {"max_tokens": 200, "seed": 3})],
    "llama": [("a", "Hello, how are you today?", {"max_tokens": 30, "temperature": 0.0, "ignore_eos": True}),
              ("b", "The capital of France is", {"max_tokens": 25, "seed": 5, "temperature": 1.0}),
              ("c", "1 2 3 4 5", {"max_tokens": 40, "temperature": 0.0}),  # may meet eos: a stop
              ("cancelled", "Rome", {"max_tokens": 200, "temperature": 0.0, "ignore_eos": True})],
}


def without_engine_loops(graph: ModelGraph) -> ModelGraph:
    """`graph` with each walk's one-node loop body wrapped in a Sequential: no engine loops left."""
    walks = tuple(replace(w, body=replace(w.body, body=Sequential(w.body.body)))
                  if isinstance(w.body, Loop) and isinstance(w.body.body, Node) else w for w in graph.walks)
    return replace(graph, walks=walks)


def run_tiny(model_name: str, engine_loops: bool, device: str = "cpu", model_kwargs: dict | None = None) -> list[tuple]:
    """Every client event of the CASES of `model_name` (tiny), in the order the sinks saw them."""
    config = config_from_dict({"model": model_name, "device": device, "kv_cache": KV, "max_concurrent_requests": 8,
                               "model_kwargs": model_kwargs or {}})
    model = build_model(config, tiny=True)
    graph = model.graph() if engine_loops else without_engine_loops(model.graph())
    plan = plan_placement(graph, config.node_groups, config.source)
    network = make_network("inproc", Codec(wire.Message))
    inbox, outbox, codec = network.inbox(CONDUCTOR), network.outbox(), LocalCodec()
    conductor = Conductor(graph, plan, lambda rank, msg: outbox.send(worker_peer(rank), msg), codec, 8, 8)
    torch.manual_seed(0)
    engines = build_engines(model, config, plan.components_on(0), torch.device(device))
    worker = Worker(0, graph, engines, network.inbox(worker_peer(0)), network.outbox(), codec, torch.device(device))
    processor, events, finished = model.processor(), [], set()

    def sink(event) -> None:
        if isinstance(event, FinishEvent):
            finished.add(event.rid)
            events.append((event.rid, "finish", event.finish_reason, event.error, sorted(event.outputs.items())))
        else:
            events.append((event.rid, event.name, event.seq, event.value.tolist()))

    for rid, text, opts in CASES[model_name]:
        conductor.submit(rid, processor.inputs({"text": text}, model.request_options(opts)),
                         model.request_options(opts), sink)
    for step in range(3000):
        if len(finished) == len(CASES[model_name]):
            break
        if step == 25:
            assert conductor.cancel("cancelled")
        worker.receive(0.0)
        worker.execute()
        while (msg := inbox.recv(0.0)) is not None:
            conductor.handle(msg)
    else:
        raise AssertionError(f"{model_name}: requests did not finish")
    worker.receive(0.0)  # the Release messages
    assert worker.state_size() == 0 and not any(worker._pending.values())
    return events


@pytest.mark.parametrize("model_name", sorted(CASES))
def test_engine_loops_give_the_same_events_as_the_generic_route(model_name):
    engine, generic = run_tiny(model_name, True), run_tiny(model_name, False)
    assert engine == generic
    finish = {e[0]: e[2] for e in engine if e[1] == "finish"}
    assert finish["cancelled"] == "cancelled" and finish["a"] in ("length", "stop")
    output = "audio" if model_name == "orpheus" else "text"
    assert sum(e[1] == output for e in engine) > (20 if model_name == "orpheus" else 60)
