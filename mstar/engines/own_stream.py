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

The rest of the `Engine` contract (has_work, release, stats, last_step_items) is the wrapped engine's;
anything else is reached through `engine`. Off CUDA the engine is not wrapped (`on_own_stream`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mstar.engines.base import Engine, StepItem, StepResult
from mstar.kernels.scratch import scratch_owner


class OwnStreamEngine:
    """`engine` with every step on `stream` (see the module doc); build it with `on_own_stream`."""

    def __init__(self, engine: Engine, device: torch.device, stream: Any) -> None:
        self.engine, self.device, self.stream = engine, device, stream
        self.host_inputs = engine.host_inputs

    @property
    def last_step_items(self) -> int:
        return self.engine.last_step_items

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

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
