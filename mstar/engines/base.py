"""The seam between a worker and the engines that run its components.

A worker hands an engine one `StepItem` per (request, node) whose inputs are ready; the engine
batches pending items across requests as it sees fit and returns one `StepResult` per item it
finished in that step. Items it did not finish stay pending inside the engine.

An item of an engine loop (`StepItem.loop`, see `ModelGraph.engine_loop`) is the whole loop: the
engine runs its iterations itself, each fed the token the last one sampled, and returns one result
per iteration; all but the last have `more=True`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class LoopSpec:
    """An engine loop handed to its engine as one item: at most `max_iterations` (>= 1) iterations, the
    first fed the item's inputs, each later one the token the one before sampled (ports
    `graph.SAMPLED_PORT` -> `graph.FED_PORT`); the item's other inputs are read once, at the first."""

    max_iterations: int


@dataclass(slots=True)  # one per item and step: slots make them cheaper to build and read
class StepItem:
    """One node of one request, ready to run."""

    request_id: str  # the request this work belongs to
    walk: str  # the walk the node sits in (a component may behave per walk)
    node: str  # the node's name inside the walk
    # component input port -> tensor: on the engine's device, or as produced when the engine sets
    # `host_inputs = True` (it reads them on the host, e.g. token ids)
    inputs: dict[str, torch.Tensor]
    options: dict[str, Any] = field(default_factory=dict)  # per-request model options (sampling, ...)
    iteration: int = 0  # loop iteration the item belongs to (0 outside loops)
    kv_slot: str = "main"  # which KV sequence of the request (guidance branches use several)
    loop: LoopSpec | None = None  # set: the item is an engine loop (module docstring)


@dataclass(slots=True)
class StepResult:
    """What one item produced."""

    request_id: str
    walk: str
    node: str
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # component output port -> tensor
    stop: bool = False  # ask the enclosing Loop to end after this iteration
    error: str | None = None  # set when this item failed; the request fails alone
    iteration: int = 0
    finish_reason: str | None = None  # why the request's generation ended ("stop", "length"), if it did
    more: bool = False  # an engine loop's iteration that does not end it: its item stays pending


class Engine(Protocol):
    """Runs one component for many requests.

    Contract: `submit` never blocks and never runs the model; `step` runs at most one batched
    execution and returns results for the items it finished (possibly none, possibly items
    submitted in earlier calls) and for the iterations of engine-loop items it ran (`more=True`
    but the last); `release` drops every trace of a request (cache pages, pending items) and is
    safe to call for unknown requests. Only the autoregressive engine takes engine-loop items.
    """

    def submit(self, item: StepItem) -> None: ...

    def step(self) -> list[StepResult]: ...

    def has_work(self) -> bool: ...

    def release(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache an autoregressive model needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


class CausalLM(Protocol):
    """What the autoregressive engine needs from a decoder model (`mstar/models/llama` implements it).

    `forward` takes the new tokens of a packed batch (requests one after another, as described by
    the metadata the engine gave `attn.prepare`) and returns their final hidden states;
    `compute_logits` maps the hidden states of the positions to sample from, with the token each was
    computed at (`input_ids` [N], on the same device: a head may score only the ids that token allows
    next, -inf elsewhere), to float32 logits [N, width] over the contiguous token ids
    [offset, offset + width): column c is token id offset + c. `logit_offset` (optional; absent
    means 0) is that offset, and a model whose logits do not cover the whole vocabulary also defines
    `logit_width` (the engine needs it before any logits exist: a resumed seeded sequence skips that
    many draws per token). The engine samples
    over the columns and hands back token ids; ids outside the window are never sampled. Both are
    fixed once the engine is built (its CUDA graphs capture at that width).
    A model may also define `supports_cuda_graphs() -> bool`; when it returns False the engine runs
    decode eagerly (e.g. a MoE whose expert path syncs the host for this dtype). A `compute_logits`
    taking an `out` argument (float32 [N, width]) may write the logits there and return it; the engine's
    decode graphs then pass the rows of the buffer their sampler reads, and copy only what comes back
    elsewhere.
    """

    kv_layout: KVLayout

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor: ...


def logit_offset(model: object) -> int:
    """The first token id `model.compute_logits` covers (`CausalLM.logit_offset`; 0 when absent)."""
    return int(getattr(model, "logit_offset", 0))
