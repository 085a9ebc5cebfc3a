"""Chunk policies for StreamEdges: how a consumer cuts an ordered stream of items into chunks.

A policy is pure: given where the last chunk ended (`start`), how many items have arrived and
whether the stream has ended, it returns the next chunk as (lo, hi, next_start) or None.
"""

from __future__ import annotations

from dataclasses import dataclass


class ChunkPolicy:
    """Base class; subclasses are frozen dataclasses."""

    def next_chunk(self, start: int, available: int, ended: bool) -> tuple[int, int, int] | None:
        """Items [lo, hi) form the next chunk; the following call starts at next_start."""
        raise NotImplementedError

    def waits_for(self, start: int) -> int:
        """While the stream has not ended, no chunk is cut from `start` with fewer items available
        than this (a consumer need not ask before); 0 promises nothing."""
        return 0


@dataclass(frozen=True)
class Fixed(ChunkPolicy):
    """Non-overlapping chunks of `size` items (the first of `first` items when set: e.g. a prompt
    item joined with the first step's); the remainder is flushed at the end."""

    size: int
    first: int = 0  # items of the first chunk; 0 = size

    def __post_init__(self) -> None:
        if self.size < 1 or self.first < 0:
            raise ValueError(f"Fixed chunk size must be >= 1 and first >= 0, got {self.size}, {self.first}")

    def next_chunk(self, start: int, available: int, ended: bool) -> tuple[int, int, int] | None:
        size = self.first if start == 0 and self.first else self.size
        if available - start >= size:
            return start, start + size, start + size
        if ended and available > start:
            return start, available, available
        return None

    def waits_for(self, start: int) -> int:
        return start + (self.first if start == 0 and self.first else self.size)


@dataclass(frozen=True)
class SlidingWindow(ChunkPolicy):
    """Windows of `window` items advancing by `stride` (Orpheus' SNAC: 28 / 7).

    The first window is cut as soon as `window` items exist. At the end, items not yet covered by
    a window are flushed in one last window that ends at the stream's end. With `recut_at_end`,
    that last window is cut even when it brings no new item, so a consumer that keeps only the
    middle of each window can emit the tail of the stream from it. With `first` (< window), an
    early window of the first `first` items is cut as soon as they exist, before the first full
    window (which then starts at 0 again), so a consumer can answer sooner; it is skipped when the
    stream has already ended. The cursor after it is -1: "early window cut, full window at 0 next".
    """

    window: int
    stride: int
    recut_at_end: bool = False
    first: int = 0  # items of the early window; 0 = none

    def __post_init__(self) -> None:
        if not 1 <= self.stride <= self.window:
            raise ValueError(f"SlidingWindow needs 1 <= stride <= window, got stride={self.stride}, window={self.window}")
        if not 0 <= self.first < self.window:
            raise ValueError(f"SlidingWindow needs 0 <= first < window, got first={self.first}, window={self.window}")

    def next_chunk(self, start: int, available: int, ended: bool) -> tuple[int, int, int] | None:
        if self.first and start == 0 and available >= self.first and not ended:
            return 0, self.first, -1
        early_cut = start < 0
        start = max(start, 0)
        if available - start >= self.window:
            return start, start + self.window, start + self.stride
        if not ended or available == 0:
            return None
        covered = start + self.window - self.stride if start > 0 else (self.first if early_cut else 0)
        if available > covered or (self.recut_at_end and start <= available):
            return max(0, available - self.window), available, available + self.window
        return None

    def waits_for(self, start: int) -> int:
        return self.first if self.first and start == 0 else max(start, 0) + self.window


@dataclass(frozen=True)
class LeftContext(ChunkPolicy):
    """Chunks of `chunk` new items, each preceded by up to `context` earlier items.

    The first chunk has no context; the consumer trims the context part of its output.
    """

    chunk: int
    context: int

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.context < 0:
            raise ValueError(f"LeftContext needs chunk >= 1 and context >= 0, got {self.chunk}, {self.context}")

    def next_chunk(self, start: int, available: int, ended: bool) -> tuple[int, int, int] | None:
        if available - start >= self.chunk or (ended and available > start):
            hi = min(start + self.chunk, available)
            return max(0, start - self.context), hi, hi
        return None

    def waits_for(self, start: int) -> int:
        return start + self.chunk
