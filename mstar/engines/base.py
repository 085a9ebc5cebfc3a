"""The seam between a worker and the engines that run its components.

A worker hands an engine one `StepItem` per (request, node) whose inputs are ready; the engine
batches pending items across requests as it sees fit and returns one `StepResult` per item it
finished in that step. Items it did not finish stay pending inside the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class StepItem:
    """One node of one request, ready to run."""

    request_id: str  # the request this work belongs to
    walk: str  # the walk the node sits in (a component may behave per walk)
    node: str  # the node's name inside the walk
    inputs: dict[str, torch.Tensor]  # component input port -> tensor, already on the engine's device
    options: dict[str, Any] = field(default_factory=dict)  # per-request model options (sampling, ...)
    iteration: int = 0  # loop iteration the item belongs to (0 outside loops)


@dataclass
class StepResult:
    """What one item produced."""

    request_id: str
    walk: str
    node: str
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # component output port -> tensor
    stop: bool = False  # ask the enclosing Loop to end after this iteration
    error: str | None = None  # set when this item failed; the request fails alone
    iteration: int = 0


class Engine(Protocol):
    """Runs one component for many requests.

    Contract: `submit` never blocks and never runs the model; `step` runs at most one batched
    execution and returns results for the items it finished (possibly none, possibly items
    submitted in earlier calls); `release` drops every trace of a request (cache pages, pending
    items) and is safe to call for unknown requests.
    """

    def submit(self, item: StepItem) -> None: ...

    def step(self) -> list[StepResult]: ...

    def has_work(self) -> bool: ...

    def release(self, request_id: str) -> None: ...
