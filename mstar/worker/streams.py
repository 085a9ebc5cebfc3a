"""Consumer-side buffers of StreamEdges: items in seq order, cut into chunks by a policy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mstar.graph import ChunkPolicy

END = object()  # the stream is exhausted: no chunk will ever come


class StreamBuffer:
    """Items of one stream of one request, in order; ends once `total` items have arrived.

    `accept(item, accepted)` (the stream filter) drops items, in stream order, before they reach the
    chunk policy; chunks join items along `dim`.
    """

    def __init__(self, policy: ChunkPolicy, accept: Callable[[Any, int], bool] | None = None,
                 dim: int = 0) -> None:
        self.policy = policy
        self.accept = accept
        self.dim = dim  # items are concatenated along it
        self._received = 0  # items taken in order, accepted or not
        self._items: list[Any] = []
        self._early: dict[int, Any] = {}  # items that arrived ahead of a gap
        self._start = 0
        self._covered = 0  # items already delivered in an earlier chunk
        self._total: int | None = None
        self._need = policy.waits_for(0)  # while open, no chunk before this many accepted items

    def put(self, seq: int, value: Any) -> bool:
        """Take item `seq`; returns `ready()` (the caller need not ask again)."""
        if seq == self._received and not self._early:  # in order, nothing held back: the usual case
            self._received += 1
            if self.accept is None or self.accept(value, len(self._items)):
                self._items.append(value)
            return self._total is not None or len(self._items) >= self._need
        self._early[seq] = value
        while self._received in self._early:
            item = self._early.pop(self._received)
            self._received += 1
            if self.accept is None or self.accept(item, len(self._items)):
                self._items.append(item)
        return self.ready()

    def end(self, total: int) -> None:
        self._total = total

    def ready(self) -> bool:
        """Whether `pop` may return something other than None (a cheap test, asked per item)."""
        return self._total is not None or len(self._items) >= self._need

    @property
    def ended(self) -> bool:
        return self._total is not None and self._received >= self._total

    def pop(self) -> Chunk | object | None:
        """The next chunk, END, or None while waiting for items."""
        available, ended = len(self._items), self.ended
        cut = self.policy.next_chunk(self._start, available, ended)
        if cut is None:
            return END if ended else None
        lo, hi, self._start = cut
        self._need = self.policy.waits_for(self._start)
        new = hi - max(lo, self._covered)
        self._covered = max(self._covered, hi)
        final = ended and self.policy.next_chunk(self._start, available, True) is None
        return Chunk(torch.cat(self._items[lo:hi], dim=self.dim), new, final, lo)


@dataclass(slots=True)
class Chunk:
    """Items [lo, hi) of a stream (joined along the stream's dim); the last `new` were in no earlier chunk."""

    value: torch.Tensor
    new: int
    final: bool
    start: int = 0  # index of the chunk's first item in the (accepted) stream
