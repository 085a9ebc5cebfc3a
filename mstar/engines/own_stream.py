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

Everything else (has_work, release, stats, attributes) goes to the wrapped engine. Off CUDA the engine
is not wrapped (`own_stream_engine`).
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.engines.base import Engine, StepItem, StepResult


class OwnStreamEngine:
    """`engine` with every step on `stream` (see the module doc)."""

    def __init__(self, engine: Engine, device: torch.device) -> None:
        self.engine = engine
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def __getattr__(self, name: str) -> Any:  # last_step_items, stats, module, ...
        return getattr(self.engine, name)

    def submit(self, item: StepItem) -> None:
        for value in item.inputs.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(self.stream)
        self.engine.submit(item)

    def step(self) -> list[StepResult]:
        worker_stream = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(worker_stream)
        with torch.cuda.stream(self.stream):
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


def own_stream_engine(engine: Engine, device: torch.device) -> Engine:
    """`engine` on a stream of its own on a CUDA device; unchanged elsewhere."""
    return OwnStreamEngine(engine, device) if device.type == "cuda" else engine
