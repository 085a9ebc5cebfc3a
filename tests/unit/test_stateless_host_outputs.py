"""StatelessEngine with `host_outputs`: results whose host copies are still running come out later,
in submission order, and released requests never come out."""

from __future__ import annotations

import torch

import mstar.engines.stateless as stateless
from mstar.engines.base import StatelessBase, StatelessSpec, StepItem
from mstar.engines.stateless import StatelessEngine


class _Event:
    """A CUDA event stand-in the test completes by hand."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class _Doubler(StatelessBase, torch.nn.Module):
    host_outputs = True

    def run_batch(self, walk, node, inputs, options):
        return [{"y": x["x"] * 2} for x in inputs]


def _item(rid: str, value: float) -> StepItem:
    return StepItem(rid, "w", "n", {"x": torch.tensor([value])})


def test_results_wait_for_their_copies_and_keep_order(monkeypatch):
    events: list[_Event] = []

    def fake_copies(results):
        events.append(_Event())
        return events[-1]

    monkeypatch.setattr(stateless, "start_host_copies", fake_copies)
    engine = StatelessEngine(_Doubler(), StatelessSpec(max_batch_size=1))
    for rid, v in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        engine.submit(_item(rid, v))
    assert engine.step() == []  # a's copy still running
    assert engine.step() == []
    events[1].done = True  # b finished before a: still held back behind a
    assert engine.step() == []
    assert engine.has_work()
    events[0].done = events[2].done = True
    out = engine.step()
    assert [(r.request_id, float(r.outputs["y"])) for r in out] == [("a", 2.0), ("b", 4.0), ("c", 6.0)]
    assert not engine.has_work()


def test_release_drops_results_in_flight(monkeypatch):
    event = _Event()
    monkeypatch.setattr(stateless, "start_host_copies", lambda results: event)
    engine = StatelessEngine(_Doubler(), StatelessSpec(max_batch_size=2))
    engine.submit(_item("a", 1.0))
    engine.submit(_item("b", 2.0))
    assert engine.step() == []
    engine.release("a")
    event.done = True
    assert [r.request_id for r in engine.step()] == ["b"]


def test_host_outputs_are_handed_out_at_once_on_cpu():
    engine = StatelessEngine(_Doubler())
    engine.submit(_item("a", 1.5))
    assert [float(r.outputs["y"]) for r in engine.step()] == [3.0]
    assert not engine.has_work()


def test_side_stream_only_for_cuda_modules_that_declare_it():
    class Declares(_Doubler):
        host_inputs = True
        side_stream = True

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", torch.zeros(1))

    assert StatelessEngine(Declares()).stream is None  # on the CPU: nothing to overlap
    assert StatelessEngine(_Doubler()).stream is None


class _Planned(_Doubler):
    """A component with one fixed-shape function, on a device the test names (`_module_device` is faked)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device_name = device

    def capture_plans(self):
        from mstar.engines.base import CapturePlan

        return [CapturePlan("double", lambda x: x * 2, (((1,), torch.float32),))]


def test_engine_captures_the_plans_on_cuda_only_when_graphs_are_on(monkeypatch):
    """The engine captures a module's plans at its spec's sizes when made with cuda_graphs on a CUDA device;
    never on the CPU, nor with cuda_graphs off or not given."""
    from mstar.config import CudaGraphConfig

    captured: list[tuple[list[int], torch.device]] = []
    monkeypatch.setattr(stateless, "capture_step_graphs", lambda module, sizes, device: captured.append((sizes, device)))
    monkeypatch.setattr(stateless, "_module_device", lambda module: torch.device(module.device_name))
    StatelessEngine(_Planned("cuda"), StatelessSpec(max_batch_size=6), CudaGraphConfig())
    StatelessEngine(_Planned("cuda"), StatelessSpec(max_batch_size=6, cuda_graph_sizes=[3]), CudaGraphConfig())
    StatelessEngine(_Planned("cuda"), StatelessSpec(), CudaGraphConfig(enabled=False))
    StatelessEngine(_Planned("cuda"), StatelessSpec())
    StatelessEngine(_Planned("cpu"), StatelessSpec(), CudaGraphConfig())
    assert captured == [([1, 2, 4, 6], torch.device("cuda")), ([3], torch.device("cuda"))]


def test_replay_falls_back_past_the_largest_size():
    """`StepGraphs.replay` answers None (run eagerly) for an unknown key or a batch above the largest size."""
    from mstar.engines.base import StepGraphs

    class Graphs:  # BatchGraphs' interface: max_batch and a call
        max_batch = 2

        def __call__(self, x):
            return (x + 1,)

    graphs = StepGraphs({"k": Graphs()})
    assert graphs.replay("other", torch.zeros(1)) is None
    assert graphs.replay("k", torch.zeros(3)) is None
    assert torch.equal(graphs.replay("k", torch.zeros(2))[0], torch.ones(2))
    assert not StepGraphs() and graphs.keys() == ["k"]
