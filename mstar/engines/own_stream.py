"""An engine stepped on a CUDA stream of its own, beside the worker's other engines.

A worker steps its engines one after another from one thread, and on one stream their kernels run one
after another too. A component that declares `own_stream` (engine option; Qwen3-Omni's thinker) gets
a stream of its own: its queued work (a decode forward launched ahead, `lookahead.py`) then runs while
the worker steps the others (the talk loop), instead of in front of them.

Ordering, in both directions:
- into the engine: each step first makes its stream wait for all work queued so far on the worker's
  stream (the producers of its inputs, the host copies `submit` queued), and every CUDA input is
  recorded as used on its stream, so the caching allocator does not hand its block out while the
  engine may still read it;
- out of it: a step returns results only after the host has waited for them (the engine's host sync
  on its sampled ids, which follows every output it returns), so kernels the worker launches later on
  any stream see them; each CUDA output is recorded as used on the worker's stream, so its block is
  not reused on this stream while a consumer there may still read it.

Memory that kernels keep between launches is not shared with the other engines, whose kernels now run
at the same time: the engine is built (its graphs captured, its kernels warmed up and timed) and
stepped inside `scratch_owner(stream)` (`kernels/scratch.py`), so its split-K workspaces and tile
counters are its own, and its CUDA graphs are captured on its stream, not on the capture stream the
other engines' graphs share (`BatchGraphs`: cuBLAS workspaces are kept per stream).

Everything else (has_work, release, stats, attributes, also set ones) goes to the wrapped engine. Off
CUDA the engine is not wrapped (`on_own_stream`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mstar.engines.base import Engine, StepItem, StepResult
from mstar.kernels.scratch import scratch_owner


class OwnStreamEngine:
    """`engine` with every step on `stream` (see the module doc); build it with `on_own_stream`."""

    _OWN = ("engine", "device", "stream")  # attributes of the wrapper; any other is the engine's

    def __init__(self, engine: Engine, device: torch.device, stream: Any) -> None:
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "stream", stream)

    def __getattr__(self, name: str) -> Any:  # last_step_items, stats, module, ...
        return getattr(self.engine, name)

    def __setattr__(self, name: str, value: Any) -> None:  # e.g. seed_per_request (runtime/replicas.py)
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.engine, name, value)

    def submit(self, item: StepItem) -> None:
        for value in item.inputs.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(self.stream)
        self.engine.submit(item)

    def step(self) -> list[StepResult]:
        worker_stream = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(worker_stream)
        with torch.cuda.stream(self.stream), scratch_owner(self.stream):
            results = self.engine.step()
        for result in results:
            for value in result.outputs.values():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(worker_stream)
        return results

    def has_work(self) -> bool:
        return self.engine.has_work()

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)


def on_own_stream(make: Callable[[], Engine], device: torch.device) -> Engine:
    """The engine `make()` builds, on a stream of its own on a CUDA device (built inside its scratch
    scope: module doc); elsewhere `make()` as it is."""
    if device.type != "cuda":
        return make()
    stream = torch.cuda.Stream(device)
    with scratch_owner(stream):
        engine = make()
    return OwnStreamEngine(engine, device, stream)  # type: ignore[return-value]
