"""BatchGraphs.__call__ (CPU stand-in for the captured graph): inputs captured under inference mode take a
batch from a caller under no_grad, as stateless components call it (the code predictor, Code2Wav)."""

from __future__ import annotations

import torch

from mstar.engines.cuda_graphs import BatchGraphs, _Captured


class _Graph:
    """Stands in for a captured CUDA graph: replay doubles the static input into the static output."""

    def __init__(self, static_in: torch.Tensor, static_out: torch.Tensor) -> None:
        self.static_in, self.static_out, self.replays = static_in, static_out, 0

    def replay(self) -> None:
        self.replays += 1
        self.static_out.copy_(self.static_in * 2)


def test_inference_mode_inputs_take_a_no_grad_batch() -> None:
    graphs = object.__new__(BatchGraphs)
    with torch.inference_mode():  # as the stateless engine captures them
        static_in, static_out = torch.zeros(4, 3), torch.zeros(4, 3)
    graph = _Graph(static_in, static_out)
    graphs.sizes, graphs._graphs = [4], {4: _Captured(graph, [static_in], (static_out,))}  # noqa: SLF001
    with torch.no_grad():
        (out,) = graphs(torch.ones(2, 3))
    assert graph.replays == 1 and out.shape == (2, 3) and torch.equal(out, torch.full((2, 3), 2.0))


def test_shared_static_inputs_are_not_copied() -> None:
    """An input that is the first rows of its shared static input is already in place: the replay reads
    what the caller wrote there; another tensor is copied in as before."""
    import pytest

    from mstar.engines.cuda_graphs import _check_shared

    shared = torch.zeros(8, 3)
    graphs = object.__new__(BatchGraphs)
    graph = _Graph(shared[:4], torch.zeros(4, 3))
    graphs.sizes, graphs._graphs = [4], {4: _Captured(graph, [shared[:4]], (graph.static_out,))}  # noqa: SLF001
    shared[:2] = 5.0  # the caller's own packed copy
    (out,) = graphs(shared[:2])
    assert torch.equal(out, torch.full((2, 3), 10.0))
    (out,) = graphs(torch.ones(3, 3))
    assert torch.equal(out, torch.full((3, 3), 2.0)) and torch.equal(shared[:3], torch.ones(3, 3))
    example = [((3,), torch.float32)]
    assert _check_shared(None, example, 4, torch.device("cpu")) == [None]
    assert _check_shared([shared], example, 8, torch.device("cpu"))[0] is shared
    for bad, rows in ((shared, 9), (shared[:, :2], 4), (shared.long(), 4), (shared.t(), 3)):
        with pytest.raises(ValueError, match="static input"):
            _check_shared([bad], example, rows, torch.device("cpu"))
