"""Classifier-free guidance, the outputs of branches it skips, starting noise, and the guidance scheduler
component's per-request bookkeeping.

A guidance scheduler component runs two nodes for many requests at once: `prepare` (before the step
loop) draws a request's noise and opens its state, `combine` (end of each step) applies guidance to the
branch velocities and takes a scheduler step. State is keyed by request id and dropped when the schedule
finishes or the engine releases the request, so requests at different steps share only DiT forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from mstar.engines.base import StatelessBase

State = TypeVar("State")


def combine_guidance(cond: torch.Tensor, uncond: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance: uncond + scale * (cond - uncond). `scale` may be [B, 1, 1, 1, 1]."""
    return uncond + scale * (cond - uncond)


def run_live_branches(items: Sequence[Any], needed: str, run: Callable[[list[Any]], Sequence[dict]]) -> list[dict]:
    """Each item's outputs: {} for a branch that guidance skips (it has no input `needed`), the others'
    from one `run` over them, in order."""
    out: list[dict] = [{} for _ in items]
    live = [i for i, item in enumerate(items) if needed in item.inputs]
    if live:
        for i, values in zip(live, run([items[i] for i in live]), strict=True):
            out[i] = values
    return out


def initial_noise(
    shape: Sequence[int], generators: Sequence[torch.Generator], dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Starting latents [B, ...]: row b drawn from `generators[b]` on the generator's device, then moved.

    One generator per request keeps a request's noise the same whichever batch it lands in.
    """
    if len(generators) != shape[0]:
        raise ValueError(f"need one generator per batch row: got {len(generators)} for batch {shape[0]}")
    rows = [torch.randn((1, *shape[1:]), generator=g, device=g.device, dtype=dtype) for g in generators]
    return torch.cat(rows).to(device)


class GuidanceSchedulerBase(StatelessBase, nn.Module, Generic[State]):
    """Runs nodes `prepare` and `combine` for many requests, holding each request's `State` between them.

    A subclass writes `_prepare` (which stores the new state in `_requests`) and `_combine` (which reads
    it with `_state` and deletes it on the last step)."""

    def __init__(self) -> None:
        super().__init__()
        self._requests: dict[str, State] = {}

    @property
    def num_requests(self) -> int:
        """Requests whose state is held (for leak tests)."""
        return len(self._requests)

    def release(self, request_id: str) -> None:
        """Forget the request (safe for unknown ids)."""
        self._requests.pop(request_id, None)

    @torch.no_grad()
    def run_items(self, items: list[Any]) -> list[dict]:
        return [self._prepare(i) if i.node == "prepare" else self._combine(i) for i in items]

    def _state(self, item: Any) -> State:
        """The state `prepare` opened for the item's request."""
        state = self._requests.get(item.request_id)
        if state is None:
            raise RuntimeError(f"request {item.request_id} has no scheduler state: its prepare node never ran here")
        return state

    def _prepare(self, item: Any) -> dict:
        raise NotImplementedError

    def _combine(self, item: Any) -> dict:
        raise NotImplementedError
