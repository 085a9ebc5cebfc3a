"""The stateless engine: batches steps of one (walk, node) across requests.

Used by encoders, codecs, denoising steps and the toy model. A component implements

    run_batch(walk, node, inputs: list[dict[port, Tensor]], options: list[dict]) -> list[dict[port, Tensor]]

and may return a "stop" entry (bool) in an item's outputs to end its enclosing loop.

Optional abilities a component may add (duck-typed, each separate):
- `batch_key(item: StepItem) -> Hashable`: which pending items may share one call (default:
  same walk and node). A DiT uses it to batch the guidance branches and requests whose latent
  shapes match, whatever node or loop iteration each item belongs to.
- `run_items(items: list[StepItem]) -> list[dict]`: called instead of `run_batch`, for components
  that need the request ids or node names of a mixed batch (per-request state).
- `release(request_id)`: drop any per-request state the component keeps; called when the engine
  releases the request (finished, failed or cancelled).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from mstar.engines.base import StepItem, StepResult

logger = logging.getLogger(__name__)


class StatelessEngine:
    """Runs the oldest pending (walk, node) group, up to `max_batch_size` requests at once."""

    def __init__(self, module: Any, max_batch_size: int = 64) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.module = module
        self.max_batch_size = max_batch_size
        self._pending: deque[StepItem] = deque()
        self.last_step_items = 0  # items the latest step ran (mstar.engines.stats.ReportsStats)

    def submit(self, item: StepItem) -> None:
        self._pending.append(item)

    def has_work(self) -> bool:
        return bool(self._pending)

    def release(self, request_id: str) -> None:
        self._pending = deque(i for i in self._pending if i.request_id != request_id)
        release = getattr(self.module, "release", None)
        if release is not None:
            release(request_id)

    def stats(self) -> dict[str, float]:
        """Load counters (mstar.engines.stats): items waiting for a step."""
        return {"queue_depth": len(self._pending)}

    def step(self) -> list[StepResult]:
        batch = self._take_batch()
        self.last_step_items = len(batch)
        if not batch:
            return []
        try:
            return self._run(batch)
        except Exception:
            if len(batch) == 1:
                logger.exception("component step failed for request %s", batch[0].request_id)
                return [_failed(batch[0])]
            # Re-run one by one so a bad request fails alone.
            return [r for item in batch for r in self._run_alone(item)]

    def _take_batch(self) -> list[StepItem]:
        if not self._pending:
            return []
        key = self._key(self._pending[0])
        batch, rest = [], deque()
        for item in self._pending:
            if len(batch) < self.max_batch_size and self._key(item) == key:
                batch.append(item)
            else:
                rest.append(item)
        self._pending = rest
        return batch

    def _key(self, item: StepItem) -> Any:
        batch_key = getattr(self.module, "batch_key", None)
        return batch_key(item) if batch_key is not None else (item.walk, item.node)

    def _run(self, batch: list[StepItem]) -> list[StepResult]:
        head = batch[0]
        if hasattr(self.module, "run_items"):
            outputs = self.module.run_items(batch)
        else:
            outputs = self.module.run_batch(head.walk, head.node, [i.inputs for i in batch],
                                            [i.options for i in batch])
        if len(outputs) != len(batch):
            raise RuntimeError(f"{head.node}.run_batch returned {len(outputs)} results for {len(batch)} items")
        results = []
        for item, out in zip(batch, outputs):
            out = dict(out)
            stop = bool(out.pop("stop", False))
            results.append(StepResult(item.request_id, item.walk, item.node, out, stop=stop, iteration=item.iteration))
        return results

    def _run_alone(self, item: StepItem) -> list[StepResult]:
        try:
            return self._run([item])
        except Exception:
            logger.exception("component step failed for request %s", item.request_id)
            return [_failed(item)]


def _failed(item: StepItem) -> StepResult:
    import sys

    exc = sys.exc_info()[1]
    return StepResult(
        item.request_id, item.walk, item.node, error=f"{item.node} failed: {type(exc).__name__}: {exc}",
        iteration=item.iteration,
    )
