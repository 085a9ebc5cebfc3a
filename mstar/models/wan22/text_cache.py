"""Per-request cache of the DiT's cross-attention keys and values across denoising steps.

A request's text embeddings (prompt, negative prompt) never change during its denoising loop, so every
block's cross-attention (k, v) can be computed at the first step and reused at the others: ~1.2 TFLOP
(text embedder and 30 K/V projections of 512 tokens, both branches) saved per step at full size. An
entry is one batch composition (the (request, branch) of each row, in order), since rows of one
composition are stacked once; serving loops keep their composition from step to step.

Memory: ~189 MB per row at full size (30 blocks x k, v x 512 x 3072 bf16); the cache holds at most
`max_rows` rows in all and forgets the least recently used entry first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch

logger = logging.getLogger(__name__)

RowKey = tuple[str, Hashable]  # (request id, branch node)


class TextKVCache:
    """Maps a batch composition (row keys) to its per-block cross-attention (k, v).

    Promises: `get` returns what `put` stored for the same row keys only while every row's text tensor is
    the very object it was stored with (a new tensor means new text: a miss); `release` drops every entry
    holding the request; the rows held never exceed `max_rows` (0 disables the cache).
    """

    def __init__(self, max_rows: int) -> None:
        if max_rows < 0:
            raise ValueError(f"text K/V cache max_rows={max_rows} must be >= 0 (0 disables it)")
        self.max_rows = max_rows
        self._entries: OrderedDict[tuple[RowKey, ...], tuple[list[torch.Tensor], list]] = OrderedDict()
        self.hits = self.misses = 0

    @property
    def rows(self) -> int:
        """Rows held over all entries."""
        return sum(len(key) for key in self._entries)

    def get(self, rows: Sequence[RowKey], texts: Sequence[torch.Tensor]) -> list | None:
        """The stored (k, v) list for `rows` whose texts are `texts` (same objects), else None."""
        key = tuple(rows)
        entry = self._entries.get(key)
        if entry is None or len(entry[0]) != len(texts) or any(a is not b for a, b in zip(entry[0], texts)):
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[1]

    def put(self, rows: Sequence[RowKey], texts: Sequence[torch.Tensor], text_kv: list) -> None:
        """Store `text_kv` for `rows` (evicting least recently used entries to stay within max_rows)."""
        key = tuple(rows)
        if len(key) > self.max_rows:
            return
        self._entries.pop(key, None)
        while self._entries and self.rows + len(key) > self.max_rows:
            self._entries.popitem(last=False)
        self._entries[key] = (list(texts), text_kv)

    def release(self, request_id: str) -> None:
        """Forget every entry with a row of `request_id` (safe for unknown ids)."""
        for key in [k for k in self._entries if any(rid == request_id for rid, _ in k)]:
            del self._entries[key]
